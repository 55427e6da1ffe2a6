"""Stage kernels: one stage function turned into its F, I and W pieces.

A user's stage is ``stage(params, x, inputs) -> y``. For the pipeline it is cut
into three pieces that can run in different ticks on the same rank:

- ``F``: runs the stage and keeps the residuals its backward needs (what
  `jax.vjp` would keep), minus the parameters and the microbatch inputs, which
  the backward can read again from where they live.
- ``I``: from the residuals and the output gradient, the gradient of the input
  ``x`` (sent upstream), plus the intermediate values the weight gradient
  will need: the ``carry``.
- ``W``: from the residuals and the carry, the gradient of the parameters.

The split is exact: the backward is traced once to a jaxpr, and its equations
are divided between the pieces by what each output depends on, so ``I`` and
``W`` together do the work of one backward, with nothing recomputed. A full
backward ``B`` runs as ``I`` then ``W``.

Values between pieces are kept as flat vectors, one per dtype (`FlatLayout`),
so that the stages, whose pytrees differ, can share fixed-size buffers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal, jaxpr_as_fun


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each array of a list lives in one flat vector per dtype."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    offsets: tuple[int, ...]
    sizes: dict  # dtype -> total elements

    @classmethod
    def of(cls, avals: Sequence) -> FlatLayout:
        shapes, dtypes, offsets, sizes = [], [], [], {}
        for a in avals:
            dt = str(np.dtype(a.dtype))
            n = math.prod(a.shape)
            offsets.append(sizes.get(dt, 0))
            sizes[dt] = sizes.get(dt, 0) + n
            shapes.append(tuple(a.shape))
            dtypes.append(dt)
        return cls(tuple(shapes), tuple(dtypes), tuple(offsets), sizes)

    def pack(self, leaves, widths: dict) -> dict:
        """Flattens `leaves` into ``{dtype: vector of widths[dtype]}``, zero-padded."""
        parts = {dt: [] for dt in widths}
        for leaf, dt in zip(leaves, self.dtypes):
            parts[dt].append(jnp.ravel(leaf))
        out = {}
        for dt, width in widths.items():
            used = self.sizes.get(dt, 0)
            chunks = parts[dt]
            if width > used:
                chunks = chunks + [jnp.zeros((width - used,), dt)]
            out[dt] = jnp.concatenate(chunks) if chunks else jnp.zeros((0,), dt)
        return out

    def unpack(self, flat: dict) -> list:
        """The inverse of `pack`: reads each array back from its vector."""
        out = []
        for shape, dt, off in zip(self.shapes, self.dtypes, self.offsets):
            n = math.prod(shape)
            out.append(jax.lax.slice_in_dim(flat[dt], off, off + n).reshape(shape))
        return out


def merge_widths(*layouts: FlatLayout) -> dict:
    """The per-dtype widths that fit every layout."""
    widths: dict = {}
    for layout in layouts:
        for dt, n in layout.sizes.items():
            widths[dt] = max(widths.get(dt, 0), n)
    return widths


def _is_lit(v) -> bool:
    return isinstance(v, Literal)


# Call-like primitives whose body the I/W split must see: a stage that is
# itself jitted, or rematerialised, puts its whole backward in one equation.
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


def _eval_inline(jaxpr, consts, args):
    """Evaluates `jaxpr`, running the bodies of call-like equations inline."""
    env = {}

    def read(v):
        return v.val if _is_lit(v) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        body = _body(eqn)
        if body is not None:
            outs = _eval_inline(body[0], body[1], invals)
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            subfuns = []
            if isinstance(params, tuple):  # older JAX: (subfuns, params)
                subfuns, params = params
            outs = eqn.primitive.bind(*subfuns, *invals, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, out in zip(eqn.outvars, outs):
            env[v] = out
    return [read(v) for v in jaxpr.outvars]


def _inline_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The same computation with jit and remat bodies spliced in (recursively)."""
    if not any(_body(e) is not None for e in closed.jaxpr.eqns):
        return closed
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *args: _eval_inline(closed.jaxpr, closed.consts, args))(*avals)


