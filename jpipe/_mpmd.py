"""The per-rank lowering: one small program per piece, run on its rank's own devices.

The SPMD lowering (`jpipe._lower`) makes the whole step one program that
every device runs in lock step, choosing its work each tick through
conditionals. This lowering runs the same validated schedule another way:

- **Programs.** For every stage, its pieces (F, I, W, and B, which is I then
  W in one program) are jitted on the *rank's sub-mesh*: the devices of its
  row of the ``pipe`` axis, with the mesh's other axes (``data``, ``fsdp``,
  ``tensor``). Each is a `jax.shard_map` manual over that sub-mesh that
  replays the stage's traced pieces (`jpipe.StageKernels`, the same ones the
  SPMD program runs), gathering the stage's parameters over ``fsdp`` before
  and reduce-scattering its weight gradients after, as the SPMD program
  does. No piece holds a conditional: which piece runs is decided on the
  host, once, when the op list is made.
- **The op list** (`issue_order`): every rank's actions in its own list
  order, interleaved across ranks so that no piece is issued before the
  pieces that make its inputs. The host walks it once per step, issuing
  each piece asynchronously (JAX's dispatch returns before the piece runs;
  a device runs its pieces in the order they were issued, each when its
  inputs are ready), so a rank never waits on the host for a branch.
- **Values** are separate arrays, not rows of shared buffers: an F's
  output goes to the next stage's rank with `jax.device_put` only when that
  stage is elsewhere, its residuals stay on its rank, and every value is
  dropped as soon as its last reader has been issued, so each rank holds
  its own live values and no more (the SPMD program makes every device
  allocate the busiest rank's).
- **Gradients** accumulate per rank, in place (W and B donate the
  accumulator); the finishing program of each rank averages them over the
  batch axes. The packed parameters and gradients keep the SPMD layout
  (``{bucket: [R, ...]}`` over ``pipe``): each rank's row is taken from, and
  put back into, the packed arrays without a copy, so optimizers, checkpoints
  and the trainer see the same arrays under both lowerings.

Each value a piece hands another one is stacked over the sub-mesh's devices:
``[n, *shape]`` split over every axis of the sub-mesh (``n`` its devices), the
layout of "one value per device" that the SPMD program's buffers have.

What this lowering cannot give, as it is not one traceable function: the step
inside a user's own `jax.jit` (`Pipeline.step_fn`), `jax.grad` through the
pipeline, and donation of the whole step's arguments. `Pipeline` refuses
those by name.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe._lower import axis_env
from jpipe._pack import ParamLayout
from jpipe._schedule import Action, Schedule
from jpipe._stage import StageKernels, WeightedLoss, loss_seed


def issue_order(schedule: Schedule) -> tuple[tuple[int, Action], ...]:
    """Every rank's actions in its list order, interleaved so inputs come first.

    Walks the ranks round-robin, taking from each rank as many of its next
    actions as have their inputs issued: an F needs the F of the stage before
    on its microbatch, an I or B the I or B of the stage after (the last
    stage's needs only its own F), a W its I. A validated schedule never
    stalls here; one that does is refused, naming the actions that wait.
    """
    S = schedule.num_stages
    lists = [
        [a for step in schedule.actions(r) for a in step.parts] for r in range(len(schedule.ranks))
    ]
    done: set[tuple[str, int, int]] = set()
    at = [0] * len(lists)
    order: list[tuple[int, Action]] = []

    def ready(a: Action) -> bool:
        s, m = a.stage, a.microbatch
        if a.kind == "F":
            return s == 0 or ("F", s - 1, m) in done
        if a.kind in ("I", "B"):
            if ("F", s, m) not in done:
                return False
            return s == S - 1 or ("I", s + 1, m) in done
        return ("I", s, m) in done  # W

    total = sum(len(x) for x in lists)
    while len(order) < total:
        progressed = False
        for r, actions in enumerate(lists):
            while at[r] < len(actions) and ready(actions[at[r]]):
                a = actions[at[r]]
                order.append((r, a))
                done.add((a.kind, a.stage, a.microbatch))
                if a.kind == "B":  # a B is its I and its W
                    done.add(("I", a.stage, a.microbatch))
                at[r] += 1
                progressed = True
        if not progressed:
            waiting = ", ".join(
                f"rank {r}: {actions[at[r]]}"
                for r, actions in enumerate(lists)
                if at[r] < len(actions)
            )
            raise ValueError(f"the schedule cannot proceed: every rank waits ({waiting})")
    return tuple(order)


def rank_meshes(mesh: Mesh, pipe_axis: str) -> list[Mesh]:
    """Each rank's sub-mesh: its devices of `mesh`, with every axis (``pipe`` of size 1)."""
    names = mesh.axis_names
    pipe = names.index(pipe_axis)
    return [
        Mesh(mesh.devices.take([r], axis=pipe), names, axis_types=(AxisType.Auto,) * len(names))
        for r in range(mesh.shape[pipe_axis])
    ]


def _by_device(arrays) -> dict:
    """The single-device pieces of some arrays, keyed by device."""
    return {shard.device: shard.data for a in arrays for shard in a.addressable_shards}


def _assemble(shape, sharding: NamedSharding, by_device: dict):
    """An array of `shape` over `sharding` made of the pieces in `by_device`, no copy."""
    devices = sharding.addressable_devices_indices_map(shape)
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [by_device[d] for d in devices]
    )


