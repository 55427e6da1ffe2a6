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


@dataclasses.dataclass
class StageKernels:
    """The F, I and W pieces of one stage, traced for fixed shapes.

    Args:
      fn: the stage function ``fn(params, x, inputs) -> y``.
      params: the stage's parameter pytree (arrays or shape structs).
      x: the input activation pytree, or None for the first stage.
      inputs: one microbatch's inputs (arrays or shape structs).
    """

    fn: Callable
    params: object
    x: object
    inputs: object

    def __post_init__(self):
        def abstract(tree):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)

        self.params = abstract(self.params)
        self.x = None if self.x is None else abstract(self.x)
        self.inputs = abstract(self.inputs)
        self.param_tree = jax.tree.structure(self.params)
        self.has_x = self.x is not None
        self._trace_forward()
        self.res_layout = FlatLayout.of(self.res_avals)
        self.y_layout = FlatLayout.of(jax.tree.leaves(self.y))
        self.x_layout = FlatLayout.of(jax.tree.leaves(self.x)) if self.has_x else None
        self.y_tree = jax.tree.structure(self.y)
        self._split_backward()

    # -- forward ---------------------------------------------------------------

    def _trace_forward(self):
        """Traces ``vjp`` of the stage; keeps only residuals that are not inputs."""
        box = {}

        def forward_all(params, x, inputs):
            if self.has_x:
                y, vjp_fn = jax.vjp(lambda p, x_: self.fn(p, x_, inputs), params, x)
            else:
                y, vjp_fn = jax.vjp(lambda p: self.fn(p, None, inputs), params)
            leaves, box["tree"] = jax.tree.flatten(vjp_fn)
            return jax.tree.leaves(y), leaves

        closed = jax.make_jaxpr(forward_all)(self.params, self.x, self.inputs)
        jaxpr = closed.jaxpr
        self.vjp_tree = box["tree"]
        n_p = len(jax.tree.leaves(self.params))
        n_x = len(jax.tree.leaves(self.x)) if self.has_x else 0
        p_vars = jaxpr.invars[:n_p]
        in_vars = jaxpr.invars[n_p + n_x :]
        y_shape = jax.eval_shape(lambda p, x, i: self.fn(p, x, i), self.params, self.x, self.inputs)
        self.y = y_shape
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
        self.classes = tuple(classes)
        self.res_avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in res_vars]
        self._f_fn = _piece(
            jaxpr.constvars, jaxpr.invars, list(y_out) + res_vars, jaxpr.eqns, closed.consts, "F"
        )
        self._n_y = n_y

    def forward(self, params, x, inputs):
        """The F piece: returns ``(y_leaves, residuals)``, two lists."""
        args = jax.tree.leaves(params) + (jax.tree.leaves(x) if self.has_x else [])
        out = self._f_fn(*args, *jax.tree.leaves(inputs))
        return list(out[: self._n_y]), list(out[self._n_y :])

    # -- backward, split ---------------------------------------------------------

    def _backward_flat(self, p_leaves, in_leaves, res, g_leaves):
        leaves = []
        for kind, j in self.classes:
            leaves.append(
                j if kind == "const" else {"p": p_leaves, "in": in_leaves, "res": res}[kind][j]
            )
        vjp_fn = jax.tree.unflatten(self.vjp_tree, leaves)
        cts = vjp_fn(jax.tree.unflatten(self.y_tree, g_leaves))
        dparams = jax.tree.leaves(cts[0])
        dx = jax.tree.leaves(cts[1]) if self.has_x else []
        return dparams, dx

    def _split_backward(self):
        p_avals = jax.tree.leaves(self.params)
        in_avals = jax.tree.leaves(self.inputs)
        g_avals = jax.tree.leaves(self.y)
        closed = _inline_calls(
            jax.make_jaxpr(self._backward_flat)(p_avals, in_avals, self.res_avals, g_avals)
        )
        jaxpr = closed.jaxpr
        n_p, n_in, n_res = len(p_avals), len(in_avals), len(self.res_avals)
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
        self.carry_avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in carry]
        self.carry_layout = FlatLayout.of(self.carry_avals)

        def sub(invars_, outvars_, eqn_ids, name):
            eqns = [jaxpr.eqns[i] for i in sorted(eqn_ids)]
            return _piece(jaxpr.constvars, invars_, outvars_, eqns, closed.consts, name)

        base = p_vars + in_vars + res_vars
        self._i_fn = sub(base + g_vars, dx_out + carry, i_eqns, "I")
        self._w_fn = sub(base + carry, dp_out, w_eqns, "W")
        self.num_dx = len(dx_out)
        self.i_flops_share = len(i_eqns) / max(1, len(jaxpr.eqns))

    def input_grad(self, params, inputs, res, g_leaves):
        """The I piece: returns ``(dx_leaves, carry_leaves)``."""
        out = self._i_fn(*jax.tree.leaves(params), *jax.tree.leaves(inputs), *res, *g_leaves)
        return list(out[: self.num_dx]), list(out[self.num_dx :])

    def weight_grad(self, params, inputs, res, carry):
        """The W piece: returns the parameter gradient leaves."""
        return list(self._w_fn(*jax.tree.leaves(params), *jax.tree.leaves(inputs), *res, *carry))
