"""Stage kernels: one stage function turned into its F, I and W pieces.

A user's stage is ``stage(params, x, inputs) -> y``. For the pipeline it is cut
into three pieces that can run in different ticks on the same rank:

- ``F``: runs the stage and keeps the residuals its backward needs (what
  `jax.vjp` would keep) that are activations, stashed per microbatch.
- ``I``: from the residuals and the output gradient, the gradient of the input
  ``x`` (sent upstream), plus the intermediate values the weight gradient
  will need: the ``carry``.
- ``W``: from the residuals and the carry, the gradient of the parameters.

All three receive the parameters and the microbatch inputs, so F stashes
none of the residuals that can be had from those alone. Residuals that are
parameters or inputs themselves are read again from where they live.
Residuals *made* from parameters and inputs alone are rebuilt by ``I`` and
``W``, each making the ones it reads: a bf16 copy of a float32 weight, a
slice of a stacked weight, an embedding lookup, a causal mask
(`_activation_derived` decides, over the forward's jaxpr, through call and
scan bodies; `_rebuilder` makes the dead-code-eliminated forward equations
that rebuild them). What F stashes is what depends on the activation
``x``, on a matrix product of microbatch data (in the first stage, which
has no ``x``, the activations come from its inputs; redoing a product
would duplicate the forward), or on an equation with effects. On GPT-2
small (bf16 compute, float32 weights, 4 sequences of 1,024 tokens, 3
blocks a stage; `bench/memory.py`'s shapes) that takes a middle stage's
``res_avals`` from 2,382 MiB to 1,622 MiB a microbatch: the bf16 weight
copies and the attention mask, broadcast over batch and heads, are rebuilt
(`tests/test_rebuilt_residuals.py` checks small cases).

The split is exact: the backward is traced once to a jaxpr, and its equations
are divided between the pieces by what each output depends on, so ``I`` and
``W`` together do the work of one backward, with nothing recomputed but the
rebuilt residuals (cheap by construction, and never carried from ``I`` to
``W``: the division and the carry do not depend on which residuals are
rebuilt). A full backward ``B`` runs as ``I`` then ``W``. The bodies of jit
and remat calls are spliced in first (`_inline_calls`), so the division sees
inside them.

Scanned layers. A stage that runs its layers in `jax.lax.scan` (``nn.scan``,
``nn.remat_scan`` with one level, a scan of a `jax.checkpoint`-ed layer) has its whole
backward in one scan equation: the transpose of the forward scan, whose
carry is the activation cotangent and whose xs are the per-layer weights and
residuals. Left whole, it would go to ``I`` (it reads the weights) and hand
``W`` finished weight gradients. Instead each scan of the backward is split
by the same rule, applied to its body (`_plan_scan`):

- the I-scan runs the body equations that the scan outputs ``I`` needs
  depend on, plus the cotangent chain (body equations that read a weight:
  a body input whose operand is a stage parameter, such as a layer's
  weights scanned as xs) and what they need; a carry whose incoming value
  the I-scan reads is carried by the I-scan, to a fixed point. It also
  emits, as extra ys stacked over the iterations, every body value the W
  part reads that the I part made (or an I carry's incoming value): the
  per-layer cotangents and activations ``W`` needs, which become the
  stage's carry, about what the unrolled stage carries.
- the W-scan runs the rest, with the same ``length``, ``reverse`` and
  ``unroll``: the weight-gradient products, reading the stacked values as
  xs. Gradients of per-layer weights come out as its ys; gradients of
  weights shared by every iteration (scan consts) accumulate in its carry.

Every body equation runs in exactly one of the two scans, so nothing is
computed twice; both scans keep only the operands they read. Which outputs
of a scan ``I`` needs depends on the division of the whole backward, which
depends on the split scans, so `_split_scans` starts from none and grows
the set when ``I``'s slice reaches a W-scan (it does for a scan whose carry
output feeds an input gradient through equations that do not read weights).
The stage-level rule keeps a W-scan in ``W`` even where it reads a weight,
which would otherwise put it in the chain.

JAX 0.10.2's ``lax.scan(..., _split_transpose=True)`` was the alternative:
in this version the argument is accepted and ignored (the scan primitive has
no such parameter; its transpose is one scan), so jpipe splits scans itself.
Limits: a scan nested inside a scan body is not split further (it runs
whole in the piece the rule gives it: exact, but ``nn.remat_scan`` with
``lengths=(2, 2)`` then carries its weight gradients again); and a scan's
backward runs every iteration alike, so in a stage without an input
gradient it still computes the cotangent into its first layer, which an
unrolled backward drops as dead code (JAX's own transpose does the same).

Values between pieces are kept as flat vectors, one per dtype (`FlatLayout`),
so that the stages, whose pytrees differ, can share fixed-size buffers.

Collectives. Given a `jpipe.stage.manual.DeviceView` (the pipeline always gives
one), the forward and the backward are traced as one device of the mesh sees
them, under JAX's rules for varying values, so that a stage's own
``lax.psum`` over ``tensor`` gets JAX's own gradients; what is split above is
that program with JAX's casts removed (`jpipe.stage.manual`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.interpreters import partial_eval as pe
from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    Jaxpr,
    Literal,
    jaxpr_as_fun,
    jaxprs_in_params,
)

from jpipe.stage.manual import DeviceView, _bind, _body, make_jaxpr_varying


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
            out[dt] = _concatenate(chunks, dt) if chunks else jnp.zeros((0,), dt)
        return out

    def unpack(self, flat: dict) -> list:
        """The inverse of `pack`: reads each array back from its vector."""
        out = []
        for shape, dt, off in zip(self.shapes, self.dtypes, self.offsets):
            n = math.prod(shape)
            out.append(jax.lax.slice_in_dim(flat[dt], off, off + n).reshape(shape))
        return out


def _concatenate(chunks: list, dt: str):
    """``jnp.concatenate`` of same-dtype vectors, moving floats narrower than 32 bits as
    raw bits.

    XLA:CPU in jaxlib 0.10 computes a concatenation of bfloat16 operands in
    float32, so packing a stage's bf16 residuals made float32 copies of all of
    them: on GPT-2-small shapes (1F1B, M = 16, 4 devices) 0.92 GB of the
    step's 12.37 GB temp (`bench.memory.row`). As unsigned integers of the same
    width the bytes are only moved, bit for bit. jaxlib 0.12 makes no such
    copy (10.72 GB either way), nor, by design, does a GPU.
    """
    try:
        raw = {8: jnp.uint8, 16: jnp.uint16}.get(jnp.finfo(dt).bits)
    except ValueError:  # not a float
        raw = None
    if raw is None:
        return jnp.concatenate(chunks)
    bits = [jax.lax.bitcast_convert_type(c, raw) for c in chunks]
    return jax.lax.bitcast_convert_type(jnp.concatenate(bits), dt)


def merge_widths(*layouts: FlatLayout) -> dict:
    """The per-dtype widths that fit every layout."""
    widths: dict = {}
    for layout in layouts:
        for dt, n in layout.sizes.items():
            widths[dt] = max(widths.get(dt, 0), n)
    return widths


def _is_lit(v) -> bool:
    return isinstance(v, Literal)


def _needs_inline(jaxpr) -> bool:
    """Whether `jaxpr` has a call-like equation, here or inside a scan body."""
    for eqn in jaxpr.eqns:
        if _body(eqn) is not None:
            return True
        if eqn.primitive.name == "scan" and _needs_inline(eqn.params["jaxpr"].jaxpr):
            return True
    return False


def _scan_counts(eqn) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a scan equation, in every JAX jpipe supports.

    JAX 0.10 gives them as parameters; later versions describe the operands
    as a flat tree ``ft_in = (consts, carry, xs)`` and the outputs as
    ``ft_out = (carry, ys)``.
    """
    params = eqn.params
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _scan_changes(eqn, body: ClosedJaxpr, num_consts: int, num_carry: int) -> dict:
    """The parameters that make scan equation `eqn` run `body` instead.

    `body` reads `num_consts` consts, then `num_carry` carries, then xs, and
    returns its carries then its ys: for `_bind`.
    """
    if "num_consts" in eqn.params:
        return dict(jaxpr=body, num_consts=num_consts, num_carry=num_carry)
    from jax._src import flattree  # where ft_in's type lives (JAX 0.11 and later)

    num_xs = len(body.jaxpr.invars) - num_consts - num_carry
    num_ys = len(body.jaxpr.outvars) - num_carry
    nones = flattree.nones
    return dict(
        jaxpr=body,
        ft_in=flattree.pack((nones(num_consts), nones(num_carry), nones(num_xs))),
        ft_out=flattree.pack((nones(num_carry), nones(num_ys))),
    )