@dataclasses.dataclass
class RankPrograms:
    """The per-rank lowering of a plan: its pieces, their op list and what they hold.

    Made by `build_rank_programs`; `run` is one step.

    Attributes:
      meshes: each rank's sub-mesh.
      order: the op list (`issue_order`): ``(rank, action)`` in issue order.
      kernels: the stages' traced pieces, shared with the SPMD lowering.
      pieces: per stage, ``{"F", "I", "W", "B": jitted}`` on its rank's sub-mesh.
      last_run: host figures of the latest `run`: ``host_ops`` (pieces issued
        and transfers), ``seconds`` (to issue the whole step).
    """

    meshes: list
    order: tuple
    kernels: tuple
    pieces: list
    run: Callable
    loss: Callable
    compile: Callable
    last_run: dict = dataclasses.field(default_factory=dict)
    compiled: list = dataclasses.field(default_factory=list)


def build_rank_programs(
    stage_fns,
    schedule: Schedule,
    layout: ParamLayout,
    mesh: Mesh,
    kernels: list[StageKernels],
    pipe_axis: str,
    data_axis: str | None,
    stage_to_rank,
) -> RankPrograms:
    """Lowers a schedule to per-rank programs; see the module docstring."""
    S = schedule.num_stages
    M = schedule.num_microbatches
    R = mesh.shape[pipe_axis]
    fsdp = layout.fsdp_axis
    meshes = rank_meshes(mesh, pipe_axis)
    names = mesh.axis_names
    every = P(tuple(names))  # a value per device, stacked: [n, ...]
    batch_axes = tuple(a for a in (data_axis, fsdp) if a is not None)
    batch_spec = P(batch_axes or None)
    fsdp_size = mesh.shape[fsdp] if fsdp is not None else 1
    _refuse_pipe_index(kernels, dict(mesh.shape), pipe_axis)

    last = kernels[-1]
    weighted = last.y_tree == jax.tree.structure(WeightedLoss(0.0, 0.0))
    loss_leaves = jax.tree.leaves(last.y)
    loss_dtype = jnp.result_type(*(leaf.dtype for leaf in loss_leaves))
    loss_shape = (2,) if weighted else ()
    param_specs = {b: layout.spec(b, pipe_axis) for b in layout.buckets}

    def shmap(fn, m, in_specs, out_specs):
        return jax.shard_map(
            fn,
            mesh=m,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=set(names),
            check_vma=False,  # the pieces are replayed jaxprs (see jpipe._lower)
        )

    def gathered(rows, s):
        out = {}
        for b in layout.stage_buckets(s):
            d = layout.fsdp_dim(b)
            v = rows[b][0]
            out[b] = v if d is None else lax.all_gather(v, fsdp, axis=d, tiled=True)
        return out

    def scattered(b, g):
        g = g.reshape(layout.gathered_shape(b))
        d = layout.fsdp_dim(b)
        return g if d is None else lax.psum_scatter(g, fsdp, scatter_dimension=d, tiled=True)

    def inputs_of(batch, mb):
        def cut(a):
            a = a.reshape((a.shape[0] // M, M) + a.shape[1:])
            return lax.dynamic_index_in_dim(a, mb, 1, False)

        return jax.tree.map(cut, batch)

    def seed():
        if weighted:  # d(total) = 1, d(weight) = 0; divided by the weights at the end
            return [jnp.ones((), leaf.dtype) * (i == 0) for i, leaf in enumerate(loss_leaves)]
        return loss_seed(M, loss_dtype)

    pieces = []
    for s in range(S):
        k = kernels[s]
        m = meshes[stage_to_rank[s]]
        own = layout.stage_buckets(s)
        row_specs = {b: param_specs[b] for b in own}
        first, final = s == 0, s == S - 1

        def forward(rows, batch, mb, x, *loss_acc, s=s, k=k, first=first, final=final):
            """The F: ``(y, residuals)``; the last stage's ``([], residuals, loss sums)``."""
            xt = None if first else jax.tree.unflatten(kernels[s - 1].y_tree, [v[0] for v in x])
            params = layout.stage_params(s, gathered(rows, s))
            y, res = k.forward(params, xt, inputs_of(batch, mb))
            res = [v[None] for v in res]
            if final:
                piece = jnp.stack([v.astype(loss_dtype) for v in y]) if weighted else y[0]
                return [], res, loss_acc[0] + piece.astype(loss_dtype)[None]
            return [v[None] for v in y], res

        def input_grad(rows, batch, mb, res, g, s=s, k=k, final=final):
            params = layout.stage_params(s, gathered(rows, s))
            g = seed() if final else [v[0] for v in g]
            dx, kept = k.input_grad(params, inputs_of(batch, mb), [v[0] for v in res], g)
            return [v[None] for v in dx], [v[None] for v in kept]

        def weight_grad(rows, batch, mb, res, kept, acc, s=s, k=k, own=own):
            params = layout.stage_params(s, gathered(rows, s))
            dp = k.weight_grad(
                params, inputs_of(batch, mb), [v[0] for v in res], [v[0] for v in kept]
            )
            return {b: acc[b] + scattered(b, g)[None] for b, g in zip(own, dp, strict=True)}

        def backward(rows, batch, mb, res, g, acc, input_grad=input_grad, weight_grad=weight_grad):
            dx, kept = input_grad(rows, batch, mb, res, g)
            return dx, weight_grad(rows, batch, mb, res, kept, acc)

        # Specs: rows as packed, the batch over the batch axes, the
        # microbatch index replicated, every value stacked per device.
        n_x = 0 if first else kernels[s - 1].y_tree.num_leaves
        n_y = 0 if final else k.y_tree.num_leaves
        n_res, n_kept = len(k.res_avals), len(k.carry_avals)
        n_dx = n_x
        vals = lambda n: [every] * n  # noqa: E731
        acc_specs = dict(row_specs)
        loss_in = (every,) if final else ()
        f_out = (vals(n_y), vals(n_res)) + loss_in
        f = shmap(forward, m, (row_specs, batch_spec, P(), vals(n_x)) + loss_in, f_out)
        i = shmap(
            input_grad,
            m,
            (row_specs, batch_spec, P(), vals(n_res), vals(0 if final else n_y)),
            (vals(n_dx), vals(n_kept)),
        )
        w = shmap(
            weight_grad,
            m,
            (row_specs, batch_spec, P(), vals(n_res), vals(n_kept), acc_specs),
            acc_specs,
        )
        b = shmap(
            backward,
            m,
            (row_specs, batch_spec, P(), vals(n_res), vals(0 if final else n_y), acc_specs),
            (vals(n_dx), acc_specs),
        )

        # Forward-only (for `Pipeline.loss`): the same F with its residuals
        # unused, so XLA drops them.
        def forward_only(*args, forward=forward):
            out = forward(*args)
            return (out[0],) + tuple(out[2:])

        f_eval = shmap(
            forward_only,
            m,
            (row_specs, batch_spec, P(), vals(n_x)) + loss_in,
            (vals(n_y),) + loss_in,
        )
        donate_loss = (4,) if final else ()
        pieces.append(
            {
                "F": jax.jit(f, donate_argnums=donate_loss),
                "I": jax.jit(i),
                "W": jax.jit(w, donate_argnums=(5,)),
                "B": jax.jit(b, donate_argnums=(5,)),
                "F_eval": jax.jit(f_eval, donate_argnums=donate_loss),
            }
        )

    # Per rank: the gradients averaged over the batch axes (and summed over
    # fsdp where no scatter did), the loss from the last rank's sums.
    def finish_grads(acc, weight):
        out = {}
        for b, g in acc.items():
            g = g[0]
            if fsdp is not None and layout.fsdp_dim(b) is None:
                g = lax.psum(g, fsdp)
            if weighted:
                if data_axis is not None:
                    g = lax.psum(g, data_axis)
                g = g / weight[0]
            else:
                if data_axis is not None:
                    g = lax.pmean(g, data_axis)
                if fsdp is not None:
                    g = g / fsdp_size
            out[b] = g.astype(acc[b].dtype)[None]
        return out

    def finish_loss(loss_acc):
        acc = loss_acc[0]
        if weighted:
            total, weight = acc[0], acc[1]
            if batch_axes:
                total, weight = lax.psum(total, batch_axes), lax.psum(weight, batch_axes)
            return total / weight, weight[None]
        loss = acc / M
        if batch_axes:
            loss = lax.pmean(loss, batch_axes)
        return loss, jnp.ones((1,), loss_dtype)

    # Every rank accumulates (and hands back) a row of every bucket, zeros
    # in those its stages do not use: the packed layout's padding.
    finish = [
        jax.jit(shmap(finish_grads, m, (param_specs, every), param_specs), donate_argnums=(0,))
        for m in meshes
    ]
    loss_mesh = meshes[stage_to_rank[S - 1]]
    end_loss = jax.jit(shmap(finish_loss, loss_mesh, (every,), (P(), every)))

    order = issue_order(schedule)
    full_param_sharding = {b: NamedSharding(mesh, param_specs[b]) for b in layout.buckets}
    rank_param_sharding = [
        {b: NamedSharding(meshes[r], param_specs[b]) for b in layout.buckets} for r in range(R)
    ]
    rank_batch_sharding = [NamedSharding(m, batch_spec) for m in meshes]
    rank_every = [NamedSharding(m, every) for m in meshes]
    n_dev = [m.devices.size for m in meshes]
    microbatch_index = [
        [jax.device_put(jnp.int32(i), NamedSharding(m, P())) for i in range(M)] for m in meshes
    ]
    programs = RankPrograms(meshes, order, tuple(kernels), pieces, None, None, None)

    def stacked(r, avals):
        return [
            jax.ShapeDtypeStruct((n_dev[r],) + tuple(a.shape), a.dtype, sharding=rank_every[r])
            for a in avals
        ]

    def piece_args(s, kind, batch):
        """Shape structs of piece `kind`'s arguments for stage `s`, to compile it alone."""
        r = stage_to_rank[s]
        k = kernels[s]
        own = layout.stage_buckets(s)
        rows = {
            b: jax.ShapeDtypeStruct(
                (1,) + tuple(layout.buckets[b][0]),
                layout.buckets[b][1],
                sharding=rank_param_sharding[r][b],
            )
            for b in own
        }
        shapes = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rank_batch_sharding[r]), batch
        )
        idx = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(meshes[r], P()))
        x = [] if s == 0 else stacked(r, jax.tree.leaves(kernels[s - 1].y))
        res = stacked(r, k.res_avals)
        g = [] if s == S - 1 else stacked(r, jax.tree.leaves(k.y))
        acc = dict(rows)
        loss = stacked(r, [jax.ShapeDtypeStruct(loss_shape, loss_dtype)])
        if kind in ("F", "F_eval"):
            return (rows, shapes, idx, x) + ((loss[0],) if s == S - 1 else ())
        if kind == "I":
            return (rows, shapes, idx, res, g)
        if kind == "W":
            return (rows, shapes, idx, res, stacked(r, k.carry_avals), acc)
        return (rows, shapes, idx, res, g, acc)

    def compile_all(packed, batch):
        """Compiles every piece for these shapes; ``compiled[s][kind]`` are XLA's executables."""
        kinds = {a.kind for _, a in order} | {"F_eval"}
        programs.compiled = [
            {kind: pieces[s][kind].lower(*piece_args(s, kind, batch)).compile() for kind in kinds}
            for s in range(S)
        ]
        return programs.compiled

    def rank_rows(packed):
        """Each rank's rows of the packed arrays, as arrays on its sub-mesh (no copy)."""
        pieces_of = {b: _by_device([a]) for b, a in packed.items()}
        return [
            {
                b: _assemble((1,) + tuple(a.shape[1:]), rank_param_sharding[r][b], pieces_of[b])
                for b, a in packed.items()
            }
            for r in range(R)
        ]

    def rank_batches(batch):
        out = []
        for r in range(R):
            sharding = rank_batch_sharding[r]
            out.append(jax.tree.map(lambda a, sh=sharding: _rank_view(a, sh), batch))
        return out

    def send(values, r_to):
        return [jax.device_put(v, rank_every[r_to]) for v in values]

    def loss_zero(r):
        return jax.device_put(jnp.zeros((n_dev[r],) + loss_shape, loss_dtype), rank_every[r])

    grad_zeros = [
        jax.jit(
            lambda: {
                b: jnp.zeros((1,) + tuple(shape), dtype)
                for b, (shape, dtype) in layout.buckets.items()
            },
            out_shardings=rank_param_sharding[r],
        )
        for r in range(R)
    ]
    ones = [jax.device_put(jnp.ones((n_dev[r],), loss_dtype), rank_every[r]) for r in range(R)]

    def run(packed, batch):
        start = time.perf_counter()
        ops = 0
        rows, batches = rank_rows(packed), rank_batches(batch)
        acc = [zeros() for zeros in grad_zeros]
        r_last = stage_to_rank[S - 1]
        loss_acc = loss_zero(r_last)
        ops += R + 1
        x_in: dict = {}  # (s, m) -> the activation leaves stage s reads
        g_in: dict = {}  # (s, m) -> the output gradient leaves stage s reads
        res: dict = {}
        kept: dict = {}
        for r, a in order:
            s, mb = a.stage, a.microbatch
            p = pieces[s]
            own_rows = {b: rows[r][b] for b in layout.stage_buckets(s)}
            idx = microbatch_index[r][mb]
            if a.kind == "F":
                ops += 1
                x = [] if s == 0 else x_in.pop((s, mb))
                if s == S - 1:
                    _, res[(s, mb)], loss_acc = p["F"](own_rows, batches[r], idx, x, loss_acc)
                else:
                    y, res[(s, mb)] = p["F"](own_rows, batches[r], idx, x)
                    r_next = stage_to_rank[s + 1]
                    x_in[(s + 1, mb)] = y if r_next == r else send(y, r_next)
                    ops += r_next != r
                continue
            own_acc = {b: acc[r][b] for b in layout.stage_buckets(s)}
            if a.kind == "W":
                acc[r].update(
                    p["W"](own_rows, batches[r], idx, res.pop((s, mb)), kept.pop((s, mb)), own_acc)
                )
                ops += 1
                continue
            g = [] if s == S - 1 else g_in.pop((s, mb))
            if a.kind == "I":
                dx, kept[(s, mb)] = p["I"](own_rows, batches[r], idx, res[(s, mb)], g)
            else:
                dx, new_acc = p["B"](own_rows, batches[r], idx, res.pop((s, mb)), g, own_acc)
                acc[r].update(new_acc)
            ops += 1
            if s > 0:
                r_prev = stage_to_rank[s - 1]
                g_in[(s - 1, mb)] = dx if r_prev == r else send(dx, r_prev)
                ops += r_prev != r
        loss, weight = end_loss(loss_acc)
        by_device: dict = {b: {} for b in layout.buckets}
        for r in range(R):
            if not weighted:
                w = ones[r]
            else:
                w = weight if r == r_last else jax.device_put(weight, rank_every[r])
            for b, g in finish[r](acc[r], w).items():
                by_device[b].update(_by_device([g]))
            ops += 1
        grads = {
            b: _assemble(packed[b].shape, full_param_sharding[b], by_device[b])
            for b in layout.buckets
        }
        programs.last_run = {"host_ops": ops, "seconds": time.perf_counter() - start}
        return jax.device_put(loss, NamedSharding(mesh, P())), grads

    def loss_only(packed, batch):
        rows, batches = rank_rows(packed), rank_batches(batch)
        r_last = stage_to_rank[S - 1]
        loss_acc = loss_zero(r_last)
        x_in: dict = {}
        for r, a in issue_order_forward:
            s, mb = a.stage, a.microbatch
            own_rows = {b: rows[r][b] for b in layout.stage_buckets(s)}
            x = [] if s == 0 else x_in.pop((s, mb))
            idx = microbatch_index[r][mb]
            if s == S - 1:
                _, loss_acc = pieces[s]["F_eval"](own_rows, batches[r], idx, x, loss_acc)
            else:
                (y,) = pieces[s]["F_eval"](own_rows, batches[r], idx, x)
                r_next = stage_to_rank[s + 1]
                x_in[(s + 1, mb)] = y if r_next == r else send(y, r_next)
        loss, _ = end_loss(loss_acc)
        return jax.device_put(loss, NamedSharding(mesh, P()))

    issue_order_forward = tuple((r, a) for r, a in order if a.kind == "F")
    programs.run = run
    programs.loss = loss_only
    programs.compile = compile_all
    return programs