def _piece(constvars, invars, outvars, eqns, consts, name: str):
    """A callable that runs `eqns` of a traced jaxpr as one piece."""
    effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
    info = DebugInfo(
        "jpipe",
        name,
        tuple(f"in{i}" for i in range(len(invars))),
        tuple(f"out{i}" for i in range(len(outvars))),
    )
    jaxpr = Jaxpr(constvars, invars, outvars, eqns, effects, debug_info=info)
    return jaxpr_as_fun(ClosedJaxpr(jaxpr, consts))


@dataclasses.dataclass(frozen=True)
class StageKernels:
    """The F, I and W pieces of one stage, traced for fixed shapes.

    Made by `StageKernels.trace`; every field is fixed at tracing.

    Attributes:
      fn: the stage function ``fn(params, x, inputs) -> y``.
      params, x, inputs: shape structs of the stage's parameters, its input
        activation (None for a stage that takes none) and one microbatch's inputs.
      y, y_tree: shape structs of the output, and its tree structure.
      res_avals, carry_avals: the residuals F keeps and the values I hands W.
      y_layout, res_layout, carry_layout: where each of those lives in one
        flat vector per dtype.
      i_flops_share: the share of the backward's equations that I runs.
    """

    fn: Callable
    params: Any
    x: Any
    inputs: Any
    y: Any
    y_tree: Any
    res_avals: tuple
    carry_avals: tuple
    y_layout: FlatLayout
    res_layout: FlatLayout
    carry_layout: FlatLayout
    i_flops_share: float
    _vjp_tree: Any = dataclasses.field(repr=False)
    _classes: tuple = dataclasses.field(repr=False)
    _f_fn: Callable = dataclasses.field(repr=False)
    _i_fn: Callable = dataclasses.field(repr=False)
    _w_fn: Callable = dataclasses.field(repr=False)
    _num_dx: int = dataclasses.field(repr=False)

    @classmethod
    def trace(cls, fn: Callable, params, x, inputs) -> StageKernels:
        """Traces `fn` for the shapes of `params`, `x` (or None) and `inputs`."""

        def abstract(tree):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)

        params, inputs = abstract(params), abstract(inputs)
        x = None if x is None else abstract(x)
        forward = _trace_forward(fn, params, x, inputs)
        backward = _split_backward(forward, params, x, inputs)
        return cls(
            fn=fn,
            params=params,
            x=x,
            inputs=inputs,
            y=forward.y,
            y_tree=forward.y_tree,
            res_avals=forward.res_avals,
            carry_avals=backward.carry_avals,
            y_layout=FlatLayout.of(jax.tree.leaves(forward.y)),
            res_layout=FlatLayout.of(forward.res_avals),
            carry_layout=FlatLayout.of(backward.carry_avals),
            i_flops_share=backward.i_flops_share,
            _vjp_tree=forward.vjp_tree,
            _classes=forward.classes,
            _f_fn=forward.f_fn,
            _i_fn=backward.i_fn,
            _w_fn=backward.w_fn,
            _num_dx=backward.num_dx,
        )

    @property
    def has_x(self) -> bool:
        return self.x is not None

    def forward(self, params, x, inputs):
        """The F piece: returns ``(y_leaves, residuals)``, two lists."""
        args = jax.tree.leaves(params) + (jax.tree.leaves(x) if self.has_x else [])
        out = self._f_fn(*args, *jax.tree.leaves(inputs))
        n_y = self.y_tree.num_leaves
        return list(out[:n_y]), list(out[n_y:])

    def input_grad(self, params, inputs, res, g_leaves):
        """The I piece: returns ``(dx_leaves, carry_leaves)``."""
        out = self._i_fn(*jax.tree.leaves(params), *jax.tree.leaves(inputs), *res, *g_leaves)
        return list(out[: self._num_dx]), list(out[self._num_dx :])

    def weight_grad(self, params, inputs, res, carry):
        """The W piece: returns the parameter gradient leaves."""
        return list(self._w_fn(*jax.tree.leaves(params), *jax.tree.leaves(inputs), *res, *carry))


def loss_seed(num_microbatches: int, dtype):
    """The output gradient of the last stage's loss: ``1 / M``.

    The pipeline's loss is the mean over microbatches, so each microbatch's
    backward starts from ``d(mean) / d(loss_m) = 1 / M``; the gradients then
    sum to those of the mean, as `jax.value_and_grad` of the unpipelined model.
    """
    return [jnp.full((), 1.0 / num_microbatches, dtype)]


