"""The per-rank lowering: one small program per piece, run on its rank's own devices.

The SPMD lowering (`jpipe.lower.spmd.program`) makes the whole step one program that
every device runs in lock step, choosing its work each tick through
conditionals. This lowering runs the same validated schedule another way:

- **Programs.** For every stage, its pieces (F, I, W; a B is issued as its
  I and then its W, see `RankPrograms`) are jitted on the *rank's sub-mesh*: the devices of its
  row of the ``pipe`` axis, with the mesh's other axes (``data``, ``fsdp``,
  ``tensor``). Each is a `jax.shard_map` manual over that sub-mesh that
  replays the stage's traced pieces (`jpipe.StageKernels`, the same ones the
  SPMD program runs), gathering the stage's parameters over ``fsdp`` before
  and reduce-scattering its weight gradients after, as the SPMD program
  does. No piece holds a conditional: which piece runs is decided on the
  host, once, when the op list is made.
- **The op list** (`issue_ops`): every rank's actions in its own list
  order, interleaved across ranks so that no piece is issued before the
  pieces that make its inputs. The host walks it once per step, issuing
  each piece asynchronously (JAX's dispatch returns before the piece runs;
  a device runs its pieces in the order they were issued, each when its
  inputs are ready), so a rank never waits on the host for a branch.
- **Overlapped cells.** An `Overlap(F, B)` cell (DualPipe's) is one program:
  the forward's piece and the backward's (a B's I and W) traced into one
  jit, so XLA may schedule the two halves' work together, and a B's I-to-W
  carry never leaves it. A cell whose backward needs what its own forward
  starts cannot be one program; it is issued as its two halves (`issue_ops`).
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
- **Replicated stages** (Chimera's two pipelines): a stage on several ranks
  has its pieces jitted on each of them, and each rank holds a copy of its
  parameters (`ParamLayout.stage_ranks`). A microbatch's pieces run on the
  rank that runs its forward (`jpipe.Analysis.key_rank`), so every value is
  sent to the rank of the microbatch that reads it. At the step's end each
  copy's gradient sums go to the stage's first rank, are added there in rank
  order, and the total is sent back, so every copy's gradient, and after the
  optimizer every copy's parameters, are the same. The copies of the last
  stage add their loss sums the same way.

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
import functools
import math
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jpipe.lower.interface import MPMD, Lowering
from jpipe.lower.mpmd.transfer import Courier, process_of
from jpipe.lower.spmd.program import axis_env
from jpipe.lower.spmd.ticks import make_forward_tick_plan, make_tick_plan
from jpipe.schedule.actions import Action, Overlap, Schedule
from jpipe.schedule.validate import analyze
from jpipe.stage.contract import check_stage_outputs
from jpipe.stage.pack import ParamLayout
from jpipe.stage.pieces import StageKernels, WeightedLoss, loss_seed


class OpList(NamedTuple):
    """The per-rank lowering's op list (`issue_ops`).

    Attributes:
      order: ``(rank, action)`` in issue order.
      cells: the positions in `order` of the forward half of each `Overlap`
        cell issued as one program; its backward half is the next op.
    """

    order: tuple[tuple[int, Action], ...]
    cells: frozenset[int]


def issue_order(schedule: Schedule) -> tuple[tuple[int, Action], ...]:
    """The op list's order (`issue_ops`): ``(rank, action)``, inputs first."""
    return issue_ops(schedule).order


def issue_ops(schedule: Schedule, fuse_cells: bool = True) -> OpList:
    """Every rank's actions in its list order, interleaved so inputs come first.

    Walks the ranks round-robin, taking from each rank as many of its next
    actions as have their inputs issued: an F (or FC) needs the forward of the
    stage before on its microbatch, an I or B the I or B of the stage after
    (the last stage's needs only its own forward), a W its I; a memory action
    needs only what its own rank issued before it.

    An `Overlap` cell is taken whole, as one program (`RankPrograms`), once
    both its halves have their inputs. A cell whose backward needs what its
    own forward starts (on its rank, or through other ranks) cannot be one
    program: where every rank waits and some cells' forwards could go alone,
    the first cell whose backward its own forward alone unblocks (the walk
    tried with that cell split reaches its backward before it stalls again)
    is split into its two halves, issued apart; where none is, the first
    ready one. A validated schedule never stalls here; one that does is
    refused, naming the actions that wait. With `fuse_cells` False every cell
    is issued as its two halves (no `OpList.cells`).
    """
    walk = _Walk(schedule, fuse_cells)
    while not walk.finished():
        if walk.run():
            continue
        ready = walk.splittable()
        if not ready:
            waiting = ", ".join(
                f"rank {r}: {x[walk.at[r]]}"
                for r, x in enumerate(walk.lists)
                if walk.at[r] < len(x)
            )
            raise ValueError(f"the schedule cannot proceed: every rank waits ({waiting})")
        walk.split(next((r for r in ready if walk.unblocks_itself(r)), ready[0]))
    return OpList(tuple(walk.order), frozenset(walk.cells))


class _Walk:
    """The state of `issue_ops`' walk: what is issued, and where each rank stands."""

    def __init__(self, schedule: Schedule, fuse_cells: bool):
        self.S = schedule.num_stages
        self.lists: list[list[Action]] = []
        self.cell_starts: list[set[int]] = []  # per rank, where each cell starts in its list
        for row in schedule.ranks:
            actions, starts = [], set()
            for step in row:
                if isinstance(step, Overlap) and fuse_cells:
                    starts.add(len(actions))
                actions += step.parts
            self.lists.append(actions)
            self.cell_starts.append(starts)
        self.done: set[tuple[str, int, int]] = set()
        self.at = [0] * len(self.lists)
        self.order: list[tuple[int, Action]] = []
        self.cells: set[int] = set()

    def copy(self) -> _Walk:
        other = object.__new__(_Walk)
        other.S, other.lists = self.S, self.lists
        other.cell_starts = [set(s) for s in self.cell_starts]
        other.done, other.at = set(self.done), list(self.at)
        other.order, other.cells = list(self.order), set(self.cells)
        return other

    def finished(self) -> bool:
        return all(at == len(x) for at, x in zip(self.at, self.lists, strict=True))

    def ready(self, a: Action) -> bool:
        s, m, done = a.stage, a.microbatch, self.done
        if a.kind in ("F", "FC"):
            return s == 0 or ("F", s - 1, m) in done
        if a.kind in ("I", "B"):
            if ("F", s, m) not in done:
                return False
            return s == self.S - 1 or ("I", s + 1, m) in done
        if a.kind == "W":
            return ("I", s, m) in done
        return True  # a memory action: its rank's list order is all it needs

    def _issue(self, r: int, a: Action) -> None:
        self.order.append((r, a))
        self.done.add((a.kind, a.stage, a.microbatch))
        if a.kind == "B":  # a B is its I and its W
            self.done.add(("I", a.stage, a.microbatch))
        if a.kind == "FC":  # a forward, whatever it keeps
            self.done.add(("F", a.stage, a.microbatch))
        self.at[r] += 1

    def run(self) -> bool:
        """One round over the ranks, each as far as it can go; whether any moved."""
        progressed = False
        for r, actions in enumerate(self.lists):
            while self.at[r] < len(actions):
                a = actions[self.at[r]]
                if self.at[r] in self.cell_starts[r]:  # a cell: both halves at once, or wait
                    b = actions[self.at[r] + 1]
                    if not (self.ready(a) and self.ready(b)):
                        break
                    self.cells.add(len(self.order))
                    self._issue(r, a)
                    self._issue(r, b)
                elif self.ready(a):
                    self._issue(r, a)
                else:
                    break
                progressed = True
        return progressed

    def splittable(self) -> list[int]:
        """The ranks waiting at a cell whose forward could go alone."""
        return [
            r
            for r, x in enumerate(self.lists)
            if self.at[r] in self.cell_starts[r] and self.ready(x[self.at[r]])
        ]

    def split(self, r: int) -> None:
        """Rank `r`'s waiting cell issued as its two halves."""
        self.cell_starts[r].discard(self.at[r])

    def unblocks_itself(self, r: int) -> bool:
        """Whether splitting rank `r`'s waiting cell lets the walk reach its backward before
        it next stalls: the cell waited on its own forward."""
        trial, i = self.copy(), self.at[r] + 1
        trial.split(r)
        while trial.at[r] <= i and trial.run():
            pass
        return trial.at[r] > i


# The compiled piece each kind runs (None: a transfer, not a program of its own).
_PIECE_OF = {
    "FC": "F_eval",  # a forward keeping nothing but its input
    "EVICT": None,
    "LOAD": None,
    "OFFLOAD_START": None,
    "OFFLOAD_END": None,
    "RELOAD_START": None,
    "RELOAD_END": None,
}


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


