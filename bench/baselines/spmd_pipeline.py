"""The SPMD pipeline JAX users have today: GPipe by differentiating a loop.

This is the pattern of the pipeline example in JAX's shard_map documentation
and of MaxText, Praxis and AXLearn, written here from that description for
the benchmark's workloads:

- The model is an embedding, P identical pieces of layers and a head. The
  pieces' weights are stacked on a ``stage`` axis that is sharded over the
  devices (one stage per device); with R circular repeats the stack is
  ``[repeats, stages, ...]`` and stage s runs pieces ``s, s + S, ...``.
- The embedding runs on every microbatch before the pipeline, the head and
  the loss after it (both under plain `jax.jit`, outside the pipeline).
- Inside a `jax.shard_map` over ``stage``, a `lax.scan` runs ``M * repeats +
  S - 1`` iterations. In each, every stage applies its piece to the activation
  it holds (`jax.vmap` over the local stage axis), then all activations move
  one stage along the ring with `lax.ppermute`. Stage 0 takes a fresh
  microbatch in the first repeat and, in later repeats, what came back from
  the last stage; the last stage keeps its finished outputs.
- The backward is `jax.grad` of that loop, so the schedule is GPipe (all
  forwards, then all backwards) and the loop keeps residuals for every
  iteration, which grows with M. Stages in a bubble still compute (on
  whatever they hold): there is no branch to skip them.

Circular repeats need ``M >= S`` (an output must be back at stage 0 before it
is needed again).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jpipe
from bench.workloads import PeerModel, Workload


class SpmdPipeline(NamedTuple):
    """A built peer: the jitted step, its placed arguments and its mesh.

    Attributes:
      lowerable: ``jax.jit(value_and_grad(loss))`` over ``(params, batch)``.
      args: ``(params, batch)`` placed on the mesh; ``params`` is
        ``{"embed", "blocks", "head"}`` with ``blocks`` leaves
        ``[repeats, S, ...]``.
      mesh: the ``stage`` mesh.
      iterations: loop iterations per step, ``M * repeats + S - 1``.
    """

    lowerable: Any
    args: tuple
    mesh: Mesh
    iterations: int


def stack_pieces(block_params: list, num_stages: int, repeats: int):
    """Per-piece pytrees (model order) -> one pytree of ``[repeats, S, ...]`` arrays."""
    if len(block_params) != num_stages * repeats:
        raise ValueError(
            f"{len(block_params)} pieces cannot be laid out as {repeats} repeats of "
            f"{num_stages} stages"
        )

    def stack(*leaves):
        host = [np.asarray(leaf) for leaf in leaves]
        return np.stack(
            [np.stack(host[r * num_stages : (r + 1) * num_stages]) for r in range(repeats)]
        )

    return jax.tree.map(stack, *block_params)


def pipeline_loop(block, blocks, x_MxBx, *, num_stages: int, repeats: int, axis: str):
    """The loop, per device inside shard_map: ``[M, B, ...] -> [M, B, ...]`` outputs.

    Args:
      block: ``block(params, x) -> x``, one piece.
      blocks: this device's slice of the stacked weights, leaves ``[repeats, 1, ...]``.
      x_MxBx: every microbatch's embedded input (the same on every device).
      num_stages, repeats, axis: the ring's size, circular repeats, mesh axis.

    Returns:
      The last stage's outputs for every microbatch, on every device.
    """
    S, M = num_stages, x_MxBx.shape[0]
    s = lax.axis_index(axis)

    def varying(a):
        return lax.pcast(a, (axis,), to="varying")

    state_1xBx = varying(jnp.zeros((1,) + x_MxBx.shape[1:], x_MxBx.dtype))
    outputs_MxBx = varying(jnp.zeros_like(x_MxBx))
    # Only stage 0's copy is used: outputs of one repeat waiting for the next.
    loop_MxBx = varying(jnp.zeros_like(x_MxBx)) if repeats > 1 else None
    ring = [(i, (i + 1) % S) for i in range(S)]
    if repeats == 1:
        # Each stage's weights are a loop constant, as in the plain GPipe loop.
        fixed = jax.tree.map(lambda a: a[0], blocks)

        def piece(repeat, x):
            return jax.vmap(block)(fixed, x)
    else:
        # The weights of this iteration's repeat are gathered inside the loop.
        # Differentiating the loop naively keeps every iteration's gathered
        # copy (a whole stage of weights per iteration). Rematerializing all
        # but the matrix products (MaxText's "minimal" policy) gathers again
        # in the backward instead, and recomputes only cheap elementwise work.
        policy = jax.checkpoint_policies.checkpoint_dots

        def gathered(repeat, x):
            weights = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, repeat, 0, False), blocks)
            return jax.vmap(block)(weights, x)

        piece = jax.checkpoint(gathered, policy=policy)

    def iteration(carry, t):
        state_1xBx, outputs_MxBx, loop_MxBx = carry
        k = t - s  # this stage's work item: repeat k // M, microbatch k % M
        take = t % M
        fresh_1xBx = lax.dynamic_slice_in_dim(x_MxBx, take, 1)
        if repeats > 1:
            again_1xBx = lax.dynamic_slice_in_dim(loop_MxBx, take, 1)
            fresh_1xBx = jnp.where(t < M, fresh_1xBx, again_1xBx)
        state_1xBx = jnp.where(s == 0, fresh_1xBx, state_1xBx)
        out_1xBx = piece(jnp.clip(k // M, 0, repeats - 1), state_1xBx)

        first_done = (repeats - 1) * M
        done = (s == S - 1) & (k >= first_done) & (k < repeats * M)
        slot = jnp.clip(k - first_done, 0, M - 1)
        old_1xBx = lax.dynamic_slice_in_dim(outputs_MxBx, slot, 1)
        outputs_MxBx = lax.dynamic_update_slice_in_dim(
            outputs_MxBx, jnp.where(done, out_1xBx, old_1xBx), slot, 0
        )

        state_1xBx = lax.ppermute(out_1xBx, axis, ring)
        if repeats > 1:
            # What stage 0 just received is the last stage's work item t - (S - 1).
            back = t - (S - 1)
            keep = (s == 0) & (back >= 0) & (back < first_done)
            at = jnp.maximum(back, 0) % M
            old_1xBx = lax.dynamic_slice_in_dim(loop_MxBx, at, 1)
            loop_MxBx = lax.dynamic_update_slice_in_dim(
                loop_MxBx, jnp.where(keep, state_1xBx, old_1xBx), at, 0
            )
        return (state_1xBx, outputs_MxBx, loop_MxBx), None

    carry = (state_1xBx, outputs_MxBx, loop_MxBx)
    (_, outputs_MxBx, _), _ = lax.scan(iteration, carry, jnp.arange(M * repeats + S - 1))
    return lax.psum(jnp.where(s == S - 1, outputs_MxBx, 0), axis)


def peer_loss(peer: PeerModel, mesh: Mesh, num_microbatches: int, repeats: int, axis: str):
    """``loss(params, batch)``: embed, the pipeline loop, head; mean over microbatches."""
    S = mesh.shape[axis]
    M = num_microbatches

    loop = jax.shard_map(
        lambda blocks, x: pipeline_loop(
            peer.block, blocks, x, num_stages=S, repeats=repeats, axis=axis
        ),
        mesh=mesh,
        in_specs=(P(None, axis), P()),
        out_specs=P(),
        axis_names={axis},
    )

    def loss(params, batch):
        mbs = jpipe.microbatches(batch, M)
        x_MxBx = jax.vmap(peer.embed, in_axes=(None, 0))(params["embed"], mbs)
        y_MxBx = loop(params["blocks"], x_MxBx)
        losses_M = jax.vmap(peer.head, in_axes=(None, 0, 0))(params["head"], y_MxBx, mbs)
        return jnp.mean(losses_M)

    return loss


def spmd_pipeline(
    workload: Workload,
    num_microbatches: int,
    devices,
    repeats: int = 1,
    axis: str = "stage",
) -> SpmdPipeline:
    """Builds the peer for `workload` on `devices` (one stage each).

    Args:
      workload: the model.
      num_microbatches: M; the batch is ``M * workload.microbatch_size`` rows.
      devices: one device per stage.
      repeats: circular repeats (1: plain GPipe); the model is cut into
        ``len(devices) * repeats`` pieces.
      axis: the mesh axis name.

    Raises:
      ValueError: the layers do not split into the pieces, or a circular
        pipeline has fewer microbatches than stages.
    """
    S = len(devices)
    if repeats > 1 and num_microbatches < S:
        raise ValueError(
            f"a circular pipeline needs at least as many microbatches as stages: "
            f"M={num_microbatches} < S={S}"
        )
    peer = workload.peer(S * repeats)
    mesh = Mesh(np.array(devices), (axis,), axis_types=(AxisType.Auto,))
    params = {
        "embed": peer.embed_params,
        "blocks": stack_pieces(peer.block_params, S, repeats),
        "head": peer.head_params,
    }
    replicated = NamedSharding(mesh, P())
    shardings = {
        "embed": jax.tree.map(lambda _: replicated, params["embed"]),
        "blocks": jax.tree.map(lambda _: NamedSharding(mesh, P(None, axis)), params["blocks"]),
        "head": jax.tree.map(lambda _: replicated, params["head"]),
    }
    params = jax.device_put(params, shardings)
    batch = jax.device_put(workload.batch(num_microbatches), replicated)
    fn = jax.jit(
        jax.value_and_grad(peer_loss(peer, mesh, num_microbatches, repeats, axis)),
        in_shardings=(shardings, replicated),
        out_shardings=(replicated, shardings),
    )
    return SpmdPipeline(fn, (params, batch), mesh, num_microbatches * repeats + S - 1)