def _eval_inline(jaxpr, consts, args):
    """Evaluates `jaxpr`, running the bodies of call-like equations inline.

    Scan bodies are inlined too (the scan itself stays), so that `_plan_scan`
    sees inside the jit and remat calls of a scanned layer.
    """
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
        elif eqn.primitive.name == "scan":
            outs = _bind(eqn, invals, jaxpr=_inline_calls(eqn.params["jaxpr"]))
        else:
            outs = _bind(eqn, invals)
        for v, out in zip(eqn.outvars, outs):
            env[v] = out
    return [read(v) for v in jaxpr.outvars]


def _inline_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The same computation with jit and remat bodies spliced in (recursively)."""
    if not _needs_inline(closed.jaxpr):
        return closed
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *args: _eval_inline(closed.jaxpr, closed.consts, args))(*avals)


def _sub_jaxpr(constvars, consts, invars, outvars, eqns, name: str) -> ClosedJaxpr:
    """Some equations of a traced jaxpr as a jaxpr of their own, named for errors."""
    effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
    info = DebugInfo(
        "jpipe",
        name,
        tuple(f"in{i}" for i in range(len(invars))),
        tuple(f"out{i}" for i in range(len(outvars))),
    )
    return ClosedJaxpr(Jaxpr(constvars, invars, outvars, eqns, effects, debug_info=info), consts)


def _piece(constvars, invars, outvars, eqns, consts, name: str):
    """A callable that runs `eqns` of a traced jaxpr as one piece."""
    return jaxpr_as_fun(_sub_jaxpr(constvars, consts, invars, outvars, eqns, name))


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
      rebuilt_avals: the residuals that depend only on parameters and
        inputs, which I and W make again instead of F keeping them.
      y_layout, res_layout, carry_layout: where each of those lives in one
        flat vector per dtype.
      i_flops_share: the share of the backward's equations that I runs.
      slice_carried: whether the stage carries a value from one slice of a
        sequence to the next (a sliced schedule, `jpipe.Schedule.slices`):
        then `x` is ``(input, carry)`` and `y` is ``(output, carry)``, so
        that F returns the next slice's carry and I the gradient of the
        slice before's (`jpipe.stage.carry`). `out` is the output alone.
    """

    fn: Callable
    params: Any
    x: Any
    inputs: Any
    y: Any
    y_tree: Any
    res_avals: tuple
    carry_avals: tuple
    rebuilt_avals: tuple
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
    slice_carried: bool = False

    @classmethod
    def trace(
        cls,
        fn: Callable,
        params,
        x,
        inputs,
        view: DeviceView | None = None,
        name: str = "stage",
        carry_leaves: int = 0,
    ) -> StageKernels:
        """Traces `fn` for the shapes of `params`, `x` (or None) and `inputs`.

        `carry_leaves`: how many leaves end `x` and the output as a slice carry
        (`jpipe.stage.carry`), which may differ between devices of the model axes.

        With `view`, as one device of its mesh sees them (`jpipe.stage.manual`):
        the stage's own collectives then get JAX's gradients, and one over
        the pipeline axis is refused, naming the stage as `name`.
        """

        def abstract(tree):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)

        params, inputs = abstract(params), abstract(inputs)
        x = None if x is None else abstract(x)
        forward = _trace_forward(fn, params, x, inputs, view, name, carry_leaves)
        backward = _split_backward(forward, params, x, inputs, view, name)
        res_avals = tuple(forward.residuals[j] for j in forward.kept)
        return cls(
            fn=fn,
            params=params,
            x=x,
            inputs=inputs,
            y=forward.y,
            y_tree=forward.y_tree,
            res_avals=res_avals,
            carry_avals=backward.carry_avals,
            rebuilt_avals=tuple(forward.residuals[j] for j in forward.rebuilt),
            y_layout=FlatLayout.of(jax.tree.leaves(forward.y)),
            res_layout=FlatLayout.of(res_avals),
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

    @property
    def out(self):
        """Shape structs of what the stage passes on (the next stage's input, or the
        loss): `y` without the slice carry."""
        return self.y[0] if self.slice_carried else self.y

    @property
    def num_carry_leaves(self) -> int:
        """How many leaves of the slice carry end `x`'s leaves and `y`'s (0 without one)."""
        return len(jax.tree.leaves(self.y[1])) if self.slice_carried else 0

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


class WeightedLoss(NamedTuple):
    """What a last stage returns for a loss that is not an equal-weight mean of rows.

    ``total`` is the microbatch's summed loss (e.g. over its unmasked tokens)
    and ``weight`` what it counts (e.g. those tokens). The pipeline's loss is
    ``sum(total) / sum(weight)`` over every microbatch (and data shard), and
    its gradients are those of that quotient: a token-masked mean equals the
    masked mean of the whole batch, not a mean of per-microbatch means. The
    weight must not depend on the parameters.
    """

    total: Any
    weight: Any


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
    classes: tuple  # per vjp leaf: ("const", value), ("p" | "in" | "res", index)
    residuals: tuple  # shape structs of every residual, kept or rebuilt
    kept: tuple  # indices of the residuals F stashes
    rebuilt: tuple  # indices of those I and W rebuild from params and inputs
    rebuild: Callable  # indices -> fn(*param_leaves, *input_leaves) -> those residuals
    f_fn: Callable
    y_vmas: Any = None  # with a DeviceView: each output leaf's varying axes
    residual_vmas: Any = None  # and each residual's


class _Backward(NamedTuple):
    carry_avals: tuple
    i_fn: Callable
    w_fn: Callable
    num_dx: int
    i_flops_share: float


# A product mixes whole rows of its operands: made from microbatch data it is
# activation-sized work, as dear to redo as what it saves, so its result is
# stashed like anything made from x (the first stage's activations come from
# its inputs, not from an x).
_PRODUCTS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"})


def _has(v, variables) -> bool:
    return not _is_lit(v) and v in variables


def _activation_derived(jaxpr, act_in: Sequence[bool], data_in: Sequence[bool]):
    """Which values of `jaxpr` are activations: made from x, or dear to redo.

    `act_in` marks the invars that are activations (the stage input x),
    `data_in` those that hold microbatch data (the inputs). A value is an
    activation if an equation that makes it reads one, is a product that
    reads data (`_PRODUCTS`), or has effects (to run it again would repeat
    them). Everything else depends only on parameters, constants and data
    through cheap equations (a cast, a slice or a transpose of a weight, an
    embedding lookup, a mask). The analysis sees through call-like equations
    (`_body`) and scan bodies (iterating the carries to a fixed point); any
    other equation with a sub-jaxpr (a cond, a while) that reads an
    activation or data makes only activations.

    Returns:
      ``(act, data)``: the sets of activation variables and of the other
      variables made from data.
    """
    act = {v for v, a in zip(jaxpr.invars, act_in) if a}
    data = {v for v, d in zip(jaxpr.invars, data_in) if d}
    for eqn in jaxpr.eqns:
        a_in = [_has(u, act) for u in eqn.invars]
        d_in = [_has(u, data) for u in eqn.invars]
        n = len(eqn.outvars)
        body = _body(eqn)
        if eqn.effects:
            a_out, d_out = [True] * n, [False] * n
        elif body is not None:
            inner_act, inner_data = _activation_derived(body[0], a_in, d_in)
            a_out = [_has(v, inner_act) for v in body[0].outvars]
            d_out = [_has(v, inner_data) for v in body[0].outvars]
        elif eqn.primitive.name == "scan":
            a_out, d_out = _scan_derived(eqn, a_in, d_in)
        elif eqn.primitive.name in _PRODUCTS or list(jaxprs_in_params(eqn.params)):
            a_out, d_out = [any(a_in) or any(d_in)] * n, [False] * n
        else:
            a_out, d_out = [any(a_in)] * n, [any(d_in)] * n
        act.update(v for v, a in zip(eqn.outvars, a_out) if a)
        data.update(v for v, d in zip(eqn.outvars, d_out) if d)
    return act, data


def _scan_derived(eqn, a_in: list, d_in: list):
    """`_activation_derived` for a scan's outputs: the body to a fixed point."""
    jb = eqn.params["jaxpr"].jaxpr
    nc, ncar = _scan_counts(eqn)
    a_in, d_in = list(a_in), list(d_in)
    while True:
        act, data = _activation_derived(jb, a_in, d_in)
        a_out = [_has(v, act) for v in jb.outvars]
        d_out = [_has(v, data) for v in jb.outvars]
        grown = False
        for k in range(ncar):  # what a carry becomes flows into the next iteration
            for flags, out in ((a_in, a_out), (d_in, d_out)):
                if out[k] and not flags[nc + k]:
                    flags[nc + k] = grown = True
        if not grown:
            break
    for k in range(ncar):  # a scan of length 0 returns the initial carry
        a_out[k] = a_out[k] or a_in[nc + k]
        d_out[k] = d_out[k] or d_in[nc + k]
    return a_out, d_out


def _rebuilder(closed: ClosedJaxpr, res_vars: list, n_p: int, n_x: int) -> Callable:
    """``rebuild(indices)``: a function of the parameter and input leaves
    that makes those residuals again, from the forward's equations that
    they need (dead-code eliminated, so a scan runs only what they need)."""
    jaxpr = closed.jaxpr
    pure = [e for e in jaxpr.eqns if not e.effects]
    invars = list(jaxpr.invars)

    def rebuild(indices) -> Callable:
        outs = [res_vars[j] for j in indices]
        if not outs:
            return lambda *args: []
        whole = _sub_jaxpr(jaxpr.constvars, closed.consts, invars, outs, pure, "rebuild")
        dced, used = pe.dce_jaxpr(whole.jaxpr, [True] * len(outs))
        if any(used[n_p : n_p + n_x]):  # `_activation_derived` would be wrong
            raise RuntimeError("jpipe: a residual chosen for rebuilding reads x")
        fn = jaxpr_as_fun(ClosedJaxpr(dced, closed.consts))
        # Positions among (params, inputs): the invars without x.
        picks = [k if k < n_p else k - n_x for k, u in enumerate(used) if u]
        return lambda *args: list(fn(*(args[k] for k in picks)))

    return rebuild


def _make_jaxpr(fn, args: tuple, vmas, view: DeviceView | None, name: str):
    """``jax.make_jaxpr(fn)(*args)``, traced as one device of `view` sees it when given.

    `vmas` lists the varying axes of each of the flattened `args`' leaves.
    Returns ``(closed, out_vmas)``: the jaxpr to split (without JAX's casts,
    `jpipe.stage.manual.without_casts`) and each output's varying axes (None
    without a view). A collective over the pipeline axis is refused here.
    """
    if view is None:
        return jax.make_jaxpr(fn)(*args), None
    leaves, tree = jax.tree.flatten(args)

    def flat(*leaves):
        return jax.tree.leaves(fn(*jax.tree.unflatten(tree, leaves)))

    varying, closed, out_vmas = make_jaxpr_varying(flat, leaves, vmas, view.mesh)
    view.check(varying, name)
    return closed, out_vmas


def _trace_forward(
    fn, params, x, inputs, view=None, name="stage", carry_leaves: int = 0
) -> _Forward:
    """Traces ``vjp`` of the stage and chooses the residuals F stashes.

    The last `carry_leaves` leaves of `x` and of the output are a slice carry
    (`jpipe.stage.carry`): it stays on its device, so it may differ between
    the devices of the model axes (each its heads' keys and values).

    Residuals that are parameters or inputs are read again from where they
    live. Of the others, F stashes the activations (`_activation_derived`);
    the rest, made from parameters and inputs alone (a bf16 copy of a float32
    weight, a slice of a stacked weight, an embedding lookup, a mask), are
    rebuilt by I and W (`_rebuilder`) instead of being stashed per microbatch.
    """
    box = {}
    has_x = x is not None

    def forward_all(params, x, inputs):
        if has_x:
            y, vjp_fn = jax.vjp(lambda p, x_: fn(p, x_, inputs), params, x)
        else:
            y, vjp_fn = jax.vjp(lambda p: fn(p, None, inputs), params)
        leaves, box["tree"] = jax.tree.flatten(vjp_fn)
        y_leaves, box["y_tree"] = jax.tree.flatten(y)
        return y_leaves, leaves

    n_p = len(jax.tree.leaves(params))
    n_x = len(jax.tree.leaves(x)) if has_x else 0
    n_rest = len(jax.tree.leaves(inputs)) + n_x
    vmas = None
    if view is not None:
        # A carry varies as the stage's split parameters do (over ``tensor``: each
        # device's heads' keys and values).
        own = view.always.union(*view.param_axes)
        vmas = (
            view.param_vmas()
            + [view.always] * (n_x - carry_leaves)  # the input, then its carry
            + [own] * carry_leaves
            + [view.always] * (n_rest - n_x)  # the microbatch's inputs
        )
    closed, out_vmas = _make_jaxpr(forward_all, (params, x, inputs), vmas, view, name)
    jaxpr = closed.jaxpr
    p_vars = jaxpr.invars[:n_p]
    in_vars = jaxpr.invars[n_p + n_x :]
    n_y = box["y_tree"].num_leaves
    y_out, leaf_out = jaxpr.outvars[:n_y], jaxpr.outvars[n_y:]
    y_shape = jax.tree.unflatten(
        box["y_tree"], [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in y_out]
    )
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
    n_in = len(jaxpr.invars) - n_p - n_x
    act, _ = _activation_derived(
        jaxpr, [False] * n_p + [True] * n_x + [False] * n_in, [False] * (n_p + n_x) + [True] * n_in
    )
    y_vmas = res_vmas = None
    if view is not None:
        y_vmas = out_vmas[:n_y]
        view.check_activation(y_vmas[: n_y - carry_leaves], name, "an output")
        res_vmas = [out_vmas[n_y + leaf_out.index(v)] for v in res_vars]
    kept = tuple(j for j, v in enumerate(res_vars) if v in act)
    rebuilt = tuple(j for j, v in enumerate(res_vars) if v not in act)
    f_fn = _piece(
        jaxpr.constvars,
        jaxpr.invars,
        list(y_out) + [res_vars[j] for j in kept],
        jaxpr.eqns,
        closed.consts,
        "F",
    )
    rebuild = _rebuilder(closed, res_vars, n_p, n_x)
    rebuild(rebuilt)  # checks, at tracing, that none of them reads x
    return _Forward(
        y=y_shape,
        y_tree=jax.tree.structure(y_shape),
        vjp_tree=box["tree"],
        classes=tuple(classes),
        residuals=tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in res_vars),
        kept=kept,
        rebuilt=rebuilt,
        rebuild=rebuild,
        f_fn=f_fn,
        y_vmas=y_vmas,
        residual_vmas=res_vmas,
    )


