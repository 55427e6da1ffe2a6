"""Diagnostics: the work of a pipeline with no pipeline, and lock-step alone.

Each of R devices runs one stage's pieces (the same F, I and W kernels jpipe
runs, from `jpipe.StageKernels`) for every microbatch, on its own
copy of a middle stage's parameters; no activation travels between devices.
Three variants:

- ``free``: each device runs F, I, W for one microbatch after another with
  nothing between them: the pipeline's work at the microbatch's granularity,
  with no waiting at all (the floor any pipeline starts from).
- ``in phase``: the same pieces with a ``ppermute`` after every piece (a
  lock-step barrier, as each jpipe tick has), every device running the same
  kind of piece between two barriers.
- ``rotated``: the same, device `r` shifted by `r` pieces, so that between
  two barriers the devices run different kinds of pieces, as the ranks of any
  pipeline do (in jpipe's 1F1B each rank runs F, I and W in turn, each a tick
  after its upstream neighbour).

Comparing the three isolates the cost of lock-step execution from the cost
of the pipeline's dependencies and bookkeeping. On fake CPU devices, which
share the host's cores, ``rotated`` against ``in phase`` measures how much
devices running different pieces between barriers cost there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jpipe
from bench.baselines.unpipelined import Program
from bench.workloads import Workload

VARIANTS = ("free", "in phase", "rotated")


def stage_pieces(workload: Workload, num_microbatches: int, devices, variant: str) -> Program:
    """Every device runs a middle stage's F, I and W for `num_microbatches` microbatches.

    The program returns each device's accumulated weight gradients (stacked
    over devices), so that nothing it computes can be dropped by the compiler;
    `tests/test_bench.py` checks them against `jax.vjp` of the stage.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}: use one of {', '.join(VARIANTS)}")
    R = len(devices)
    M = num_microbatches
    model = workload.stages(max(3, R))  # (stage functions, their parameters)
    params = model[1][1]  # a middle stage: it has an input and an output
    kernels = middle_stage_kernels(workload, model, M)
    x_all = jax.tree.map(np.asarray, microbatch_inputs(workload, model, M, R))
    mesh = Mesh(np.asarray(devices), ("pipe",))
    stacked = jax.tree.map(lambda a: np.stack([np.asarray(a)] * R), params)
    body = functools.partial(_run, kernels=kernels, variant=variant, M=M, R=R)
    program = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("pipe"), P("pipe")),
            out_specs=(P("pipe"), P("pipe")),
            check_vma=False,
        )
    )
    sharded = NamedSharding(mesh, P("pipe"))
    args = (jax.device_put(stacked, sharded), jax.device_put(x_all, sharded))
    return Program(program, args)