def _rank_view(a, sharding: NamedSharding):
    """`a` as an array on `sharding`'s devices: its own shards where it has them there."""
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
        devices = set(sharding.device_set)
        held = {s.device: s.data for s in a.addressable_shards if s.device in devices}
        if len(held) == len(devices):
            want = sharding.addressable_devices_indices_map(a.shape)
            have = {s.device: s.index for s in a.addressable_shards if s.device in devices}
            if all(_same_index(want[d], have[d], a.shape) for d in want):
                return _assemble(a.shape, sharding, held)
    return jax.device_put(a, sharding)


def _same_index(x, y, shape) -> bool:
    return all(sx.indices(n) == sy.indices(n) for sx, sy, n in zip(x, y, shape, strict=False))


def _refuse_pipe_index(kernels, axis_sizes: dict, pipe_axis: str) -> None:
    """Refuses a stage that reads ``lax.axis_index`` of the pipeline axis.

    Each rank runs on its own sub-mesh, whose ``pipe`` axis has one device,
    so the index would be 0 on every rank: silently wrong, so refused.
    """
    for s, k in enumerate(kernels):
        with axis_env(axis_sizes):
            text = str(jax.make_jaxpr(k._f_fn)(*_avals_of(k)))
        if f"axis_index[axis_name={pipe_axis}" in text:
            raise ValueError(
                f"stage {s} reads lax.axis_index({pipe_axis!r}); under the per-rank lowering "
                f"('mpmd') each rank runs on its own sub-mesh, where {pipe_axis!r} has one device, "
                "so the stage would see rank 0 everywhere. Pass the stage's index to the stage "
                "function instead, or use lowering='spmd'"
            )


def _avals_of(k: StageKernels):
    leaves = jax.tree.leaves(k.params) + (jax.tree.leaves(k.x) if k.has_x else [])
    return leaves + jax.tree.leaves(k.inputs)