def _per_device_bytes(avals) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)


class RankMemory(NamedTuple):
    """What one device of a rank holds under the per-rank lowering, in bytes.

    Accounted by `RankPrograms.account` from the op list and the compiled
    pieces, not measured: `values_bytes` is checked against
    `jax.live_arrays` on real runs (tests/test_mpmd.py).

    Attributes:
      param_bytes: the rank's rows of the packed parameters (its stages' own
        arrays, and the zero rows of buckets only other ranks use).
      grad_bytes: its gradient accumulators (its own stages' buckets).
      values_bytes: the most its live values (activations arriving,
        residuals, I-to-W carries, gradients passing) ever reach.
      peak_bytes: the most, over the op list, of its accumulators and live
        values plus the working memory (compiled temp and new outputs) of
        the piece it runs then: the figure to compare with the simulator's
        need of the rank, which counts the same things.
      largest_piece_bytes: the largest working memory of one of its pieces.
    """

    param_bytes: int
    grad_bytes: int
    values_bytes: int
    peak_bytes: int
    largest_piece_bytes: int


class RankPrograms:
    """The per-rank lowering of a schedule: its pieces, their op list and what they hold.

    Built by `jpipe.Pipeline` with ``lowering="mpmd"``
    (`Pipeline.rank_programs`); `run` is one training step, `loss` one
    forward-only evaluation. See the module docstring for the design.

    Attributes:
      meshes: each rank's sub-mesh.
      order: the op list (`issue_ops`): ``(rank, action)`` in issue order.
      cells: the positions in `order` of each `Overlap` cell issued as one
        program (its forward half; its backward half is the next op).
        `fuse_cells=False` issues every cell as its two halves.
      kernels: the stages' traced pieces, shared with the SPMD lowering.
      places: every ``(stage, rank)`` that runs a stage's pieces: one per
        stage, several for a replicated one.
      key_rank: the rank of each ``(stage, microbatch)``, at
        ``stage * M + microbatch`` (`jpipe.Analysis.key_rank`).
      pieces: per place ``(stage, rank)``, ``{"F", "I", "W", "B", "F_eval":
        jitted}`` on the rank's sub-mesh (``F_eval``: the forward of `loss`,
        keeping nothing).
      cell_pieces: ``{(rank, forward's stage, backward's stage, "I" or "B"):
        jitted}``, each kind of cell in `cells` as one program (`_cell_piece`).
      compiled: per place of this process's ranks, the pieces' executables,
        once `compile` ran (`run` compiles on its first call).
      compiled_cells: the cells' executables, keyed as `cell_pieces`.
      last_run: host figures of the latest `run`: ``host_ops`` (pieces,
        transfers and set-up calls issued) and ``seconds`` (to issue them
        all; the devices finish later).
    """

    def __init__(
        self,
        schedule: Schedule,
        layout: ParamLayout,
        mesh: Mesh,
        kernels: list[StageKernels],
        pipe_axis: str,
        data_axis: str | None,
        stage_to_rank,
        fused_backward: bool = False,
        meshes=None,
        fuse_cells: bool = True,
    ):
        check_stage_outputs(kernels)  # the rules both lowerings share, before anything lowers
        self.schedule, self.layout, self.mesh = schedule, layout, mesh
        self.fused_backward = fused_backward
        self.kernels = tuple(kernels)
        self.stage_to_rank = tuple(stage_to_rank)
        self.stage_ranks = layout.stage_ranks
        self.places = tuple((s, r) for s, ranks in enumerate(self.stage_ranks) for r in ranks)
        self.key_rank = analyze(schedule).key_rank
        self.data_axis = data_axis
        # Ranks with meshes of their own shapes hold their parameters as one
        # dict each (`shaped`); otherwise as rows of the packed [R, ...] arrays.
        self.shaped = meshes is not None
        self.meshes = list(meshes) if self.shaped else rank_meshes(mesh, pipe_axis)
        S, R = schedule.num_stages, len(self.meshes)
        self.num_stages, self.num_ranks = S, R
        self.M = schedule.num_microbatches
        # A sliced schedule's microbatch u is slice u % k of sequence u // k.
        self.slices, self.num_sequences = schedule.num_slices, schedule.num_sequences
        if len(set(schedule.slices)) > 1:
            raise ValueError(
                f"the per-rank lowering runs even slices only for now; this schedule cuts "
                f"each sequence into slices of relative lengths {schedule.slices} (uneven "
                "slices need one program per slice length)"
            )
        self.layouts = [
            layout.on_axes({a: n for a, n in m.shape.items() if a not in (pipe_axis, data_axis)})
            if self.shaped
            else layout
            for m in self.meshes
        ]
        _refuse_pipe_index(
            kernels, [dict(self.meshes[r].shape) for r in self.stage_to_rank], pipe_axis
        )
        self.courier = Courier([process_of(m) for m in self.meshes])
        self.local = self.courier.local  # per rank: are its devices this process's?
        if self.shaped:
            _refuse_evictions_across_shapes(schedule, self.meshes)
            _refuse_copies_across_shapes(self.stage_ranks, self.meshes)
        names = self.meshes[0].axis_names
        self.fsdp = layout.fsdp_axis
        self.batch_axes = tuple(a for a in (data_axis, self.fsdp) if a is not None)
        self.every = P(tuple(names))  # a value per device, stacked: [n, ...]
        self.batch_spec = P(self.batch_axes or None)
        self.param_specs = {b: layout.spec(b, pipe_axis) for b in layout.buckets}

        last = kernels[-1]
        self.weighted = jax.tree.structure(last.out) == jax.tree.structure(WeightedLoss(0.0, 0.0))
        self.loss_leaves = jax.tree.leaves(last.out)
        self.loss_dtype = jnp.result_type(*(leaf.dtype for leaf in self.loss_leaves))
        self.loss_shape = (2,) if self.weighted else ()

        # Each rank's own buckets: those of its stages, in a fixed order.
        self.rank_buckets = [layout.rank_buckets(r) for r in range(R)]
        self.full_param_sharding = (
            None
            if self.shaped
            else {b: NamedSharding(mesh, self.param_specs[b]) for b in layout.buckets}
        )
        self.rank_param_sharding = [
            {b: NamedSharding(m, self.param_specs[b]) for b in layout.buckets} for m in self.meshes
        ]
        self.rank_batch_sharding = [NamedSharding(m, self.batch_spec) for m in self.meshes]
        self.rank_every = [NamedSharding(m, self.every) for m in self.meshes]
        self.rank_host = None  # where OFFLOAD_START puts residuals: each rank's host memory
        if any(a.kind == "OFFLOAD_START" for _, _, a in schedule.all_actions()):
            self.rank_host = [_host_sharding(m, self.every) for m in self.meshes]
        self.n_dev = [m.devices.size for m in self.meshes]
        # Each stage's output (what it sends on), per device.
        self._y_avals = [jax.tree.leaves(kk.out) for kk in kernels]
        # A sliced schedule's slice carries (`jpipe.stage.carry`): how many of
        # x's and y's leaves each stage's carry is, and its zeros, per rank.
        self._n_carry = [kk.num_carry_leaves for kk in kernels]
        self._carry_zeros = {
            (s, r): self._zeros_of(r, jax.tree.leaves(kernels[s].y[1]))
            for s, r in self.places
            if self._n_carry[s]
        }

        self.order, self.cells = issue_ops(schedule, fuse_cells)
        self.forward_order = tuple((r, a) for r, a in self.order if a.kind in ("F", "FC"))
        self.pieces = {(s, r): self._stage_pieces(s, r) for s, r in self.places}
        self.cell_pieces = {
            key: self._cell_piece(*key) for key in sorted({self._cell_key(i) for i in self.cells})
        }
        self._finish = [self._finish_grads(r) for r in range(R)]
        self._end_loss = self._finish_loss()
        self._zeros = [
            jax.jit(
                lambda r=r: {
                    b: jnp.zeros((1,) + tuple(layout.buckets[b][0]), layout.buckets[b][1])
                    for b in self.rank_buckets[r]
                },
                out_shardings={b: self.rank_param_sharding[r][b] for b in self.rank_buckets[r]},
            )
            for r in range(R)
        ]
        self._padding = [
            jax.jit(
                lambda r=r: {
                    b: jnp.zeros((1,) + tuple(shape), dtype)
                    for b, (shape, dtype) in layout.buckets.items()
                    if b not in self.rank_buckets[r]
                },
                out_shardings={
                    b: self.rank_param_sharding[r][b]
                    for b in layout.buckets
                    if b not in self.rank_buckets[r]
                },
            )
            for r in range(R)
        ]
        # Per rank, only where its devices are this process's (None elsewhere).
        self._index = [
            [jax.device_put(jnp.int32(i), NamedSharding(m, P())) for i in range(self.M)]
            if self.local[r]
            else None
            for r, m in enumerate(self.meshes)
        ]
        self._scalar = [NamedSharding(m, P()) for m in self.meshes]
        self._ones = [
            jax.device_put(jnp.ones((), self.loss_dtype), self._scalar[r])
            if self.local[r]
            else None
            for r in range(R)
        ]
        self._add = jax.jit(lambda xs, ys: [x + y for x, y in zip(xs, ys, strict=True)])
        self.compiled: dict = {}
        self.compiled_cells: dict = {}  # {(rank, forward's stage, backward's, kind): compiled}
        # seconds to lower and compile each piece, ``{(stage, rank, kind): seconds}``
        self.compile_seconds: dict[tuple[int, int, str], float] = {}
        self.last_run: dict = {}

    # -- the programs ------------------------------------------------------------

    def _shmap(self, fn, mesh, in_specs, out_specs):
        return jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=set(mesh.axis_names),
            check_vma=False,  # the pieces are replayed jaxprs (see jpipe.lower.spmd.program)
        )

    def rank_of(self, s: int, mb: int) -> int:
        """The rank that runs microbatch `mb` of stage `s`."""
        return self.key_rank[s * self.M + mb]

    def _gathered(self, rows, s, r):
        """Stage `s`'s arrays from rank `r`'s rows, gathered over ``fsdp`` where it splits them."""
        out, layout = {}, self.layouts[r]
        for b in layout.stage_buckets(s):
            d = layout.fsdp_dim(b)
            v = rows[b][0]
            out[b] = v if d is None else lax.all_gather(v, self.fsdp, axis=d, tiled=True)
        return layout.stage_params(s, out)

    def _scattered(self, b, g, r):
        """A weight gradient of bucket `b` on rank `r`, summed over ``fsdp`` and cut to this
        device's block."""
        layout = self.layouts[r]
        g = g.reshape(layout.gathered_shape(b))
        d = layout.fsdp_dim(b)
        return g if d is None else lax.psum_scatter(g, self.fsdp, scatter_dimension=d, tiled=True)

    def _inputs_of(self, batch, mb):
        """Microbatch `mb` of this device's rows: ``mb, mb + M, ...``, as `split_microbatches`.

        Sliced (k slices), sequence ``mb // k``'s rows and, of their second
        axis (the tokens), slice ``mb % k``'s.
        """
        M, k = self.num_sequences, self.slices

        def cut(a):
            a = a.reshape((a.shape[0] // M, M) + a.shape[1:])
            if k == 1:
                return lax.dynamic_index_in_dim(a, mb, 1, False)
            a = lax.dynamic_index_in_dim(a, mb // k, 1, False)
            length = a.shape[1] // k
            return lax.dynamic_slice_in_dim(a, (mb % k) * length, length, axis=1)

        return jax.tree.map(cut, batch)

    def _zeros_of(self, r: int, avals):
        """A jitted maker of zeros of `avals`, one per device of rank `r`, stacked."""
        shardings = [self.rank_every[r]] * len(avals)
        n = self.n_dev[r]
        return jax.jit(
            lambda: [jnp.zeros((n,) + tuple(a.shape), a.dtype) for a in avals],
            out_shardings=shardings,
        )

    def _seed(self):
        if self.weighted:  # d(total) = 1, d(weight) = 0: divided by the weights at the end
            return [jnp.ones((), leaf.dtype) * (i == 0) for i, leaf in enumerate(self.loss_leaves)]
        return loss_seed(self.M, self.loss_dtype)

    def _stage_pieces(self, s: int, r: int) -> dict:
        """Stage `s`'s F, I, W, B and F_eval, jitted on rank `r`'s sub-mesh."""
        S, k, layout = self.num_stages, self.kernels[s], self.layouts[r]
        mesh = self.meshes[r]
        own = layout.stage_buckets(s)
        final = s == S - 1
        loss_dtype, weighted = self.loss_dtype, self.weighted

        # The loss's leaves, where the last stage's output begins (then its carry's).
        n_loss = len(self.loss_leaves) if final else 0

        def stage_forward(rows, batch, mb, x):
            # x: the input's leaves, then the slice carry's (`jpipe.stage.carry`).
            xt = jax.tree.unflatten(jax.tree.structure(k.x), [v[0] for v in x])
            y, res = k.forward(self._gathered(rows, s, r), xt, self._inputs_of(batch, mb))
            return y, [v[None] for v in res]

        def forward(rows, batch, mb, x, *loss_acc):
            """``(y, residuals)``; the last stage's ``(carry, residuals, loss sums)``."""
            y, res = stage_forward(rows, batch, mb, x)
            if final:
                loss, y = y[:n_loss], y[n_loss:]
                piece = jnp.stack([v.astype(loss_dtype) for v in loss]) if weighted else loss[0]
                return [v[None] for v in y], res, loss_acc[0] + piece.astype(loss_dtype)[None]
            return [v[None] for v in y], res

        def forward_only(*args):  # its residuals unused, so XLA drops them
            out = forward(*args)
            return (out[0],) + tuple(out[2:])

        def recompute(*args):  # an FC's residuals again, from its kept input
            return stage_forward(*args)[1]

        def input_grad(rows, batch, mb, res, g):
            g = (self._seed() if final else []) + [v[0] for v in g]
            params, inputs = self._gathered(rows, s, r), self._inputs_of(batch, mb)
            dx, kept = k.input_grad(params, inputs, [v[0] for v in res], g)
            return [v[None] for v in dx], [v[None] for v in kept]

        def weight_grad(rows, batch, mb, res, kept, acc):
            params, inputs = self._gathered(rows, s, r), self._inputs_of(batch, mb)
            dp = k.weight_grad(params, inputs, [v[0] for v in res], [v[0] for v in kept])
            return {
                b: acc[b] + self._scattered(b, g, r)[None] for b, g in zip(own, dp, strict=True)
            }

        def backward(rows, batch, mb, res, g, acc):
            dx, kept = input_grad(rows, batch, mb, res, g)
            return dx, weight_grad(rows, batch, mb, res, kept, acc)

        # Specs: rows as packed, the batch over the batch axes, the
        # microbatch index replicated, every value stacked per device.
        def vals(n):
            return [self.every] * n

        rows = {b: self.param_specs[b] for b in own}
        n_x = len(jax.tree.leaves(k.x))
        n_g = k.y_tree.num_leaves - n_loss
        n_res, n_kept = len(k.res_avals), len(k.carry_avals)
        common = (rows, self.batch_spec, P())
        loss = (self.every,) if final else ()
        donate_loss = (4,) if final else ()
        specs = {
            "F": (forward, common + (vals(n_x),) + loss, (vals(n_g), vals(n_res)) + loss),
            "F_eval": (forward_only, common + (vals(n_x),) + loss, (vals(n_g),) + loss),
            "RECOMPUTE": (recompute, common + (vals(n_x),), vals(n_res)),
            "I": (input_grad, common + (vals(n_res), vals(n_g)), (vals(n_x), vals(n_kept))),
            "W": (weight_grad, common + (vals(n_res), vals(n_kept), rows), rows),
            "B": (backward, common + (vals(n_res), vals(n_g), rows), (vals(n_x), rows)),
        }
        donate = {
            "F": donate_loss,
            "F_eval": donate_loss,
            "RECOMPUTE": (),
            "I": (),
            "W": (5,),
            "B": (5,),
        }
        return {
            kind: jax.jit(self._shmap(fn, mesh, ins, outs), donate_argnums=donate[kind])
            for kind, (fn, ins, outs) in specs.items()
        }

    def _cell_key(self, i: int) -> tuple[int, int, int, str]:
        """The fused cell at `order[i]`: ``(its rank, its forward's stage, its backward's,
        "I" or "B")``."""
        r, f = self.order[i]
        return r, f.stage, self.order[i + 1][1].stage, self.order[i + 1][1].kind

    def _cell_piece(self, r: int, sf: int, sb: int, kind: str):
        """An `Overlap` cell's two halves as one program: stage `sf`'s F, then stage `sb`'s
        I or B (its I and W), on rank `r`'s sub-mesh.

        Its arguments are the F's and then the backward's, as each piece takes
        them; it returns ``(F's outputs, the backward's)``. Nothing orders one
        half after the other inside it (neither reads the other's outputs), so
        XLA may interleave their work; a B's I-to-W carry never leaves it.
        """
        f, b = self.pieces[sf, r], self.pieces[sb, r]
        n_f = 5 if sf == self.num_stages - 1 else 4

        def cell(*args):
            fa, ba = args[:n_f], args[n_f:]
            if kind == "I":
                back = b["I"](*ba)
            elif self.fused_backward:
                back = b["B"](*ba)
            else:
                dx, carry = b["I"](*ba[:5])
                back = dx, b["W"](*ba[:4], carry, ba[5])
            return f["F"](*fa), back

        donate = ((4,) if n_f == 5 else ()) + ((n_f + 5,) if kind == "B" else ())
        return jax.jit(cell, donate_argnums=donate)

    def _finish_grads(self, r: int):
        """Rank `r`'s gradients averaged over the batch axes (fsdp summed where no scatter did).

        None where that is the identity (unweighted, no batch axis over
        several devices): `run` then returns the accumulated sums as they are.
        """
        fsdp, data_axis, layout = self.fsdp, self.data_axis, self.layouts[r]
        fsdp_size = self.meshes[r].shape[fsdp] if fsdp is not None else 1
        if not self.weighted and fsdp is None and self.meshes[r].shape.get(data_axis, 1) == 1:
            return None

        def finish(acc, weight):
            out = {}
            for b, g in acc.items():
                g = g[0]
                if fsdp is not None and layout.fsdp_dim(b) is None:
                    g = lax.psum(g, fsdp)
                if self.weighted:
                    if data_axis is not None:
                        g = lax.psum(g, data_axis)
                    g = g / weight
                else:
                    if data_axis is not None:
                        g = lax.pmean(g, data_axis)
                    if fsdp is not None:
                        g = g / fsdp_size
                out[b] = g.astype(acc[b].dtype)[None]
            return out

        specs = {b: self.param_specs[b] for b in self.rank_buckets[r]}
        program = self._shmap(finish, self.meshes[r], (specs, P()), specs)
        return jax.jit(program, donate_argnums=(0,))

    def _finish_loss(self):
        """The step's loss from the last rank's sums (and the summed weights, when weighted)."""
        batch_axes, M = self.batch_axes, self.M

        def finish(loss_acc):
            acc = loss_acc[0]
            if self.weighted:
                total, weight = acc[0], acc[1]
                if batch_axes:
                    total, weight = lax.psum(total, batch_axes), lax.psum(weight, batch_axes)
                return total / weight, weight
            loss = acc / M
            if batch_axes:
                loss = lax.pmean(loss, batch_axes)
            return loss, jnp.ones((), self.loss_dtype)

        mesh = self.meshes[self.stage_ranks[-1][0]]
        return jax.jit(self._shmap(finish, mesh, (self.every,), (P(), P())))

    # -- compiling -----------------------------------------------------------------

    def _stacked(self, r, avals):
        return [
            jax.ShapeDtypeStruct(
                (self.n_dev[r],) + tuple(a.shape), a.dtype, sharding=self.rank_every[r]
            )
            for a in avals
        ]

    def _piece_args(self, s: int, r: int, kind: str, batch) -> tuple:
        """Shape structs of stage `s`'s piece `kind`'s arguments on rank `r`, to compile alone."""
        k, layout = self.kernels[s], self.layout
        rows = {
            b: jax.ShapeDtypeStruct(
                (1,) + tuple(layout.buckets[b][0]),
                layout.buckets[b][1],
                sharding=self.rank_param_sharding[r][b],
            )
            for b in layout.stage_buckets(s)
        }
        shapes = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.rank_batch_sharding[r]),
            batch,
        )
        common = (
            rows,
            shapes,
            jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(self.meshes[r], P())),
        )
        res = self._stacked(r, k.res_avals)
        n_loss = len(self.loss_leaves) if s == self.num_stages - 1 else 0
        g = self._stacked(r, jax.tree.leaves(k.y)[n_loss:])
        x = self._stacked(r, jax.tree.leaves(k.x))
        if kind == "RECOMPUTE":
            return common + (x,)
        if kind in ("F", "F_eval"):
            loss = jax.ShapeDtypeStruct((self.n_dev[r],) + self.loss_shape, self.loss_dtype)
            loss = jax.ShapeDtypeStruct(loss.shape, loss.dtype, sharding=self.rank_every[r])
            return common + (x,) + ((loss,) if s == self.num_stages - 1 else ())
        if kind == "I":
            return common + (res, g)
        if kind == "W":
            return common + (res, self._stacked(r, k.carry_avals), rows)
        return common + (res, g, rows)

    def compile(self, packed, batch) -> list:
        """Compiles every piece the step issues for these shapes (arrays or structs).

        ``compiled[s, r][kind]``, only for the places of this process's ranks.
        ``F_eval``, `loss`'s forward, is compiled by the first `loss` call
        unless the schedule issues it (FC).
        """
        del packed  # the layout says the shapes
        kinds = {_PIECE_OF.get(a.kind, a.kind) for _, a in self.order}
        if "B" in kinds and not self.fused_backward:
            kinds = (kinds - {"B"}) | {"I", "W"}
        kinds = sorted(kinds - {None})
        local = [(s, r) for s, r in self.places if self.local[r]]
        compiled = self._compile_pieces([(s, r, kind) for s, r in local for kind in kinds], batch)
        self.compiled = {(s, r): {kind: compiled[s, r, kind] for kind in kinds} for s, r in local}
        self.compiled_cells = {}
        for key, piece in self.cell_pieces.items():
            r, sf, sb, kind = key
            if not self.local[r]:
                continue
            start = time.perf_counter()
            args = self._piece_args(sf, r, "F", batch) + self._piece_args(sb, r, kind, batch)
            self.compiled_cells[key] = piece.lower(*args).compile()
            self.compile_seconds[sf, r, f"F{sf}+{kind}{sb}"] = time.perf_counter() - start
        return self.compiled

    def _compile_pieces(self, keys, batch) -> dict:
        """``{(stage, rank, kind): compiled}`` for these shapes.

        One after another: compiling them in threads side by side measured no
        faster on XLA:CPU (Llama-3-70B widths, 8 blocks on pipe 8 x tensor 8:
        35.3 s in two threads, 36.0 s in one), whose compiles use the cores
        already. A piece is compiled for its rank's devices, so stages alike
        on different ranks are compiled once each: a deserialized executable
        keeps the devices it was compiled for (jaxlib 0.10.2 and 0.12.1, even
        with ``execution_devices``). Stages alike on one rank are compiled
        once each too: the same lowered text does not make two pieces the
        same program, since jit leaves out the arguments a piece does not
        read (an input gradient reads no bias) and, on jax 0.12, passes large
        constants as arguments the text shows only by shape.
        """
        out = {}
        for s, r, k in keys:
            start = time.perf_counter()
            out[s, r, k] = self.pieces[s, r][k].lower(*self._piece_args(s, r, k, batch)).compile()
            self.compile_seconds[s, r, k] = time.perf_counter() - start
        return out

    def rank_compile_seconds(self) -> list[float | None]:
        """Per rank, the seconds its pieces took to lower and compile (None for another
        process's rank): what each process compiles where every rank has its own."""
        out: list[float | None] = [None] * self.num_ranks
        for (_, r, _), seconds in self.compile_seconds.items():
            out[r] = (out[r] or 0.0) + seconds
        return out

    # -- running -----------------------------------------------------------------

    def _rank_rows(self, packed) -> list[dict | None]:
        """Each local rank's rows of its own buckets, as arrays on its sub-mesh (no copy)."""
        if self.shaped:  # already one dict per rank
            if len(packed) != self.num_ranks:
                raise ValueError(
                    f"got parameters for {len(packed)} ranks; the pipeline has {self.num_ranks}"
                )
            return [dict(p) if here else None for p, here in zip(packed, self.local, strict=True)]
        pieces_of = {b: _by_device([a]) for b, a in packed.items()}
        return [
            {
                b: _assemble(
                    (1,) + tuple(packed[b].shape[1:]), self.rank_param_sharding[r][b], pieces_of[b]
                )
                for b in self.rank_buckets[r]
            }
            if self.local[r]
            else None
            for r in range(self.num_ranks)
        ]

    def _rank_batches(self, batch) -> list:
        return [
            jax.tree.map(lambda a, sh=sh: _rank_view(a, sh), batch) if here else None
            for sh, here in zip(self.rank_batch_sharding, self.local, strict=True)
        ]

    def _move(self, values, r_from, r_to, key, avals):
        """`values` (per-device avals `avals`) from rank `r_from` to `r_to` (`Courier.move`).

        Between ranks whose meshes differ in shape (a value the same on every
        device of the model axes, as a stage's output and input gradient are),
        each of `r_to`'s devices gets the copy of the device of `r_from` with
        its data and fsdp coordinates.
        """
        if r_from == r_to:
            return values
        if self.meshes[r_from].devices.shape == self.meshes[r_to].devices.shape:
            return self.courier.move(values, r_from, r_to, key, self._stacked(r_to, avals))
        # Per leaf, per device of r_to (in its mesh's order): the sender's piece.
        pairs = self._regrouping(r_from, r_to)
        pieces = None
        if self.local[r_from]:
            pieces = []
            for v in values:
                have = {shard.device: shard.data for shard in v.addressable_shards}
                pieces += [have[source] for source, _ in pairs]
        structs = [
            jax.ShapeDtypeStruct((1,) + tuple(a.shape), a.dtype, sharding=SingleDeviceSharding(d))
            for a in avals
            for _, d in pairs
        ]
        moved = self.courier.move(pieces, r_from, r_to, key, structs)
        if moved is None:
            return None
        n = len(pairs)
        return [
            _assemble(
                (self.n_dev[r_to],) + tuple(a.shape),
                self.rank_every[r_to],
                {d: p for (_, d), p in zip(pairs, moved[i * n : (i + 1) * n], strict=True)},
            )
            for i, a in enumerate(avals)
        ]

    def _regrouping(self, r_from: int, r_to: int) -> list[tuple]:
        """``(sender's device, receiver's device)`` for each device of rank `r_to`, in order.

        The sender's device with the receiver's data and fsdp coordinates and
        the first index of every other axis: the value is the same on each
        device of the model axes, so any of them would do.
        """
        src, dst = self.meshes[r_from], self.meshes[r_to]
        batch = {dst.axis_names.index(a) for a in self.batch_axes}
        return [
            (
                src.devices[tuple(i if a in batch else 0 for a, i in enumerate(index))],
                dst.devices[index],
            )
            for index in np.ndindex(dst.devices.shape)
        ]

    def _loss_zero(self, r: int):
        shape = (self.n_dev[r],) + self.loss_shape
        return jax.device_put(jnp.zeros(shape, self.loss_dtype), self.rank_every[r])

    def _loss_sums(self, loss_acc: dict, key: int):
        """The last stage's loss sums on its first rank: each copy's (`loss_acc`, per local
        rank holding the last stage) sent there and added in rank order; None where that
        rank is another process's. Transfer ids from `key` on, one per copy."""
        first, *copies = self.stage_ranks[-1]
        total = loss_acc.get(first)
        shape = (self.n_dev[first],) + self.loss_shape
        struct = jax.ShapeDtypeStruct(shape, self.loss_dtype, sharding=self.rank_every[first])
        for j, r in enumerate(copies):
            moved = self.courier.move(
                [loss_acc[r]] if self.local[r] else None, r, first, key + j, [struct]
            )
            if moved is not None:
                (total,) = self._add([total], moved)
        return total

    def _summed_copies(self, acc: list, key: int) -> None:
        """Each replicated stage's gradient sums, added over its copies and the total put
        back in every copy's accumulators (`acc`, per rank, in place).

        The copies' sums go to the stage's first rank, are added there in rank
        order, and the total goes back to each copy, so the copies' gradients
        are equal to the bit. Transfer ids from `key` on, two per copy.
        """
        layout = self.layout
        for s, (first, *copies) in enumerate(self.stage_ranks):
            own = layout.stage_buckets(s)

            def structs(r, own=own):
                return [
                    jax.ShapeDtypeStruct(
                        (1,) + tuple(layout.buckets[b][0]),
                        layout.buckets[b][1],
                        sharding=self.rank_param_sharding[r][b],
                    )
                    for b in own
                ]

            for r in copies:
                held = [acc[r][b] for b in own] if self.local[r] else None
                moved = self.courier.move(held, r, first, key, structs(first))
                key += 1
                if moved is not None:
                    total = self._add([acc[first][b] for b in own], moved)
                    acc[first].update(zip(own, total, strict=True))
            for r in copies:
                held = [acc[first][b] for b in own] if self.local[first] else None
                back = self.courier.move(held, first, r, key, structs(r))
                key += 1
                if back is not None:
                    acc[r].update(zip(own, back, strict=True))

    def _replicated(self, x):
        """A scalar held on this process's devices as one array replicated over the whole mesh.

        Ranks with meshes of their own shapes have no whole mesh: there, the
        scalar as it is (on the last rank's devices).
        """
        if self.shaped:
            return x
        sharding = NamedSharding(self.mesh, P())
        if self.courier.single:
            return jax.device_put(x, sharding)
        copies = {d: jax.device_put(x, d) for d in sharding.addressable_devices}
        return _assemble((), sharding, copies)

    def _shared(self, value, key: int):
        """The last rank's scalar `value` in this process, on the devices of a rank here.

        Where the last rank is another process's, pulled onto this process's
        first rank.
        """
        last = self.stage_ranks[-1][0]
        mesh = self.meshes[self.local.index(True)]
        struct = jax.ShapeDtypeStruct((), self.loss_dtype, sharding=NamedSharding(mesh, P()))
        return self.courier.share(value, last, key, struct)

    def run(self, packed, batch, after_op: Callable | None = None):
        """One step: ``(loss, packed_grads)``, laid out as the SPMD lowering's.

        In a run of several processes every process calls it, each issuing
        the pieces of its own ranks and the transfers to and from them.
        `after_op(i)`, if given, is called after the i-th op of `order` is
        issued (for tests that watch memory as the step runs).
        """
        if not self.compiled:
            self.compile(packed, batch)
        start = time.perf_counter()
        self.courier.begin()
        here, last = self.local, self.stage_ranks[-1][0]
        # Each rank's accumulators are made just before its first weight
        # gradient (`accumulators_made`), not at the start: the rank waits for
        # its first output gradient then, so making them costs no time.
        step = _Step(
            rows=self._rank_rows(packed),
            batches=self._rank_batches(batch),
            acc=[None] * self.num_ranks,
            loss_acc={r: self._loss_zero(r) for r in self.stage_ranks[-1] if here[r]},
            ops=sum(here) + sum(here[r] for r in self.stage_ranks[-1]),
        )
        for i, (r, a) in enumerate(self.order):
            if not here[r]:  # another process's op: only what it sends here
                before = self.courier.transfers
                self._receive(step, i, r, a)
                step.ops += self.courier.transfers - before
                continue
            if i - 1 in self.cells:  # the backward half of a cell, issued with its forward
                if after_op is not None:
                    after_op(i)
                continue
            step.ops += 1
            if i in self.cells:
                self._issue_cell(step, i, r, a, self.order[i + 1][1])
            elif a.kind in ("F", "FC"):
                self._issue_forward(step, i, r, a)
            elif a.kind in ("W", "I", "B"):
                self._issue_backward(step, i, r, a)
            else:
                self._issue_memory_action(step, i, r, a)
            if after_op is not None:
                after_op(i)
        # Transfer ids past the op list's: the loss copies', the loss's and
        # the weight's shares, then the gradient copies'.
        end, P = len(self.order), jax.process_count()
        loss = weight = None
        loss_acc = self._loss_sums(step.loss_acc, end)
        if here[last]:
            loss, weight = self._end_loss(loss_acc)
        end += self.num_ranks
        loss = self._shared(loss, end)
        if self.weighted:
            weight = self._shared(weight, end + P)
        grads = self._finished_grads(step, packed, weight, end + 2 * P)
        self.last_run = {
            "host_ops": step.ops + 1,
            "transfers_between_processes": self.courier.transfers,
            "seconds": time.perf_counter() - start,
        }
        self.courier.settle((loss, grads))
        return self._replicated(loss), grads

    def _head(self, step: _Step, r: int, s: int, mb: int) -> tuple:
        """What every piece of stage `s` on rank `r` takes first: its own rows of the
        parameters, the rank's batch and the microbatch's index."""
        own_rows = {b: step.rows[r][b] for b in self.layout.stage_buckets(s)}
        return own_rows, step.batches[r], self._index[r][mb]

    def _own_acc(self, step: _Step, r: int, s: int) -> dict:
        """Stage `s`'s gradient accumulators on rank `r` (made at the rank's first use)."""
        if step.acc[r] is None:
            step.acc[r] = self._zeros[r]()
            step.ops += 1
        return {b: step.acc[r][b] for b in self.layout.stage_buckets(s)}

    def _receive(self, step: _Step, i: int, r: int, a) -> None:
        """Another process's op `i` (of rank `r`): what it sends to this process's ranks."""
        s, mb, here, rank_of, k = a.stage, a.microbatch, self.local, self.rank_of, self.kernels
        y = self._y_avals
        if a.kind in ("F", "FC") and s < self.num_stages - 1 and here[rank_of(s + 1, mb)]:
            step.x_in[(s + 1, mb)] = self._move(None, r, rank_of(s + 1, mb), i, y[s])
        elif a.kind in ("I", "B") and s > 0 and here[rank_of(s - 1, mb)]:
            step.g_in[(s - 1, mb)] = self._move(None, r, rank_of(s - 1, mb), i, y[s - 1])
        elif a.kind == "EVICT" and here[a.partner]:
            step.res[(s, mb)] = self._move(None, r, a.partner, i, k[s].res_avals)
        elif a.kind == "LOAD" and here[a.partner]:  # the partner sends them back
            self._move(step.res.pop((s, mb)), a.partner, r, i, k[s].res_avals)

    def _carry_in(self, carries: dict, r: int, s: int, mb: int) -> list:
        """The slice carry a slice's F takes: the slice before's, or zeros for a first slice."""
        if not self._n_carry[s]:
            return []
        if mb % self.slices == 0:
            return self._carry_zeros[s, r]()
        return carries.pop((s, mb - 1))

    def _carry_out(self, carries: dict, s: int, mb: int, leaves: list, keep: bool) -> list:
        """`leaves` (an F's outputs, an I's input gradients) without stage `s`'s slice
        carry (or its gradient) that ends them, which `carries` keeps where `keep`."""
        n = self._n_carry[s]
        if not n:
            return leaves
        if keep:
            carries[(s, mb)] = leaves[-n:]
        return leaves[:-n]

    def _carry_grad_in(self, step: _Step, r: int, s: int, mb: int) -> list:
        """The carry's gradient a slice's I takes: from the slice after's I, or zeros
        for a last slice (its carry reaches nothing)."""
        if not self._n_carry[s]:
            return []
        if mb % self.slices == self.slices - 1:
            return self._carry_zeros[s, r]()
        return step.carry_grad.pop((s, mb + 1))

    def _forward_args(self, step: _Step, r: int, a) -> tuple:
        """An F's or FC's arguments, its input taken from where it waits."""
        s, mb = a.stage, a.microbatch
        x = ([] if s == 0 else step.x_in.pop((s, mb))) + self._carry_in(step.carry, r, s, mb)
        if a.kind == "FC":
            step.inputs[(s, mb)] = x  # kept for its RECOMPUTE
        loss = (step.loss_acc[r],) if s == self.num_stages - 1 else ()
        return (*self._head(step, r, s, mb), x, *loss)

    def _forward_done(self, step: _Step, i: int, r: int, a, out) -> None:
        """An F's outputs ``(y, residuals[, loss sums])`` (an FC's: ``(y[, loss sums])``)
        kept, and y sent to the next stage's rank."""
        s, mb = a.stage, a.microbatch
        if a.kind == "F":
            step.res[(s, mb)] = out[1]
        # the carry kept for the next slice (a sequence's last slice's reaches nothing)
        y = self._carry_out(step.carry, s, mb, out[0], mb % self.slices < self.slices - 1)
        if s == self.num_stages - 1:
            step.loss_acc[r] = out[-1]
        else:
            to = self.rank_of(s + 1, mb)
            _keep(step.x_in, (s + 1, mb), self._move(y, r, to, i, self._y_avals[s]))
            step.ops += to != r

    def _issue_forward(self, step: _Step, i: int, r: int, a) -> None:
        """F: (y, residuals[, loss sums]); FC, the forward-only piece: (y[, loss sums])."""
        piece = self.compiled[a.stage, r][_PIECE_OF.get(a.kind, a.kind)]
        self._forward_done(step, i, r, a, piece(*self._forward_args(step, r, a)))

    def _backward_args(self, step: _Step, r: int, a) -> tuple:
        """An I's or B's arguments ``(head, residuals, output gradient[, accumulators])``."""
        s, mb = a.stage, a.microbatch
        g = [] if s == self.num_stages - 1 else step.g_in.pop((s, mb))
        g = g + self._carry_grad_in(step, r, s, mb)
        if a.kind == "I":  # its W reads the residuals too
            return (*self._head(step, r, s, mb), step.res[(s, mb)], g)
        own_acc = self._own_acc(step, r, s)
        return (*self._head(step, r, s, mb), step.res.pop((s, mb)), g, own_acc)

    def _backward_done(self, step: _Step, i: int, r: int, a, out) -> None:
        """An I's ``(dx, carry)`` (the carry kept for its W) or a B's ``(dx, accumulators)``;
        dx sent to the stage before."""
        s, mb = a.stage, a.microbatch
        dx, second = out
        # the carry's gradient kept for the slice before's I (a first slice has none)
        dx = self._carry_out(step.carry_grad, s, mb, dx, mb % self.slices > 0)
        if a.kind == "I":
            step.kept[(s, mb)] = second
        else:
            step.acc[r].update(second)
        del out, second  # dropped before the send, as the step's memory is counted
        if s > 0:
            to = self.rank_of(s - 1, mb)
            _keep(step.g_in, (s - 1, mb), self._move(dx, r, to, i, self._y_avals[s - 1]))
            step.ops += to != r

    def _issue_backward(self, step: _Step, i: int, r: int, a) -> None:
        """W into the accumulators; I (its carry kept for its W) or B, sending the input
        gradient to the stage before."""
        s, mb, exe = a.stage, a.microbatch, self.compiled[a.stage, r]
        if a.kind == "W":
            head, own_acc = self._head(step, r, s, mb), self._own_acc(step, r, s)
            kept = step.kept.pop((s, mb))
            step.acc[r].update(exe["W"](*head, step.res.pop((s, mb)), kept, own_acc))
            return
        args = self._backward_args(step, r, a)
        if a.kind == "I":
            out = exe["I"](*args)
        elif not self.fused_backward:  # a B as its I, then its W
            dx, carry = exe["I"](*args[:5])
            out = dx, exe["W"](*args[:4], carry, args[5])
            step.ops += 1
            del carry
        else:
            out = exe["B"](*args)
        del args
        self._backward_done(step, i, r, a, out)

    def _issue_cell(self, step: _Step, i: int, r: int, f, b) -> None:
        """An `Overlap` cell issued as one program (`_cell_piece`): its forward `f` is op
        `i`, its backward `b` op ``i + 1``."""
        program = self.compiled_cells[r, f.stage, b.stage, b.kind]
        f_args, b_args = self._forward_args(step, r, f), self._backward_args(step, r, b)
        f_out, b_out = program(*f_args, *b_args)
        del f_args, b_args
        self._forward_done(step, i, r, f, f_out)
        self._backward_done(step, i + 1, r, b, b_out)

    def _issue_memory_action(self, step: _Step, i: int, r: int, a) -> None:
        """RECOMPUTE, EVICT and LOAD, and the host copies (OFFLOAD_*, RELOAD_*)."""
        s, mb, res, avals = a.stage, a.microbatch, step.res, self.kernels[a.stage].res_avals
        if a.kind == "RECOMPUTE":
            res[(s, mb)] = self.compiled[s, r]["RECOMPUTE"](
                *self._head(step, r, s, mb), step.inputs.pop((s, mb))
            )
        elif a.kind == "EVICT":
            _keep(res, (s, mb), self._move(res.pop((s, mb)), r, a.partner, i, avals))
        elif a.kind == "LOAD":
            held = res.pop((s, mb)) if self.local[a.partner] else None
            res[(s, mb)] = self._move(held, a.partner, r, i, avals)
        elif a.kind == "OFFLOAD_START":  # the copy begins; the device copy stays
            step.host[(s, mb)] = [jax.device_put(v, self.rank_host[r]) for v in res[(s, mb)]]
        elif a.kind == "OFFLOAD_END":  # freed once the copy has read it
            del res[(s, mb)]
        elif a.kind == "RELOAD_START":
            res[(s, mb)] = [jax.device_put(v, self.rank_every[r]) for v in step.host.pop((s, mb))]
        # RELOAD_END: the reader waits for the copy as for any input

    def _finished_grads(self, step: _Step, packed, weight, key: int):
        """The accumulated gradients, summed over a replicated stage's copies
        (`_summed_copies`, transfer ids from `key` on), finished (averaged or
        weighted) and laid out as the parameters are: one dict per rank
        (``shaped``) or the packed buckets."""
        for r in range(self.num_ranks):
            if self.local[r] and step.acc[r] is None:  # a rank without a stage
                step.acc[r] = self._zeros[r]()
        self._summed_copies(step.acc, key)
        by_device: dict = {b: {} for b in self.layout.buckets}
        per_rank = []
        for r in range(self.num_ranks):
            if not self.local[r]:
                per_rank.append(None)
                continue
            w = self._ones[r] if not self.weighted else jax.device_put(weight, self._scalar[r])
            # Averaging over no batch axis, unweighted: the sums are the gradients.
            finished = step.acc[r] if self._finish[r] is None else self._finish[r](step.acc[r], w)
            step.ops += self._finish[r] is not None
            if self.shaped:
                per_rank.append(finished)
                continue
            finished = {**finished, **self._padding[r]()}
            for b, g in finished.items():
                by_device[b].update(_by_device([g]))
            step.ops += 2
        if self.shaped:
            return per_rank
        return {
            b: _assemble(packed[b].shape, self.full_param_sharding[b], by_device[b])
            for b in self.layout.buckets
        }

    def __call__(self, packed, batch):
        """`run`: called, the compiled per-rank step runs as a compiled SPMD step does."""
        return self.run(packed, batch)

    def loss(self, packed, batch):
        """The mean loss over microbatches: each rank's forwards in list order, keeping nothing."""
        if not self.compiled:
            self.compile(packed, batch)
        unready = [place for place, c in self.compiled.items() if "F_eval" not in c]
        if unready:  # the first evaluation: its forwards, compiled once
            made = self._compile_pieces([(s, r, "F_eval") for s, r in unready], batch)
            for s, r in unready:
                self.compiled[s, r]["F_eval"] = made[s, r, "F_eval"]
        self.courier.begin()
        S, y, here = self.num_stages, self._y_avals, self.local
        layout = self.layout
        rows, batches = self._rank_rows(packed), self._rank_batches(batch)
        last = self.stage_ranks[-1][0]
        loss_acc = {r: self._loss_zero(r) for r in self.stage_ranks[-1] if here[r]}
        x_in: dict = {}
        carries: dict = {}  # slice carries, from one slice's forward to the next's
        for i, (r, a) in enumerate(self.forward_order):
            s, mb = a.stage, a.microbatch
            to = self.rank_of(s + 1, mb) if s < S - 1 else None
            if not here[r]:
                if to is not None and here[to]:
                    x_in[(s + 1, mb)] = self._move(None, r, to, i, y[s])
                continue
            own_rows = {b: rows[r][b] for b in layout.stage_buckets(s)}
            head = (own_rows, batches[r], self._index[r][mb])
            x = ([] if s == 0 else x_in.pop((s, mb))) + self._carry_in(carries, r, s, mb)
            if s == S - 1:
                out, loss_acc[r] = self.compiled[s, r]["F_eval"](*head, x, loss_acc[r])
            else:
                (out,) = self.compiled[s, r]["F_eval"](*head, x)
            out = self._carry_out(carries, s, mb, out, mb % self.slices < self.slices - 1)
            if s < S - 1:
                _keep(x_in, (s + 1, mb), self._move(out, r, to, i, y[s]))
        end = len(self.forward_order)
        total = self._loss_sums(loss_acc, end)
        loss = self._end_loss(total)[0] if here[last] else None
        loss = self._shared(loss, end + self.num_ranks)
        self.courier.settle(loss)
        return self._replicated(loss)

    # -- memory --------------------------------------------------------------------

    def piece_working_bytes(self, s: int, kind: str, r: int | None = None) -> int:
        """What stage `s`'s piece allocates while it runs on rank `r` (by default the
        stage's first rank of this process): compiled temp and new outputs.

        A B issued as its I and its W (``fused_backward=False``) holds the
        larger of the I's and of the W's with the carry between them.
        """
        if kind in _PIECE_OF:
            kind = _PIECE_OF[kind]
            if kind is None:  # a transfer: its copy is counted where it lands
                return 0
        if kind == "B" and not self.fused_backward:
            k = self.kernels
            between = _per_device_bytes(k[s].carry_avals)  # and the dx it sent
            between += _per_device_bytes(self._y_avals[s - 1]) if s > 0 else 0
            return max(
                self.piece_working_bytes(s, "I", r), between + self.piece_working_bytes(s, "W", r)
            )
        if r is None:
            r = next(q for q in self.stage_ranks[s] if (s, q) in self.compiled)
        m = self.compiled[s, r][kind].memory_analysis()
        return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)

    def op_working_bytes(self, i: int) -> int:
        """What op `i` of `order` allocates while it runs (`piece_working_bytes`).

        A cell issued as one program: its program's, counted at its forward
        half (op `i`), and nothing at its backward half, which runs within it.
        """
        if i in self.cells:
            m = self.compiled_cells[self._cell_key(i)].memory_analysis()
            return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
        if i - 1 in self.cells:
            return 0
        r, a = self.order[i]
        return self.piece_working_bytes(a.stage, a.kind, r)

    def held_values(self) -> list[list[int]]:
        """Per op of `order`, per rank: bytes of live values on each of its devices after it.

        What `run` holds once the op is issued and its inputs dropped: the
        activations and gradients waiting for their consumer, the residuals
        (on their rank, or on the partner an EVICT sent them to, and not
        between an OFFLOAD_END and its RELOAD_START), the inputs an FC keeps
        for its RECOMPUTE, the I-to-W carries (per device: one device's block
        of each), a sliced schedule's slice carries and their gradients, and on each
        rank of the last stage the loss accumulator.
        """
        S, R, rank_of, k = self.num_stages, self.num_ranks, self.rank_of, self.kernels
        y = [_per_device_bytes(avals) for avals in self._y_avals]
        # A slice carry is kept from a slice's F to the next slice's (none after a
        # sequence's last), its gradient from a slice's I to the one before's.
        carry = [_per_device_bytes(jax.tree.leaves(kk.y[1])) if kk.slice_carried else 0 for kk in k]
        n = self.slices
        res = [_per_device_bytes(kk.res_avals) for kk in k]
        kept = [_per_device_bytes(kk.carry_avals) for kk in k]
        held = [0] * R
        for r in self.stage_ranks[-1]:
            held[r] = math.prod(self.loss_shape) * np.dtype(self.loss_dtype).itemsize
        out = []
        for r, a in self.order:
            s = a.stage
            x = y[s - 1] if s > 0 else 0  # the stage's input activation
            later = a.microbatch % n < n - 1  # a later slice of its sequence follows
            earlier = a.microbatch % n > 0
            if a.kind in ("F", "FC"):
                held[r] += (res[s] - x) if a.kind == "F" else 0  # an FC keeps its input
                held[r] += carry[s] * (later - earlier)
                if s < S - 1:
                    held[rank_of(s + 1, a.microbatch)] += y[s]
            elif a.kind == "RECOMPUTE":
                held[r] += res[s] - x
            elif a.kind in ("EVICT", "LOAD"):
                sign = 1 if a.kind == "EVICT" else -1
                held[r] -= sign * res[s]
                held[a.partner] += sign * res[s]
            elif a.kind in ("OFFLOAD_END", "RELOAD_START"):
                held[r] += res[s] if a.kind == "RELOAD_START" else -res[s]
            elif a.kind in ("OFFLOAD_START", "RELOAD_END"):
                pass  # the host copy is not device memory; a reload's end moves nothing
            elif a.kind == "W":
                held[r] -= res[s] + kept[s]
            else:
                held[r] -= y[s] if s < S - 1 else 0
                held[r] += kept[s] if a.kind == "I" else -res[s]
                held[r] += carry[s] * (earlier - later)
                if s > 0:
                    held[rank_of(s - 1, a.microbatch)] += y[s - 1]
            out.append(list(held))
        return out

    def accumulators_made(self) -> list[int]:
        """Per rank, the position in `order` of its first weight gradient (W or B).

        `run` makes the rank's gradient accumulators just before it (a rank
        with none: after the op list).
        """
        made = [len(self.order)] * self.num_ranks
        for i, (r, a) in reversed(list(enumerate(self.order))):
            if a.kind in ("W", "B"):
                made[r] = i - (i - 1 in self.cells)  # a cell's: before the whole cell
        return made

    def account(self) -> list[RankMemory | None]:
        """Each rank's `RankMemory`, from the op list and the compiled pieces (`compile` first).

        In a run of several processes, None for the ranks of other processes
        (whose pieces this process does not compile).
        """
        if not self.compiled:
            raise ValueError("compile the pieces first (RankPrograms.compile)")
        R = self.num_ranks

        def bucket_bytes(b, r):
            layout = self.layouts[r]
            return math.prod(layout.local_shape(b)) * np.dtype(layout.buckets[b][1]).itemsize

        # Packed rows hold every bucket (zeros where not the rank's); a rank's own dict, its own.
        params = [
            sum(
                bucket_bytes(b, r)
                for b in (self.rank_buckets[r] if self.shaped else self.layout.buckets)
            )
            for r in range(R)
        ]
        grads = [sum(bucket_bytes(b, r) for b in self.rank_buckets[r]) for r in range(R)]
        held = self.held_values()
        values = [max((h[r] for h in held), default=0) for r in range(R)]
        made = self.accumulators_made()
        peak = list(grads)  # at the step's end every rank holds its gradients
        for s, (first, *copies) in enumerate(self.stage_ranks):
            if copies:  # a copy's sums arrive on the first rank, and their total is made
                stage = sum(bucket_bytes(b, first) for b in self.layout.stage_buckets(s))
                peak[first] = max(peak[first], grads[first] + 2 * stage)
        largest = [0] * R
        before = [0] * R
        for i, ((r, _), after) in enumerate(zip(self.order, held, strict=True)):
            work = self.op_working_bytes(i) if self.local[r] else 0
            largest[r] = max(largest[r], work)
            acc = [grads[q] if i >= made[q] else 0 for q in range(R)]
            # While a piece runs its inputs are still held and its outputs being made.
            peak[r] = max(peak[r], acc[r] + before[r] + work)
            for q in range(R):
                peak[q] = max(peak[q], acc[q] + after[q])
            before = after
        return [
            RankMemory(params[r], grads[r], values[r], peak[r], largest[r])
            if self.local[r]
            else None
            for r in range(R)
        ]