def stage_pieces(
    kernels: Sequence[StageKernels], params_list, inputs, devices, num_microbatches: int = 1
) -> list[dict]:
    """Every stage's pieces, jitted, with real arguments to call them on: for timing.

    Stage `s` runs on ``devices[s]`` and is fed stage ``s - 1``'s real output;
    output gradients are ones, and the last stage's is `loss_seed`.

    Returns:
      Per stage, ``{"F", "I", "W", "B": (jitted piece, args)}``; ``B`` is I
      then W in one program, the backward of a schedule that does not split it.
    """
    out, x = [], None
    for s, k in enumerate(kernels):
        p = jax.device_put(params_list[s], devices[s])
        mb = jax.device_put(inputs, devices[s])
        x = None if x is None else jax.device_put(x, devices[s])
        forward = jax.jit(k.forward)
        y, res = forward(p, x, mb)
        if s == len(kernels) - 1:
            g = loss_seed(num_microbatches, y[0].dtype)
        else:
            g = [jnp.ones_like(leaf) for leaf in y]
        input_grad = jax.jit(k.input_grad)
        _, carry = input_grad(p, mb, res, g)

        def backward(params, inputs, res, g, k=k):
            dx, kept = k.input_grad(params, inputs, res, g)
            return dx, k.weight_grad(params, inputs, res, kept)

        out.append(
            {
                "F": (forward, (p, x, mb)),
                "I": (input_grad, (p, mb, res, g)),
                "W": (jax.jit(k.weight_grad), (p, mb, res, carry)),
                "B": (jax.jit(backward), (p, mb, res, g)),
            }
        )
        x = jax.tree.unflatten(k.y_tree, y)
    return out


class _Forward(NamedTuple):
    y: Any
    y_tree: Any
    vjp_tree: Any
    classes: tuple
    res_avals: tuple
    f_fn: Callable


class _Backward(NamedTuple):
    carry_avals: tuple
    i_fn: Callable
    w_fn: Callable
    num_dx: int
    i_flops_share: float


def _trace_forward(fn, params, x, inputs) -> _Forward:
    """Traces ``vjp`` of the stage; keeps only residuals that are not inputs."""
    box = {}
    has_x = x is not None

    def forward_all(params, x, inputs):
        if has_x:
            y, vjp_fn = jax.vjp(lambda p, x_: fn(p, x_, inputs), params, x)
        else:
            y, vjp_fn = jax.vjp(lambda p: fn(p, None, inputs), params)
        leaves, box["tree"] = jax.tree.flatten(vjp_fn)
        return jax.tree.leaves(y), leaves

    closed = jax.make_jaxpr(forward_all)(params, x, inputs)
    jaxpr = closed.jaxpr
    n_p = len(jax.tree.leaves(params))
    n_x = len(jax.tree.leaves(x)) if has_x else 0
    p_vars = jaxpr.invars[:n_p]
    in_vars = jaxpr.invars[n_p + n_x :]
    y_shape = jax.eval_shape(lambda p, x, i: fn(p, x, i), params, x, inputs)
    n_y = len(jax.tree.leaves(y_shape))
    y_out, leaf_out = jaxpr.outvars[:n_y], jaxpr.outvars[n_y:]
    classes, res_vars = [], []
    for v in leaf_out:
        if _is_lit(v):
            classes.append(("const", v.val))
        elif v in p_vars:
            classes.append(("p", p_vars.index(v)))
        elif v in in_vars:
            classes.append(("in", in_vars.index(v)))
        else:
            if v not in res_vars:
                res_vars.append(v)
            classes.append(("res", res_vars.index(v)))
    f_fn = _piece(
        jaxpr.constvars, jaxpr.invars, list(y_out) + res_vars, jaxpr.eqns, closed.consts, "F"
    )
    return _Forward(
        y=y_shape,
        y_tree=jax.tree.structure(y_shape),
        vjp_tree=box["tree"],
        classes=tuple(classes),
        res_avals=tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in res_vars),
        f_fn=f_fn,
    )