def _producers(jaxpr) -> dict:
    return {v: idx for idx, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}


def _slice(jaxpr, producer: dict, outs, stop=frozenset()) -> set:
    """Indices of the equations of `jaxpr` that `outs` need (not crossing `stop`)."""
    needed, seen = set(), set()
    frontier = [v for v in outs if not _is_lit(v)]
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


def _reads(eqn, variables) -> bool:
    return any(not _is_lit(u) and u in variables for u in eqn.invars)


def _equations_run(eqns) -> int:
    """Equations run, a scan's body counted once per iteration."""
    total = 0
    for eqn in eqns:
        if eqn.primitive.name == "scan":
            total += eqn.params["length"] * _equations_run(eqn.params["jaxpr"].jaxpr.eqns)
        else:
            total += 1
    return total


def _unique(variables) -> list:
    out, seen = [], set()
    for v in variables:
        if not _is_lit(v) and v not in seen:
            seen.add(v)
            out.append(v)
    return out


class _ScanPlan(NamedTuple):
    """How one scan of the backward runs as an I-scan and a W-scan.

    Operand and output positions are those of the original scan equation;
    the I-scan's outputs are its carries, its ys, then the stacked values
    the W-scan reads as extra xs.
    """

    i_jaxpr: Any  # ClosedJaxpr, or None when W does all of it
    i_operands: tuple
    i_outputs: tuple
    w_jaxpr: Any  # ClosedJaxpr
    w_operands: tuple
    w_outputs: tuple
    i_num_consts: int
    i_num_carry: int
    w_num_consts: int
    w_num_carry: int