def _refuse_evictions_across_shapes(schedule, meshes) -> None:
    """Refuses an EVICT to a partner whose mesh has another shape.

    A stage's output and input gradient are the same on every device of the
    model axes, so they move between meshes of different shapes (`_move`);
    residuals are each device's own block, so they do not.
    """
    shape = [m.devices.shape for m in meshes]
    for r, _, a in schedule.all_actions():
        if a.kind == "EVICT" and shape[r] != shape[a.partner]:
            raise ValueError(
                f"rank {r}'s {a} sends residuals to rank {a.partner}, whose mesh has another "
                f"shape ({dict(meshes[a.partner].shape)} against {dict(meshes[r].shape)}); "
                "residuals are each device's own block, so evict to a rank of the same shape"
            )


@dataclasses.dataclass
class _Step:
    """What one step (`RankPrograms.run`) holds while its ops are issued, keyed by
    ``(stage, microbatch)`` where a value is one microbatch's."""

    rows: list  # each local rank's rows of its own buckets
    batches: list  # each local rank's batch
    acc: list  # each rank's gradient accumulators (None until its first backward)
    loss_acc: dict  # per local rank of the last stage, its copy's loss sums
    ops: int  # host operations issued, for `last_run`
    x_in: dict = dataclasses.field(default_factory=dict)  # the activation a stage reads
    g_in: dict = dataclasses.field(default_factory=dict)  # the output gradient it reads
    res: dict = dataclasses.field(default_factory=dict)  # residuals (on its rank or partner)
    kept: dict = dataclasses.field(default_factory=dict)  # the carry an I made for its W
    inputs: dict = dataclasses.field(default_factory=dict)  # what an FC kept for its RECOMPUTE
    host: dict = dataclasses.field(default_factory=dict)  # residuals' copy in host memory
    carry: dict = dataclasses.field(default_factory=dict)  # a slice's carry, for the next
    carry_grad: dict = dataclasses.field(default_factory=dict)  # its gradient, for the one before