def _split_backward(forward: _Forward, params, x, inputs) -> _Backward:
    """Traces the backward once and divides its equations between I and W."""
    has_x = x is not None

    def backward_flat(p_leaves, in_leaves, res, g_leaves):
        leaves = []
        for kind, j in forward.classes:
            leaves.append(
                j if kind == "const" else {"p": p_leaves, "in": in_leaves, "res": res}[kind][j]
            )
        vjp_fn = jax.tree.unflatten(forward.vjp_tree, leaves)
        cts = vjp_fn(jax.tree.unflatten(forward.y_tree, g_leaves))
        dparams = jax.tree.leaves(cts[0])
        dx = jax.tree.leaves(cts[1]) if has_x else []
        return dparams, dx

    p_avals = jax.tree.leaves(params)
    in_avals = jax.tree.leaves(inputs)
    g_avals = jax.tree.leaves(forward.y)
    res_avals = list(forward.res_avals)
    closed = _inline_calls(jax.make_jaxpr(backward_flat)(p_avals, in_avals, res_avals, g_avals))
    jaxpr = closed.jaxpr
    n_p, n_in, n_res = len(p_avals), len(in_avals), len(res_avals)
    invars = list(jaxpr.invars)
    p_vars = invars[:n_p]
    in_vars = invars[n_p : n_p + n_in]
    res_vars = invars[n_p + n_in : n_p + n_in + n_res]
    g_vars = invars[n_p + n_in + n_res :]
    n_dp = len(p_avals)
    dp_out = list(jaxpr.outvars[:n_dp])
    dx_out = list(jaxpr.outvars[n_dp:])

    producer = {}
    for idx, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            producer[v] = idx

    def slice_for(outs, stop=frozenset()):
        needed, frontier = set(), [v for v in outs if not _is_lit(v)]
        seen = set()
        while frontier:
            v = frontier.pop()
            if v in seen:
                continue
            seen.add(v)
            idx = producer.get(v)
            if idx is None or idx in stop:
                continue
            needed.add(idx)
            frontier.extend(u for u in jaxpr.eqns[idx].invars if not _is_lit(u))
        return needed

    # I: everything the input gradient needs, and the whole cotangent chain
    # through the stage: every equation that reads a parameter (as
    # ``dy @ w.T`` does) and what it needs. W: the rest, the products that
    # make parameter gradients (``x.T @ dy``) from what I carries over.
    # For a middle stage the chain is what dx needs anyway; for the first
    # stage, which has no dx, it keeps the backward through its layers in
    # I instead of leaving all of it to W, so I and W are closer in cost
    # (a two-layer first stage: one product in I, two in W). A value that
    # the backward recomputes from a parameter and only W needs (a cast,
    # a weight norm) is thereby made in I and carried to W: exact, at the
    # cost of carry memory.
    live = slice_for(dp_out + dx_out)
    params_read = set(p_vars)
    chain = [
        v
        for idx in sorted(live)
        if any(not _is_lit(u) and u in params_read for u in jaxpr.eqns[idx].invars)
        for v in jaxpr.eqns[idx].outvars
    ]
    i_eqns = slice_for(dx_out + chain)
    w_eqns = slice_for(dp_out, stop=frozenset(i_eqns))
    # The carry: values the W piece reads that the I piece made or received.
    i_made = {v for idx in i_eqns for v in jaxpr.eqns[idx].outvars}
    carry, seen = [], set()
    w_reads = [u for idx in sorted(w_eqns) for u in jaxpr.eqns[idx].invars] + dp_out
    for u in w_reads:
        if _is_lit(u) or u in seen:
            continue
        if u in i_made or u in set(g_vars):
            carry.append(u)
            seen.add(u)
    carry_avals = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in carry)

    def sub(invars_, outvars_, eqn_ids, name):
        eqns = [jaxpr.eqns[i] for i in sorted(eqn_ids)]
        return _piece(jaxpr.constvars, invars_, outvars_, eqns, closed.consts, name)

    base = p_vars + in_vars + res_vars
    return _Backward(
        carry_avals=carry_avals,
        i_fn=sub(base + g_vars, dx_out + carry, i_eqns, "I"),
        w_fn=sub(base + carry, dp_out, w_eqns, "W"),
        num_dx=len(dx_out),
        i_flops_share=len(i_eqns) / max(1, len(jaxpr.eqns)),
    )