def _closed(body: ClosedJaxpr, invars, outvars, eqns, name: str) -> ClosedJaxpr:
    return _sub_jaxpr(body.jaxpr.constvars, body.consts, invars, outvars, eqns, name)


def _plan_scan(eqn, need: set, param_operands: set) -> _ScanPlan | None:
    """Divides one scan of the backward by the same rule as the stage's equations.

    Inside the body, I gets what the outputs in `need` (those the stage's I
    piece reads) need, plus the cotangent chain: every live equation that
    reads a parameter (a body input whose operand is one of the stage's
    parameters, such as the layer's weights scanned as xs) and what it
    needs. A carry whose incoming value I reads is carried by I, so the
    rule is iterated to a fixed point. W gets the rest (the weight-gradient
    products, and the accumulators of weights shared by every iteration),
    and reads what I made in the body as xs stacked over the iterations,
    which the I-scan emits as extra ys.

    Returns None when I does all of it (the scan then stays whole).
    """
    body = eqn.params["jaxpr"]
    jb = body.jaxpr
    nc, ncar = _scan_counts(eqn)
    invars, outvars = list(jb.invars), list(jb.outvars)
    producer = _producers(jb)
    params_read = {invars[k] for k in param_operands}
    live = _slice(jb, producer, outvars)
    chain = [
        v for idx in sorted(live) if _reads(jb.eqns[idx], params_read) for v in jb.eqns[idx].outvars
    ]
    i_outs = set(need)
    while True:
        i_eqns = _slice(jb, producer, [outvars[j] for j in i_outs] + chain)
        i_made = {v for idx in i_eqns for v in jb.eqns[idx].outvars}
        reads = {u for idx in i_eqns for u in jb.eqns[idx].invars if not _is_lit(u)}
        reads |= {outvars[j] for j in i_outs if not _is_lit(outvars[j])}
        grow = {k for k in range(ncar) if invars[nc + k] in reads}
        # An output I makes anyway is I's: W would otherwise take it stacked.
        grow |= {j for j, v in enumerate(outvars) if not _is_lit(v) and v in i_made}
        if grow <= i_outs:
            break
        i_outs |= grow
    w_outs = [j for j in range(len(outvars)) if j not in i_outs]
    if not w_outs:
        return None
    if not i_outs:
        # I reads nothing this scan makes (e.g. one that only sums a weight's
        # gradient over slices): W runs all of it, the chain's equations too
        # (the I-scan that would make them for W does not run).
        i_eqns, i_made = set(), set()
    i_carry = [k for k in range(ncar) if k in i_outs]
    w_carry = [k for k in range(ncar) if k not in i_outs]
    i_ys = sorted(j for j in i_outs if j >= ncar)
    w_ys = [j for j in w_outs if j >= ncar]
    w_eqns = _slice(jb, producer, [outvars[j] for j in w_outs], stop=frozenset(i_eqns))
    i_carry_in = {invars[nc + k] for k in i_carry}
    w_reads = _unique(
        [u for idx in sorted(w_eqns) for u in jb.eqns[idx].invars] + [outvars[j] for j in w_outs]
    )
    stacked = [u for u in w_reads if u in i_made or u in i_carry_in]
    position = {v: p for p, v in enumerate(invars)}

    def outer(used):  # the consts and xs among `used`, as operand positions
        ps = sorted(position[u] for u in used if u in position)
        return [p for p in ps if p < nc], [p for p in ps if p >= nc + ncar]

    w_consts, w_xs = outer(w_reads)
    w_invars = (
        [invars[p] for p in w_consts]
        + [invars[nc + k] for k in w_carry]
        + [invars[p] for p in w_xs]
        + stacked
    )
    w_jaxpr = _closed(
        body,
        w_invars,
        [outvars[k] for k in w_carry] + [outvars[j] for j in w_ys],
        [jb.eqns[idx] for idx in sorted(w_eqns)],
        "W-scan",
    )
    w_plan = dict(
        w_jaxpr=w_jaxpr,
        w_operands=tuple(w_consts + [nc + k for k in w_carry] + w_xs),
        w_outputs=tuple(w_carry + w_ys),
        w_num_consts=len(w_consts),
        w_num_carry=len(w_carry),
    )
    if not i_outs:
        return _ScanPlan(None, (), (), i_num_consts=0, i_num_carry=0, **w_plan)
    i_consts, i_xs = outer(reads)
    i_invars = [invars[p] for p in i_consts] + [invars[nc + k] for k in i_carry]
    i_jaxpr = _closed(
        body,
        i_invars + [invars[p] for p in i_xs],
        [outvars[k] for k in i_carry] + [outvars[j] for j in i_ys] + stacked,
        [jb.eqns[idx] for idx in sorted(i_eqns)],
        "I-scan",
    )
    return _ScanPlan(
        i_jaxpr=i_jaxpr,
        i_operands=tuple(i_consts + [nc + k for k in i_carry] + i_xs),
        i_outputs=tuple(i_carry + i_ys),
        i_num_consts=len(i_consts),
        i_num_carry=len(i_carry),
        **w_plan,
    )


