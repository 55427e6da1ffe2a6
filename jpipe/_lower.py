"""Lowering: a plan and its stage kernels become one SPMD program.

The program is a `jax.shard_map`, manual over the ``pipe`` mesh axis (and a
``data`` axis, if there is one; any other axis stays under the compiler),
around a `lax.scan` over ticks. The scan reads one row of the plan's table
per tick; on each rank the row says which pieces to run and which buffer
slots they read and write.

Each kind of piece runs inside its own two-way `lax.cond` (this tick runs an
F, or not; an I, or not; a W, or not; in that order, so a packed tick can run
all three) around a `lax.switch` over the stages, so only the chosen pieces'
work runs and idle ranks compute nothing. Each cond holds the single in-place
write to its buffer: the F writes its residual slot, the I its carry slot,
the W adds to the gradient accumulator (on a rank with several stages, W is
one cond per stage instead, each adding to its own stage's buckets). (Passing
every buffer through one many-branch switch made XLA copy them all every
tick.) After the conds every rank takes part in the same collectives, one
`ppermute` per channel of the plan (a shift between sender and receiver, for
F outputs, I outputs or either), outside any branch. What arrives, and the
outputs handed over on the same rank, are written to the slots the table
names at the start of the next tick, before anything reads; a write the table
sends to the spare slot is skipped.

Buffers, all with a fixed number of slots that does not grow with the
microbatches (see `jpipe._plan`):

- ``io``: activations and gradients waiting for their consumer;
- ``res``: residuals from each F kept for its backward;
- ``carry``: what each I keeps for its W;
- the gradient accumulator, laid out like the packed parameters.

Values in the slots are flat vectors, one per dtype (`jpipe._stage.FlatLayout`).
Parameters arrive packed in buckets (`jpipe._pack`): a rank's row of a bucket
is one of its own stages' arrays, which the stage's branch reshapes in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jpipe._pack import ParamLayout
from jpipe._plan import COLUMNS, Plan
from jpipe._stage import StageKernels, WeightedLoss, loss_seed, merge_widths


class Program(NamedTuple):
    """A lowered plan.

    Attributes:
      run: ``run(packed_params, batch_mb) -> (loss, packed_grads)``, pure and
        unjitted; `batch_mb` is the batch cut by `split_microbatches`.
      kernels: the stages' F, I and W pieces it runs.
    """

    run: Callable
    kernels: tuple[StageKernels, ...]


def _zeros(widths: dict) -> dict:
    return {dt: jnp.zeros((n,), dt) for dt, n in widths.items()}


def trace_kernels(stage_fns, layout: ParamLayout, microbatch_inputs) -> list[StageKernels]:
    """Traces every stage's F, I and W, feeding each the previous one's output shape."""
    kernels: list[StageKernels] = []
    x = None
    for s, fn in enumerate(stage_fns):
        k = StageKernels.trace(fn, layout.stage_avals(s), x, microbatch_inputs)
        kernels.append(k)
        x = k.y
    return kernels


def build_step(
    stage_fns,
    plan: Plan,
    layout: ParamLayout,
    mesh,
    microbatch_inputs,
    pipe_axis: str,
    data_axis: str | None = None,
    forward_only: bool = False,
    kernels: list[StageKernels] | None = None,
    idle: bool = False,
) -> Program:
    """Lowers a plan to a `Program`: ``run(packed_params, batch_mb) -> (loss, packed_grads)``.

    `batch_mb` is the batch cut into microbatches, ``[rows, M, ...]`` per leaf
    (`jpipe._pipeline.split_microbatches`).

    Args:
      stage_fns: the user's stage functions.
      plan: the plan of the schedule.
      layout: which bucket holds each stage's parameters.
      mesh: the device mesh (axis types Auto).
      microbatch_inputs: one microbatch's inputs as one device sees them
        (shape structs), to trace with.
      pipe_axis: the name of the pipeline mesh axis.
      data_axis: the name of the data-parallel axis, if any. It is manual too:
        each device runs its rows of every microbatch, and the gradients are
        averaged over it once, after the loop. (Left to the compiler, the data
        axis made XLA insert collectives inside the branches, where ranks that
        take different branches deadlock.)
      forward_only: build only the forward pieces, for a plan of forwards
        (`jpipe._plan.make_forward_plan`); the gradients come back as zeros.
      kernels: the stages' pieces from `trace_kernels`, if already traced.
      idle: run no piece in any tick (`Plan.table(idle=True)`), to measure
        the cost of the program's control alone; the results are zeros.
    """
    S = plan.schedule.num_stages
    M = plan.schedule.num_microbatches
    R = plan.num_ranks

    # Trace every stage's kernels, feeding each stage the previous one's output shape.
    if kernels is None:
        kernels = trace_kernels(stage_fns, layout, microbatch_inputs)
    last = kernels[-1]
    weighted = last.y_tree == jax.tree.structure(WeightedLoss(0.0, 0.0))
    loss_leaves = jax.tree.leaves(last.y)
    if (
        len(loss_leaves) != (2 if weighted else 1)
        or any(leaf.shape != () for leaf in loss_leaves)
        or not all(jnp.issubdtype(leaf.dtype, jnp.floating) for leaf in loss_leaves)
    ):
        raise ValueError(
            "the last stage must return the microbatch's loss as a float scalar, or a "
            f"jpipe.WeightedLoss(total, weight) of two float scalars; got {last.y}"
        )
    loss_dtype = jnp.result_type(*(leaf.dtype for leaf in loss_leaves))
    # The loss accumulator: the sum of the microbatch losses, or of the
    # weighted losses' totals and weights.
    loss_zero = jnp.zeros((2,) if weighted else (), loss_dtype)
    for s, k in enumerate(kernels[:-1]):
        for leaf in jax.tree.leaves(k.y):
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise ValueError(
                    f"stage {s} passes a {leaf.dtype} array to stage {s + 1}; activations "
                    "between stages must be floating point so gradients can flow back"
                )

    io_widths = merge_widths(*(k.y_layout for k in kernels[:-1]))
    res_widths = merge_widths(*(k.res_layout for k in kernels))
    carry_widths = merge_widths(*(k.carry_layout for k in kernels))
    buckets = layout.buckets

    def stage_params(s, local):
        return layout.stage_params(s, local)

    def read(arena, slot):
        return {dt: lax.dynamic_index_in_dim(buf, slot, 0, False) for dt, buf in arena.items()}

    def write(arena, slot, values):
        return {
            dt: lax.dynamic_update_index_in_dim(buf, values[dt], slot, 0)
            for dt, buf in arena.items()
        }

    def write_if_used(io, slot, values):
        """An io write, skipped when the table sends it to the spare slot."""
        return lax.cond(slot != plan.num_io, lambda io: write(io, slot, values), lambda io: io, io)

    # Each kind of piece runs inside its own two-way `cond` (this tick's piece
    # is of that kind, or not), and inside it a `switch` over the stages. The
    # cond holds the only write to its buffer (the residual slot, the carry
    # slot, the gradient accumulator), a single in-place update that XLA keeps
    # in place; passing all buffers through one many-branch switch made XLA
    # copy them every tick. Ticks that do not run a kind touch nothing of it.

    def zero_send():
        return _zeros(io_widths)

    def make_f(s):
        k = kernels[s]

        def run(flat, inputs, io_val):
            x = None
            if s > 0:
                prev = kernels[s - 1]
                x = jax.tree.unflatten(prev.y_tree, prev.y_layout.unpack(io_val))
            y, residuals = k.forward(stage_params(s, flat), x, inputs)
            res_new = k.res_layout.pack(residuals, res_widths)
            if s == S - 1:
                loss_piece = jnp.stack([v.astype(loss_dtype) for v in y]) if weighted else y[0]
                return zero_send(), res_new, loss_piece.astype(loss_dtype)
            return k.y_layout.pack(y, io_widths), res_new, loss_zero

        return run

    def make_i(s):
        k = kernels[s]

        def run(flat, inputs, io_val, res_val):
            residuals = k.res_layout.unpack(res_val)
            if s == S - 1 and weighted:
                # d(total) = 1 and d(weight) = 0: the step divides by the summed
                # weights once, at the end (the weight must not depend on the
                # parameters).
                g = [jnp.ones((), leaf.dtype) * (i == 0) for i, leaf in enumerate(loss_leaves)]
            elif s == S - 1:
                g = loss_seed(M, loss_dtype)
            else:
                g = k.y_layout.unpack(io_val)
            dx, kept = k.input_grad(stage_params(s, flat), inputs, residuals, g)
            send = kernels[s - 1].y_layout.pack(dx, io_widths) if s > 0 else zero_send()
            return send, k.carry_layout.pack(kept, carry_widths)

        return run

    def make_w(s):
        k = kernels[s]
        names = layout.stage_buckets(s)

        def run(flat, inputs, res_val, carry_val):
            residuals = k.res_layout.unpack(res_val)
            kept = k.carry_layout.unpack(carry_val)
            grads = k.weight_grad(stage_params(s, flat), inputs, residuals, kept)
            dp = {name: g.reshape(-1) for name, g in zip(names, grads)}
            return {b: dp[b] if b in dp else jnp.zeros(sh, dt) for b, (sh, dt) in buckets.items()}

        return run

    # With one stage per rank every W adds to all of the rank's buckets and a
    # switch over the stages is the cheaper program; with several, the switch
    # would add zeros to the other stages' buckets, and one cond per stage
    # was 8 to 16% faster on the benchmark shapes (docs/compiler-measurements.md).
    several_stages_per_rank = len(set(plan.stage_to_rank)) < S
    f_branches = [make_f(s) for s in range(S)]
    i_branches = [make_i(s) for s in range(S)]
    w_branches = [make_w(s) for s in range(S)]

    col = {name: i for i, name in enumerate(COLUMNS)}
    channels = plan.channels
    num_writes = 2 + len(channels)  # F's and I's local hand-overs, then arrivals

    def per_rank(packed, batch_mb, tab):
        flat = {b: v[0] for b, v in packed.items()}
        tab = tab[:, 0]
        carry0 = (
            {b: jnp.zeros(sh, dt) for b, (sh, dt) in buckets.items()},
            loss_zero,
            {dt: jnp.zeros((plan.num_io + 1, n), dt) for dt, n in io_widths.items()},
            {dt: jnp.zeros((plan.num_res + 1, n), dt) for dt, n in res_widths.items()},
            {dt: jnp.zeros((plan.num_carry + 1, n), dt) for dt, n in carry_widths.items()},
            # The io writes of the tick before: (slot, value) for the local
            # hand-overs of F and I outputs and for each channel's arrival.
            (
                jnp.full((num_writes,), plan.num_io, jnp.int32),
                [zero_send() for _ in range(num_writes)],
            ),
        )

        def tick(state, row):
            grads, loss, io, res, carry, (write_slots, write_values) = state
            row = row.astype(jnp.int32)
            # The previous tick's io writes land first, before this tick reads
            # anything. (Writing them at the end of their own tick, as the
            # plan's phases put it, is equivalent, but XLA cannot then order
            # each write after every read of the same tick, and it copied the
            # whole io buffer three times a tick to be safe.)
            for k in range(num_writes):
                io = write_if_used(io, write_slots[k], write_values[k])

            def inputs_of(kind):  # read inside the pieces only: idle ticks read nothing
                mb = row[col[f"{kind}_microbatch"]]
                return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, mb, 1, False), batch_mb)

            # Column `{kind}_stage` is 0 when no piece of that kind runs, else 1 + stage.
            runs_f, f_stage = row[col["f_stage"]] > 0, row[col["f_stage"]] - 1
            runs_i, i_stage = row[col["i_stage"]] > 0, row[col["i_stage"]] - 1
            runs_w, w_stage = row[col["w_stage"]] > 0, row[col["w_stage"]] - 1

            def forward(res):
                send, res_new, loss_piece = lax.switch(
                    f_stage, f_branches, flat, inputs_of("f"), read(io, row[col["f_in"]])
                )
                return write(res, row[col["f_res"]], res_new), send, loss_piece

            res, send_f, loss_piece = lax.cond(
                runs_f, forward, lambda r: (r, zero_send(), loss_zero), res
            )

            def input_grad(carry):
                send, carry_new = lax.switch(
                    i_stage,
                    i_branches,
                    flat,
                    inputs_of("i"),
                    read(io, row[col["i_in"]]),
                    read(res, row[col["i_res"]]),
                )
                return write(carry, row[col["i_carry"]], carry_new), send

            if forward_only:
                send_i = zero_send()
            else:
                carry, send_i = lax.cond(runs_i, input_grad, lambda c: (c, zero_send()), carry)

            def add_weight_grad(s, grads):
                dp = w_branches[s](
                    flat,
                    inputs_of("w"),
                    read(res, row[col["w_res"]]),
                    read(carry, row[col["w_carry"]]),
                )
                mine = set(layout.stage_buckets(s))
                return {b: g + dp[b] if b in mine else g for b, g in grads.items()}

            def weight_grad(grads):
                dp = lax.switch(
                    w_stage,
                    w_branches,
                    flat,
                    inputs_of("w"),
                    read(res, row[col["w_res"]]),
                    read(carry, row[col["w_carry"]]),
                )
                return {b: g + dp[b] for b, g in grads.items()}

            if not forward_only and several_stages_per_rank:
                # One cond per stage, each adding to its own stage's buckets
                # only (a switch must give every branch the same outputs, so
                # it would add zeros to the rank's other stages' buckets).
                for s in range(S):
                    grads = lax.cond(
                        runs_w & (w_stage == s),
                        functools.partial(add_weight_grad, s),
                        lambda g: g,
                        grads,
                    )
            elif not forward_only:
                grads = lax.cond(runs_w, weight_grad, lambda g: g, grads)
            loss = loss + loss_piece
            slots = [row[col["f_local"]], row[col["i_local"]]]
            values = [send_f, send_i]
            # One collective per channel, every tick, outside any branch. A
            # shared channel (unit layout: a rank sends at most one value a
            # tick) carries whichever of the F and I outputs this rank made.
            if any(kind is None for kind, _ in channels):
                either = {dt: jnp.where(runs_f, send_f[dt], send_i[dt]) for dt in send_f}
            sends = {"F": send_f, "I": send_i}
            for i, (kind, d) in enumerate(channels):
                value = either if kind is None else sends[kind]
                perm = [(j, (j + d) % R) for j in range(R)]
                arrived = {dt: lax.ppermute(value[dt], pipe_axis, perm) for dt in value}
                slots.append(row[len(COLUMNS) + i])
                values.append(arrived)
            pending = (jnp.stack(slots), values)
            return (grads, loss, io, res, carry, pending), None

        (grads, loss, *_), _ = lax.scan(tick, carry0, tab)
        if weighted:
            # The weighted mean over every microbatch of every data shard,
            # divided once: sum(totals) / sum(weights), and the gradients of
            # the totals (seeded with 1) by the same sum of weights.
            axes = (pipe_axis,) + ((data_axis,) if data_axis is not None else ())
            total, weight = lax.psum(loss[0], axes), lax.psum(loss[1], axes)
            loss = total / weight
            if data_axis is not None:
                grads = {b: lax.psum(g, data_axis) for b, g in grads.items()}
            grads = {b: (g / weight).astype(g.dtype) for b, g in grads.items()}
            return loss, {b: g[None] for b, g in grads.items()}
        loss = lax.psum(loss, pipe_axis) / M
        if data_axis is not None:
            loss = lax.pmean(loss, data_axis)
            grads = {b: lax.pmean(g, data_axis) for b, g in grads.items()}
        return loss, {b: g[None] for b, g in grads.items()}

    program = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P(pipe_axis), P(data_axis), P(None, pipe_axis)),
        out_specs=(P(), P(pipe_axis)),
        axis_names={pipe_axis} | ({data_axis} if data_axis else set()),
        # The kernels are pre-traced jaxprs replayed with `jaxpr_as_fun`, which
        # does not insert the casts between values that vary over `pipe` and
        # values that do not; the program differentiates nothing across ranks,
        # so the check buys nothing here.
        check_vma=False,
    )
    tab = plan.table(idle=idle)

    def run(packed, batch_mb):
        return program(packed, batch_mb, jnp.asarray(tab))

    return Program(run, tuple(kernels))
