"""Tracing a stage as one device of the mesh sees it, under JAX's rules for varying values.

A stage function may write its own collectives over the mesh's other axes
(``lax.psum(y, "tensor")``, `all_gather`, `psum_scatter`, ...), as a
`jax.shard_map` user writes them. Their gradients are right only where JAX
knows which values are the same on every device of an axis (*invariant*)
and which differ (*varying*): an invariant input used with a varying weight
is cast to varying (``pvary``), and the transpose of that cast sums the
cotangent over the axis, the all-reduce a Megatron block's input gradient
needs. Traced with the axis names merely bound, that cast and its sum are
missing and the gradients are silently wrong (2x the split weights'
gradients on a 2-way tensor axis).

So `make_jaxpr` traces inside a `jax.shard_map` over the abstract mesh (every
axis manual, ``check_vma=True``), each argument varying over the axes it is
given, with a nested `jax.make_jaxpr` that records the one-device program
exactly (its inputs and outputs are the stage's own, nothing reshaped). Then
it rewrites that program for jpipe's own `shard_map`, which runs with
``check_vma=False`` (its buffers mix every stage's values): the casts become
identities and the invariant-result collectives (``psum_invariant``) the
plain ones (``psum``), which compute the same thing. What the stage pieces
are made of is then an ordinary jaxpr, split into F, I and W as before.

The stage contract, as `trace_stage_view` sets it:

- every value varies over ``pipe`` (ranks run different stages) and over the
  batch axes (``data``, ``fsdp``: each device has its own rows), so nothing
  is ever summed over them by a transpose: the pipeline averages the
  gradients over the batch axes once, after the loop;
- a parameter varies over the axes its `PartitionSpec` splits it over
  (``tensor``) and is invariant over the other model axes;
- the activation a stage receives (`x`), the microbatch inputs and the
  activation it returns are invariant over the model axes: the same on
  every device of ``tensor``. A stage that shards its activations inside
  itself (sequence parallelism with `psum_scatter`, then `all_gather`) must
  gather them back before it returns; one that returns a value still varying
  over ``tensor`` is refused when traced.

A collective over ``pipe`` is refused when traced (`collectives_over`): in a
tick the ranks run different stages, so it would wait for ranks that never
join it. ``lax.axis_index("pipe")`` is no collective and stays allowed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxprs_in_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Casts between invariant and varying values: identities at run time.
_CASTS = frozenset({"pvary", "pcast"})
# The `jax.lax` functions that bind each collective primitive, for messages.
_USER_NAMES = {
    "psum": "lax.psum (or lax.pmean)",
    "psum_invariant": "lax.psum (or lax.pmean)",
    "pmax": "lax.pmax",
    "pmin": "lax.pmin",
    "ppermute": "lax.ppermute",
    "all_gather": "lax.all_gather",
    "all_gather_invariant": "lax.all_gather",
    "reduce_scatter": "lax.psum_scatter",
    "all_to_all": "lax.all_to_all",
    "pbroadcast": "lax.pbroadcast",
}
# Not communication: allowed over any axis.
_NOT_COLLECTIVES = _CASTS | {"axis_index"}


@dataclasses.dataclass(frozen=True)
class DeviceView:
    """How one device of the mesh sees a stage's values, for tracing it.

    Attributes:
      mesh: the abstract mesh, every axis of it (`jax.sharding.Mesh.abstract_mesh`).
      pipe_axis: the pipeline axis: nothing in a stage may communicate over it.
      batch_axes: the axes the batch's rows are split over (``data``, ``fsdp``).
      param_axes: per parameter leaf of the stage, the model axes its
        `PartitionSpec` splits it over.
    """

    mesh: Any
    pipe_axis: str
    batch_axes: tuple[str, ...]
    param_axes: tuple[frozenset, ...]

    @property
    def always(self) -> frozenset:
        """The axes every value of a stage varies over: ``pipe`` and the batch axes."""
        return frozenset((self.pipe_axis, *self.batch_axes))

    def param_vmas(self) -> list[frozenset]:
        """Per parameter leaf, the axes it varies over: `always` and its spec's."""
        return [self.always | axes for axes in self.param_axes]

    def check(self, closed: ClosedJaxpr, stage: str) -> None:
        """Refuses a collective over the pipeline axis anywhere in `closed`."""
        found = collectives_over(closed, self.pipe_axis)
        if found:
            called = _USER_NAMES.get(found[0], found[0])
            raise ValueError(
                f"{stage} calls {called} over the pipeline axis {self.pipe_axis!r}: in a "
                f"tick the ranks of {self.pipe_axis!r} run different stages (or none), so a "
                "collective over it would wait for ranks that never join it (a hang on GPUs, "
                "a rendezvous timeout on CPUs). Collectives over the other axes "
                f"({', '.join(a for a in self.mesh.axis_names if a != self.pipe_axis) or 'none'})"
                f" are fine, and so is lax.axis_index({self.pipe_axis!r})."
            )

    def check_activation(self, vmas, stage: str, what: str) -> None:
        """Refuses `what` (a stage's output) varying over a model axis."""
        for vma in vmas:
            extra = sorted(set(vma) - self.always)
            if extra:
                raise ValueError(
                    f"{stage} returns {what} that differs between the devices of "
                    f"{', '.join(map(repr, extra))}: a stage's output must be the same on every "
                    "device of the model axes: close a split block with lax.psum (or "
                    "lax.pmean), and gather sharded activations back with "
                    'lax.all_gather(..., to="invarying"), which JAX knows to be the same on '
                    "every device (a plain all_gather's result counts as varying)"
                )