def _run_plans(closed: ClosedJaxpr, plans: dict) -> ClosedJaxpr:
    """`closed` retraced with each planned scan run as its I-scan then its W-scan."""

    def run(*args):
        env = {}

        def read(v):
            return v.val if _is_lit(v) else env[v]

        jaxpr = closed.jaxpr
        for v, c in zip(jaxpr.constvars, closed.consts):
            env[v] = c
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        for idx, eqn in enumerate(jaxpr.eqns):
            invals = [read(v) for v in eqn.invars]
            plan = plans.get(idx)
            if plan is None:
                outs = _bind(eqn, invals)
            else:
                outs = [None] * len(eqn.outvars)
                stacked = []
                if plan.i_jaxpr is not None:
                    i_outs = _bind(
                        eqn,
                        [invals[p] for p in plan.i_operands],
                        **_scan_changes(eqn, plan.i_jaxpr, plan.i_num_consts, plan.i_num_carry),
                    )
                    for j, out in zip(plan.i_outputs, i_outs):
                        outs[j] = out
                    stacked = i_outs[len(plan.i_outputs) :]
                w_outs = _bind(
                    eqn,
                    [invals[p] for p in plan.w_operands] + stacked,
                    **_scan_changes(eqn, plan.w_jaxpr, plan.w_num_consts, plan.w_num_carry),
                )
                for j, out in zip(plan.w_outputs, w_outs):
                    outs[j] = out
            for v, out in zip(eqn.outvars, outs):
                env[v] = out
        return [read(v) for v in jaxpr.outvars]

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(run)(*avals)


