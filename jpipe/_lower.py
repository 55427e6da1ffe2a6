"""Lowering: a plan and its stage kernels become one SPMD program.

The program is a `jax.shard_map`, manual over the ``pipe`` mesh axis only (a
``data`` axis stays under the compiler), around a `lax.scan` over ticks. The
scan reads one row of the plan's table per tick; on each rank the row says
which piece to run (a `lax.switch` over the F, I and W of every stage, plus
idle, so only the chosen piece's work runs) and which buffer slots it reads
and writes. After the switch every rank takes part in the same collectives,
one `ppermute` per distinct shift between sender and receiver, outside any
branch; what arrives is written to the slot the table names (or to a spare
slot nobody reads).

Buffers, all with a fixed number of slots that does not grow with the
microbatches (see `jpipe._plan`):

- ``io``: activations and gradients waiting for their consumer;
- ``res``: residuals from each F kept for its backward;
- ``carry``: what each I keeps for its W;
- the gradient accumulator, laid out like the packed parameters.

Large buffers stay out of the branches: the branches read a slot's value and
return new values, and the slot writes (`dynamic_update_slice`) happen outside,
unconditionally, so XLA updates the scan carry in place.

Parameters arrive packed (`jpipe._pack`): one flat vector per dtype per rank,
holding only that rank's stages. Inside the branch of stage `s` the stage's
arrays are static slices of the local vector.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jpipe._pack import ParamLayout
from jpipe._plan import COLUMNS, Plan, table
from jpipe._stage import FlatLayout, StageKernels, merge_widths


def _zeros(widths: dict) -> dict:
    return {dt: jnp.zeros((n,), dt) for dt, n in widths.items()}


def build_step(stage_fns, plan: Plan, layout: ParamLayout, mesh, microbatch_inputs, pipe_axis: str):
    """Returns ``step(packed_params, batch_mb, table) -> (loss, packed_grads)``.

    Args:
      stage_fns: the user's stage functions.
      plan: the plan of the schedule.
      layout: where each stage's parameters live in the packed vectors.
      mesh: the device mesh (axis types Auto).
      microbatch_inputs: one microbatch of inputs (shape structs), to trace with.
      pipe_axis: the name of the pipeline mesh axis.
    """
    S = plan.schedule.num_stages
    M = plan.schedule.num_microbatches
    R = plan.num_ranks

    # Trace every stage's kernels, feeding each stage the previous one's output shape.
    kernels: list[StageKernels] = []
    x = None
    for s, fn in enumerate(stage_fns):
        k = StageKernels(fn, layout.stage_avals(s), x, microbatch_inputs)
        kernels.append(k)
        x = k.y
    last = kernels[-1]
    loss_leaves = jax.tree.leaves(last.y)
    if len(loss_leaves) != 1 or loss_leaves[0].shape != () or not jnp.issubdtype(
        loss_leaves[0].dtype, jnp.floating
    ):
        raise ValueError(
            f"the last stage must return the microbatch's loss as a float scalar, got {last.y}"
        )
    loss_dtype = loss_leaves[0].dtype
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
    grad_span = layout.max_stage_sizes  # per dtype: the widest stage's parameters
    flat_widths = layout.widths

    def stage_params(s, flat):
        return layout.stage_params(s, flat)

    def outputs(send=None, res=None, carry=None, dparams=None, offsets=None, loss=None):
        return (
            send if send is not None else _zeros(io_widths),
            res if res is not None else _zeros(res_widths),
            carry if carry is not None else _zeros(carry_widths),
            dparams if dparams is not None else _zeros(grad_span),
            offsets if offsets is not None else {dt: jnp.int32(0) for dt in grad_span},
            loss if loss is not None else jnp.zeros((), loss_dtype),
        )

    def make_f(s):
        k = kernels[s]

        def run(flat, inputs, io_val, res_val, carry_val):
            x = None
            if s > 0:
                x = jax.tree.unflatten(kernels[s - 1].y_tree, kernels[s - 1].y_layout.unpack(io_val))
            y, res = k.forward(stage_params(s, flat), x, inputs)
            res_flat = k.res_layout.pack(res, res_widths)
            if s == S - 1:
                return outputs(res=res_flat, loss=y[0].astype(loss_dtype))
            return outputs(send=k.y_layout.pack(y, io_widths), res=res_flat)

        return run

    def make_i(s):
        k = kernels[s]

        def run(flat, inputs, io_val, res_val, carry_val):
            res = k.res_layout.unpack(res_val)
            if s == S - 1:
                g = [jnp.full((), 1.0 / M, loss_dtype)]
            else:
                g = k.y_layout.unpack(io_val)
            dx, carry = k.input_grad(stage_params(s, flat), inputs, res, g)
            send = kernels[s - 1].y_layout.pack(dx, io_widths) if s > 0 else None
            return outputs(send=send, carry=k.carry_layout.pack(carry, carry_widths))

        return run

    def make_w(s):
        k = kernels[s]
        playout = layout.stage_layout(s)

        def run(flat, inputs, io_val, res_val, carry_val):
            res = k.res_layout.unpack(res_val)
            carry = k.carry_layout.unpack(carry_val)
            dp = k.weight_grad(stage_params(s, flat), inputs, res, carry)
            offsets = {dt: jnp.int32(layout.offset(s, dt)) for dt in grad_span}
            return outputs(dparams=playout.pack(dp, grad_span), offsets=offsets)

        return run

    def idle(flat, inputs, io_val, res_val, carry_val):
        return outputs()

    branches = [idle] + [make_f(s) for s in range(S)] + [make_i(s) for s in range(S)]
    branches += [make_w(s) for s in range(S)]
    col = {name: i for i, name in enumerate(COLUMNS)}
    shifts = plan.shifts

    def per_rank(packed, batch_mb, tab):
        flat = {dt: v[0] for dt, v in packed.items()}
        tab = tab[:, 0]
        carry0 = (
            (
                {dt: jnp.zeros((flat_widths[dt],), dt) for dt in flat_widths},
                jnp.zeros((), loss_dtype),
                {dt: jnp.zeros((plan.num_io + 1, n), dt) for dt, n in io_widths.items()},
                {dt: jnp.zeros((plan.num_res + 1, n), dt) for dt, n in res_widths.items()},
                {dt: jnp.zeros((plan.num_carry + 1, n), dt) for dt, n in carry_widths.items()},
            )
        )

        def tick(state, row):
            grads, loss, io, res, carry = state
            branch, mb = row[col["branch"]], row[col["microbatch"]]
            inputs = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, mb, 0, False), batch_mb)
            io_val = {dt: io[dt][row[col["io_in"]]] for dt in io}
            res_val = {dt: res[dt][row[col["res"]]] for dt in res}
            carry_val = {dt: carry[dt][row[col["carry"]]] for dt in carry}
            send, res_new, carry_new, dp, offsets, loss_piece = lax.switch(
                branch, branches, flat, inputs, io_val, res_val, carry_val
            )
            is_f = (branch >= 1) & (branch <= S)
            is_i = (branch > S) & (branch <= 2 * S)
            res_slot = jnp.where(is_f, row[col["res"]], plan.num_res)
            carry_slot = jnp.where(is_i, row[col["carry"]], plan.num_carry)
            res = {dt: res[dt].at[res_slot].set(res_new[dt]) for dt in res}
            carry = {dt: carry[dt].at[carry_slot].set(carry_new[dt]) for dt in carry}
            for dt, n in grad_span.items():
                seg = lax.dynamic_slice_in_dim(grads[dt], offsets[dt], n)
                grads[dt] = lax.dynamic_update_slice_in_dim(grads[dt], seg + dp[dt], offsets[dt], 0)
            loss = loss + loss_piece
            io = {dt: io[dt].at[row[col["local"]]].set(send[dt]) for dt in io}
            for i, d in enumerate(shifts):
                perm = [(j, (j + d) % R) for j in range(R)]
                arrived = {dt: lax.ppermute(send[dt], pipe_axis, perm) for dt in send}
                slot = row[len(COLUMNS) + i]
                io = {dt: io[dt].at[slot].set(arrived[dt]) for dt in io}
            return (grads, loss, io, res, carry), None

        (grads, loss, *_), _ = lax.scan(tick, carry0, tab)
        loss = lax.psum(loss, pipe_axis) / M
        return loss, {dt: g[None] for dt, g in grads.items()}

    program = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P(pipe_axis), P(), P(None, pipe_axis)),
        out_specs=(P(), P(pipe_axis)),
        axis_names={pipe_axis},
        # The kernels are pre-traced jaxprs replayed with `jaxpr_as_fun`, which
        # does not insert the casts between values that vary over `pipe` and
        # values that do not; the program differentiates nothing across ranks,
        # so the check buys nothing here.
        check_vma=False,
    )
    tab = np.asarray(table(plan))

    def step(packed, batch_mb):
        return program(packed, batch_mb, jnp.asarray(tab))

    step.kernels = kernels
    step.widths = {"io": io_widths, "res": res_widths, "carry": carry_widths}
    return step