def _leading(avals, vmas, mesh):
    """Shape structs with a leading dimension split over each leaf's varying axes."""
    sizes = dict(mesh.shape)
    out = []
    for a, axes in zip(avals, vmas):
        axes = tuple(ax for ax in mesh.axis_names if ax in axes)
        n = math.prod(sizes[ax] for ax in axes)
        spec = P(axes) if axes else P()
        out.append(jax.ShapeDtypeStruct((n, *a.shape), a.dtype, sharding=NamedSharding(mesh, spec)))
    return out


def make_jaxpr_varying(fn: Callable, avals: Sequence, vmas: Sequence, mesh):
    """Traces flat ``fn(*leaves) -> list`` as one device of `mesh` with ``check_vma``.

    Args:
      fn: a function of flat array leaves returning a flat list of arrays.
      avals: shape structs of its leaves, as one device holds them.
      vmas: per leaf, the mesh axes it varies over.
      mesh: the abstract mesh (`jax.sharding.Mesh.abstract_mesh`).

    Returns:
      ``(varying, plain, out_vmas)``: the one-device jaxpr with JAX's
      annotations and casts, the same program rewritten for a `shard_map`
      without ``check_vma`` (`without_casts`), and each output's varying axes.
    """
    box = {}
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]

    def body(*leaves):
        box["jaxpr"] = jax.make_jaxpr(fn)(*(leaf[0] for leaf in leaves))
        return jnp.zeros(())

    lead = _leading(avals, vmas, mesh)
    specs = tuple(a.sharding.spec for a in lead)
    traced = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=True)
    jax.make_jaxpr(traced)(*lead)
    varying = box["jaxpr"]
    out_vmas = [varying_axes(v.aval) for v in varying.jaxpr.outvars]
    return varying, without_casts(varying), out_vmas


def varying_axes(aval) -> frozenset:
    """The mesh axes a traced value varies over (JAX names them ``aval.mat.varying``)."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def _plain(aval):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def without_casts(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` for a `shard_map` with ``check_vma=False``: casts dropped, collectives plain.

    ``pvary`` becomes the identity and ``psum_invariant`` (a sum whose result
    is the same on every device) the plain ``psum``; shardings recorded
    against the tracing mesh are dropped; sub-jaxprs (scan, cond, while
    bodies) are rewritten alike, and jit and remat calls inlined.
    """
    if not _has_casts(closed.jaxpr):
        return closed
    avals = [_plain(v.aval) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *args: _evaluate(closed.jaxpr, closed.consts, args))(*avals)


def _sub_jaxprs(params: dict):
    """``(name, value)`` of the params that are jaxprs or tuples of them."""
    for name, value in params.items():
        if isinstance(value, Jaxpr | ClosedJaxpr):
            yield name, value
        elif (
            isinstance(value, tuple)
            and value
            and all(isinstance(v, Jaxpr | ClosedJaxpr) for v in value)
        ):
            yield name, value


def _each_jaxpr(value):
    return value if isinstance(value, tuple) else (value,)