class _Division(NamedTuple):
    i_eqns: set
    w_eqns: set
    carry: list


def _divide(jaxpr, p_vars, g_vars, dp_out, dx_out, is_w_scan) -> _Division:
    """Which equations of the backward `jaxpr` I runs, which W runs, and the carry."""
    producer = _producers(jaxpr)
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
    # cost of carry memory. A W-scan (`_plan_scan`) reads the scanned
    # weights too but belongs to W: the chain inside it went to its I-scan.
    live = _slice(jaxpr, producer, dp_out + dx_out)
    params_read = set(p_vars)
    chain = [
        v
        for idx in sorted(live)
        if _reads(jaxpr.eqns[idx], params_read) and not is_w_scan(jaxpr.eqns[idx])
        for v in jaxpr.eqns[idx].outvars
    ]
    i_eqns = _slice(jaxpr, producer, dx_out + chain)
    w_eqns = _slice(jaxpr, producer, dp_out, stop=frozenset(i_eqns))
    # The carry: values the W piece reads that the I piece made or received.
    i_made = {v for idx in i_eqns for v in jaxpr.eqns[idx].outvars}
    w_reads = [u for idx in sorted(w_eqns) for u in jaxpr.eqns[idx].invars] + dp_out
    carry = [u for u in _unique(w_reads) if u in i_made or u in set(g_vars)]
    return _Division(i_eqns, w_eqns, carry)