def _keep(values: dict, key, value) -> None:
    """``values[key] = value`` unless `value` is None (it went to another process)."""
    if value is not None:
        values[key] = value


def _host_sharding(mesh: Mesh, spec) -> NamedSharding:
    """`spec` on `mesh` in its devices' pinned host memory, or a clear refusal."""
    kinds = {m.kind for d in mesh.devices.flat for m in d.addressable_memories()}
    if "pinned_host" not in kinds:
        platform = mesh.devices.flat[0].platform
        raise ValueError(
            f"the schedule offloads residuals to the host, but the {platform} devices have no "
            f"pinned_host memory (they have {', '.join(sorted(kinds))}); drop the OFFLOAD and "
            "RELOAD actions (Schedule.without_memory_actions()) or run on a platform that has it"
        )
    return NamedSharding(mesh, spec, memory_kind="pinned_host")


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
        if not a.is_fully_addressable and a.is_fully_replicated and a.addressable_shards:
            # A copy in each process (`Pipeline.processes_sharding`): this process's.
            return jax.device_put(a.addressable_shards[0].data, sharding)
    return jax.device_put(a, sharding)


def _same_index(x, y, shape) -> bool:
    return all(sx.indices(n) == sy.indices(n) for sx, sy, n in zip(x, y, shape, strict=False))