def middle_stage_kernels(workload: Workload, model, num_microbatches: int):
    """The F, I and W pieces of stage 1 of `model` (``workload.stages(...)``), one microbatch."""
    stage_fns, params_list = model
    batch = workload.batch(num_microbatches)
    one = jax.tree.map(lambda a: a[: a.shape[0] // num_microbatches], batch)
    x = jax.eval_shape(lambda p, i: stage_fns[0](p, None, i), params_list[0], one)
    return jpipe.StageKernels.trace(stage_fns[1], params_list[1], x, one)


def microbatch_inputs(workload: Workload, model, num_microbatches: int, num_ranks: int):
    """Per device, per microbatch: an input activation and the stage's inputs.

    Stacked ``[R, M, ...]``; the activations are `model`'s first stage's real outputs.
    """
    stage_fns, params_list = model
    batch = workload.batch(num_microbatches * num_ranks)
    cut = jax.tree.map(lambda a: a.reshape((num_ranks, num_microbatches, -1) + a.shape[1:]), batch)
    first = jax.vmap(jax.vmap(lambda i: stage_fns[0](params_list[0], None, i)))
    return {"x": first(cut), "inputs": cut}


def _run(params, data, *, kernels, variant, M, R):
    params = jax.tree.map(lambda a: a[0], params)
    data = jax.tree.map(lambda a: a[0], data)
    r = lax.axis_index("pipe")
    offset = r if variant == "rotated" else 0
    steps = 3 * M + (R - 1 if variant == "rotated" else 0)
    grads0 = jax.tree.map(jnp.zeros_like, params)

    def pieces_of(m):
        x = jax.tree.map(lambda a: a[m], data["x"])
        inputs = jax.tree.map(lambda a: a[m], data["inputs"])
        return x, inputs

    if variant == "free":

        def one(carry, m):
            grads, checksum = carry
            x, inputs = pieces_of(m)
            y, res = kernels.forward(params, x, inputs)
            dx, kept = kernels.input_grad(params, inputs, res, jax.tree.leaves(y))
            dw = kernels.weight_grad(params, inputs, res, kept)
            # Returned, so that the input gradient is computed as in a pipeline.
            checksum = checksum + sum(jnp.sum(v) for v in dx)
            return (_add(grads, dw), checksum), None

        (grads, checksum), _ = lax.scan(one, (grads0, jnp.float32(0)), jnp.arange(M))
        return jax.tree.map(lambda a: a[None], grads), checksum[None]

    # Lock-step: one piece kind per step, a barrier after each. The residuals
    # and the I-to-W carry of the microbatch in flight live in the loop state.
    y0, res0 = jax.eval_shape(kernels.forward, params, *pieces_of(0))
    _, kept0 = jax.eval_shape(
        kernels.input_grad, params, pieces_of(0)[1], res0, jax.tree.leaves(y0)
    )
    zeros = functools.partial(jax.tree.map, lambda s: jnp.zeros(s.shape, s.dtype))
    y_zero = zeros(jax.tree.leaves(y0))
    state0 = (grads0, y_zero, zeros(res0), zeros(kept0), y_zero)

    def step(state, i):
        grads, y, res, kept, message = state
        j = i - offset
        kind = jnp.where((j >= 0) & (j < 3 * M), 1 + j % 3, 0)
        m = jnp.clip(j // 3, 0, M - 1)
        x, inputs = pieces_of(m)

        def f(operands):
            grads, y, res, kept = operands
            y_new, res_new = kernels.forward(params, x, inputs)
            return grads, jax.tree.leaves(y_new), res_new, kept

        def i_piece(operands):
            grads, y, res, kept = operands
            dx, kept_new = kernels.input_grad(params, inputs, res, y)
            # The input gradient leaves in the next message, as in a pipeline.
            return grads, y, res, kept_new, dx

        def w(operands):
            grads, y, res, kept = operands
            return _add(grads, kernels.weight_grad(params, inputs, res, kept)), y, res, kept

        state = lax.cond(kind == 1, f, lambda s: s, (grads, y, res, kept))
        state = lax.cond(
            kind == 2, i_piece, lambda s: s + (s[1],), state
        )  # the F's output, or the I's input gradient
        out = state[4]
        grads, y, res, kept = state[:4]
        state = lax.cond(kind == 3, w, lambda s: s, (grads, y, res, kept))
        grads, y, res, kept = state
        # The barrier: every device sends an activation to its neighbour every
        # step, as at a jpipe tick. The message is returned, not used.
        message = [lax.ppermute(v, "pipe", [(k, (k + 1) % R) for k in range(R)]) for v in out]
        return (grads, y, res, kept, message), None

    (grads, _, _, _, message), _ = lax.scan(step, state0, jnp.arange(steps))
    checksum = sum(jnp.sum(v) for v in message)
    return jax.tree.map(lambda a: a[None], grads), checksum[None]


def _add(grads, leaves):
    flat, tree = jax.tree.flatten(grads)
    return jax.tree.unflatten(tree, [g + d for g, d in zip(flat, leaves)])