def _split_scans(closed: ClosedJaxpr, num_params: int, roles):
    """Splits every scan of the backward into an I-scan and a W-scan.

    Which outputs of a scan the I piece needs depends on the division of the
    whole backward, which depends on the split scans; so it starts from none
    and grows: when I's slice reaches a W-scan, the outputs it reads there
    move to that scan's I-scan, and the scans are planned again.

    Returns:
      ``(backward, division, is_w_scan)`` for the rewritten backward.
    """
    jaxpr = closed.jaxpr
    scans = [idx for idx, e in enumerate(jaxpr.eqns) if e.primitive.name == "scan"]
    p_vars = set(jaxpr.invars[:num_params])
    need = {idx: set() for idx in scans}
    while True:
        plans, w_scans = {}, {}
        for idx in scans:
            eqn = jaxpr.eqns[idx]
            operands = {k for k, v in enumerate(eqn.invars) if not _is_lit(v) and v in p_vars}
            plan = _plan_scan(eqn, need[idx], operands)
            if plan is not None:
                plans[idx] = plan
                w_scans[id(plan.w_jaxpr)] = (idx, plan)
        new = _run_plans(closed, plans) if plans else closed

        def is_w_scan(eqn, w_scans=w_scans):
            return eqn.primitive.name == "scan" and id(eqn.params["jaxpr"]) in w_scans

        division = _divide(new.jaxpr, *roles(new.jaxpr), is_w_scan)
        grown = False
        i_reads = {u for i in division.i_eqns for u in new.jaxpr.eqns[i].invars if not _is_lit(u)}
        i_reads |= set(roles(new.jaxpr)[3])  # dx_out
        for i in division.i_eqns:
            eqn = new.jaxpr.eqns[i]
            if is_w_scan(eqn):
                idx, plan = w_scans[id(eqn.params["jaxpr"])]
                read = {plan.w_outputs[j] for j, v in enumerate(eqn.outvars) if v in i_reads}
                need[idx] |= read
                grown = True
        if not grown:
            return new, division, is_w_scan