def _refuse_copies_across_shapes(stage_ranks, meshes) -> None:
    """Refuses a replicated stage whose copies' ranks have meshes of different shapes.

    The copies' gradient sums are added on the first copy's rank, each
    device's block of its own, so the blocks must match.
    """
    for s, ranks in enumerate(stage_ranks):
        shapes = {meshes[r].devices.shape for r in ranks}
        if len(shapes) > 1:
            raise ValueError(
                f"stage {s} is replicated on ranks {', '.join(map(str, ranks))}, whose meshes "
                f"differ in shape ({', '.join(str(dict(meshes[r].shape)) for r in ranks)}); "
                "the copies' gradients are added block by block, so give a replicated "
                "stage's ranks meshes of one shape"
            )


def _refuse_pipe_index(kernels, axis_sizes: list[dict], pipe_axis: str) -> None:
    """Refuses a stage that reads ``lax.axis_index`` of the pipeline axis.

    Each rank runs on its own sub-mesh, whose ``pipe`` axis has one device,
    so the index would be 0 on every rank: silently wrong, so refused.
    `axis_sizes`: per stage, its rank's mesh's.
    """
    for s, k in enumerate(kernels):
        with axis_env(axis_sizes[s]):
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


class MpmdLowering(Lowering):
    """The per-rank lowering behind `jpipe.Pipeline` (``lowering="mpmd"``).

    Runs the step through `RankPrograms`, built once per batch shape. It is
    driven from the host, so it refuses traced arguments (it cannot sit
    inside `jax.jit`, `jax.grad` or `jax.vmap`), and it has no ``all_idle``
    form (that measures the SPMD program's conditionals).
    """

    kind = MPMD

    def __init__(self, pipeline, tick_layout: str):
        super().__init__(pipeline, tick_layout)
        self._programs: dict[tuple, RankPrograms] = {}

    # Figures only (ticks of the lock-step timeline), made when first asked:
    # this lowering runs the schedule's memory actions itself, so the plans
    # are of its compute.
    @functools.cached_property
    def tick_plan(self):
        return make_tick_plan(self.pipeline.schedule.without_memory_actions(), self.tick_layout)

    @functools.cached_property
    def forward_tick_plan(self):
        return make_forward_tick_plan(self.pipeline.schedule.without_memory_actions())

    def rank_programs(self, batch) -> RankPrograms:
        p = self.pipeline
        if p.layout is None:
            raise ValueError("pack parameters first with Pipeline.pack")
        p.check_batch(batch)
        key = p._key(batch)
        if key not in self._programs:
            self._programs[key] = RankPrograms(
                p.schedule,
                p.layout,
                p.mesh,
                p._kernels(batch),
                p.pipe_axis,
                p.data_axis,
                p.stage_to_rank,
                meshes=p.rank_meshes,
            )
        return self._programs[key]

    def _refuse_traced(self, packed, batch) -> None:
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((packed, batch))):
            raise ValueError(
                "the per-rank lowering (lowering='mpmd') runs from the host and cannot be "
                "traced: it cannot sit inside jax.jit, jax.grad or jax.vmap. Use "
                "lowering='spmd' for that"
            )

    def value_and_grad(self, packed, batch):
        self._refuse_traced(packed, batch)
        return self.rank_programs(batch).run(packed, batch)

    def loss(self, packed, batch):
        self._refuse_traced(packed, batch)
        return self.rank_programs(batch).loss(packed, batch)

    def compile(self, packed, batch) -> RankPrograms:
        programs = self.rank_programs(batch)
        programs.compile(packed, batch)
        return programs

    def compiled_memory(self, compiled: RankPrograms) -> tuple[int, int]:
        if not any(compiled.compiled):
            raise ValueError("nothing is compiled yet: call Pipeline.compile first")
        analyses = [
            c.memory_analysis() for pieces in compiled.compiled.values() for c in pieces.values()
        ] + [c.memory_analysis() for c in compiled.compiled_cells.values()]
        temp = max(a.temp_size_in_bytes for a in analyses)
        arguments = max(a.argument_size_in_bytes for a in analyses)
        return temp, arguments

    def stage_kernels(self, batch) -> list:
        return list(self.rank_programs(batch).kernels)