def _has_casts(jaxpr) -> bool:
    """Whether anything in `jaxpr`, sub-jaxprs included, is typed or cast by ``check_vma``."""
    for v in jaxpr.invars:
        if varying_axes(v.aval):
            return True
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _CASTS or eqn.primitive.name.endswith("_invariant"):
            return True
        if any(varying_axes(v.aval) for v in eqn.outvars):
            return True
        if any(_has_casts(sub) for sub in jaxprs_in_params(eqn.params)):
            return True
    return False


# Call-like primitives whose body the I/W split (`jpipe.stage.pieces`) and
# `without_casts` must see: a stage that is itself jitted, or rematerialised,
# puts its whole backward in one equation.
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
_REMATS = ("remat", "checkpoint", "remat2")


def _body(eqn):
    """``(jaxpr, consts)`` of a call-like equation, or None."""
    name = eqn.primitive.name
    if name in _CALLS and _CALLS[name] in eqn.params:
        sub = eqn.params[_CALLS[name]]
    elif name in _REMATS and "jaxpr" in eqn.params:
        sub = eqn.params["jaxpr"]
    else:
        return None
    if isinstance(sub, ClosedJaxpr):
        return sub.jaxpr, sub.consts
    return sub, []


def _bind(eqn, invals, **changes):
    """Binds `eqn`'s primitive on `invals`, with some params changed; a list of outputs."""
    params = eqn.primitive.get_bind_params(dict(eqn.params, **changes))
    subfuns = []
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
    outs = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _evaluate(jaxpr, consts, args) -> list:
    env = {}

    def read(v):
        if not isinstance(v, Literal):
            return env[v]
        # A literal made in the trace carries its type on the manual mesh:
        # its value alone, so that nothing in a piece names that mesh.
        return v.val if isinstance(v.val, int | float | bool) else np.asarray(v.val)

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = np.asarray(c) if isinstance(c, jax.Array) else c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        body = _body(eqn)
        if name in _CASTS:
            outs = invals[: len(eqn.outvars)]
        elif name == "psum_invariant":
            outs = [lax.psum(v, eqn.params["axes"]) for v in invals]
        elif name == "all_gather_invariant":
            p = eqn.params
            outs = [
                lax.all_gather(v, p["axis_name"], axis=p["all_gather_dimension"], tiled=p["tiled"])
                for v in invals
            ]
        elif body is not None:
            outs = _evaluate(body[0], body[1], invals)
        else:
            changes = _unmeshed(eqn.params)
            for key, value in _sub_jaxprs(eqn.params):
                rewritten = tuple(_rewrite(j) for j in _each_jaxpr(value))
                changes[key] = rewritten if isinstance(value, tuple) else rewritten[0]
            outs = _bind(eqn, invals, **changes)
        for v, out in zip(eqn.outvars, outs):
            env[v] = out
    return [read(v) for v in jaxpr.outvars]


def _manual_sharding(value) -> bool:
    """A sharding on a mesh whose every axis is manual: the trace's, not a real layout."""
    mesh = getattr(value, "mesh", None)
    types = getattr(mesh, "axis_types", None)
    return bool(types) and all("Manual" in str(t) for t in types)


def _unmeshed(params: dict) -> dict:
    """The shardings recorded against the tracing mesh, dropped (None, the default).

    Ops such as ``broadcast_in_dim`` record the manual mesh they were traced
    in; without it a piece runs in any program over any mesh (jpipe's own,
    or a piece compiled alone), as one device.
    """
    return {
        k: None
        for k, v in params.items()
        if k in ("sharding", "out_sharding") and _manual_sharding(v)
    }


def _rewrite(sub):
    """A sub-jaxpr param rewritten by `without_casts`, of the same kind (closed or open)."""
    if isinstance(sub, ClosedJaxpr):
        return without_casts(sub)
    closed = without_casts(ClosedJaxpr(sub, []))
    if closed.consts:
        raise NotImplementedError(
            "jpipe: a stage's open sub-jaxpr made constants when its casts were removed"
        )
    return closed.jaxpr


def _axes_named(params: dict) -> tuple:
    names = []
    for key in ("axes", "axis_name"):
        value = params.get(key)
        if value is None:
            continue
        names.extend(value if isinstance(value, tuple | list) else (value,))
    return tuple(n for n in names if isinstance(n, str))


def collectives_over(closed: ClosedJaxpr, axis: str) -> list[str]:
    """The primitives in `closed` (sub-jaxprs included) that communicate over `axis`."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name not in _NOT_COLLECTIVES and axis in _axes_named(eqn.params):
                found.append(name)
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return found