def _split_backward(forward: _Forward, params, x, inputs, view=None, name="stage") -> _Backward:
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
    res_avals = list(forward.residuals)
    vmas = None
    if view is not None:
        vmas = (
            view.param_vmas()
            + [view.always] * len(in_avals)
            + list(forward.residual_vmas)
            + list(forward.y_vmas)
        )
    closed, _ = _make_jaxpr(
        backward_flat, (p_avals, in_avals, res_avals, g_avals), vmas, view, name
    )
    closed = _inline_calls(closed)
    n_p, n_in, n_res = len(p_avals), len(in_avals), len(res_avals)

    def roles(jaxpr):  # (p_vars, g_vars, dp_out, dx_out) of a backward jaxpr
        invars = list(jaxpr.invars)
        return (
            invars[:n_p],
            invars[n_p + n_in + n_res :],
            list(jaxpr.outvars[:n_p]),
            list(jaxpr.outvars[n_p:]),
        )

    closed, division, _ = _split_scans(closed, n_p, roles)
    jaxpr = closed.jaxpr
    p_vars, g_vars, dp_out, dx_out = roles(jaxpr)
    invars = list(jaxpr.invars)
    in_vars = invars[n_p : n_p + n_in]
    res_vars = invars[n_p + n_in : n_p + n_in + n_res]
    carry = division.carry
    carry_avals = tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in carry)

    kept = [res_vars[j] for j in forward.kept]
    n_base = n_p + n_in

    def piece(extra, outvars_, eqn_ids, name):
        # The piece reads the kept residuals from F and rebuilds, from the
        # parameters and inputs, the others it reads.
        eqns = [jaxpr.eqns[i] for i in sorted(eqn_ids)]
        reads = {u for e in eqns for u in e.invars if not _is_lit(u)} | set(_unique(outvars_))
        made = [j for j in forward.rebuilt if res_vars[j] in reads]
        invars_ = p_vars + in_vars + kept + [res_vars[j] for j in made] + extra
        run = _piece(jaxpr.constvars, invars_, outvars_, eqns, closed.consts, name)
        rebuild = forward.rebuild(made)

        def with_rebuilt(*args):
            base = args[:n_base]
            return run(
                *base,
                *args[n_base : n_base + len(kept)],
                *rebuild(*base),
                *args[n_base + len(kept) :],
            )

        return with_rebuilt

    i_run = _equations_run([jaxpr.eqns[i] for i in division.i_eqns])
    return _Backward(
        carry_avals=carry_avals,
        i_fn=piece(g_vars, dx_out + carry, division.i_eqns, "I"),
        w_fn=piece(carry, dp_out, division.w_eqns, "W"),
        num_dx=len(dx_out),
        i_flops_share=i_run / max(1, _equations_run(jaxpr.eqns)),
    )
