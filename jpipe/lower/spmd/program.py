"""Lowering: a plan and its stage kernels become one SPMD program.

The program is a `jax.shard_map`, manual over every mesh axis (``pipe``;
``data`` and ``fsdp`` split the batch; ``fsdp`` is gathered around each piece;
``tensor`` is the stage functions' own collectives), around a `lax.scan` over
ticks. The scan reads one row of the program's table
per tick; on each rank the row says which pieces to run and where in the
buffers they read and write.

**Control.** A tick runs its pieces in the order F, I, W (so a packed tick
can run all three). An `Overlap` cell whose F and I the plan puts in one
tick (the packed layout does) runs as one branch of its own
(`plan_cells`, `_StepBuilder.run_cells`), the F and I conditionals idle
there. Stages whose pieces trace to the same program, with the
same shapes and the same parameter buckets (the blocks of a transformer, one
per rank), form one *class* and share one branch: the rank's own rows of the
buckets are the stage's parameters, whichever stage it is, so the program
holds each distinct stage once however deep the pipeline (`stage_classes`).
Two shapes of conditionals (`CONTROLS`), chosen by what the installed XLA
keeps in place (`switch_writes_in_place`, probed once per platform):

``"switch"``, 3 conditionals a tick: one `lax.switch` per piece kind, branch
0 idle (it passes the buffers through) and one branch per class, which runs
the piece and writes its buffer in place: F its residuals, I its carry, both
as wide as they are, W its weight gradients into its own stage's buckets.
The default where XLA updates a buffer in place through a switch whose
branches write it (jaxlib 0.12's XLA:CPU).

``"cond"``, ``2 classes + 2`` conditionals a tick (``3 classes`` with
several stages per rank; one more per class with an FC), for an XLA that
copies the buffer through such a switch (jaxlib 0.10's XLA:CPU copies it in
every writing branch, `python -m bench.xla_limits`) but not through a
two-way `cond` whose other branch passes it through:

- **F** and **I**: one two-way `lax.cond` per class (does this rank run
  that class's piece this tick?), whose branch runs the piece and writes
  its residuals, or its carry, into the buffer in place, as wide as they
  are.
- **W**: a two-way `cond` (does this rank run a W?) around a `lax.switch`
  over the classes, the `cond` adding the switch's weight gradients to the
  accumulator; on ranks with several stages a `cond` per class instead, each
  adding to its own stage's buckets only, as a switch would add zeros to the
  rank's other stages' buckets (8 to 10% of interleaved 1F1B's step on the
  compiler shape).

A switch that returns the value instead of writing it makes it exist twice
for a moment and makes every write as wide as the widest class's; for the
residuals, the largest values a step keeps, that cost 4 to 10% of the
per-device temp on GPT-2-small shapes (`docs/compiler-measurements.md`), so
under ``"cond"`` F and I pay a conditional per class to write in place.
(A single switch per kind whose write follows it would have fewer
conditionals, but an idle tick would then write back what the buffer holds,
which made the benchmark GPT's all-idle step several times slower;
``"switch"`` writes inside the branches instead.)
The io writes are selects, not branches, under both.
After the conditionals every rank takes part in the same collectives, one
`ppermute` per channel of the plan, outside any branch. What arrives, and
the outputs handed over on the same rank, are written to the io slots the
table names at the start of the next tick, before anything reads.

**Buffers**, none of which grows with the microbatches (see `jpipe.lower.spmd.ticks`):

- ``io``: activations and gradients waiting for their consumer, one slot per
  value, as wide as the widest activation;
- ``res``: residuals from each F kept for its backward, and ``carry``: what
  each I keeps for its W. These are sized in bytes, not slots: each rank's
  values are placed at row offsets by `jpipe.lower.spmd.ticks.pack_lifetimes` at their
  own stage's size, in one buffer of rows of `ROW` raw 32-bit words whatever
  their dtypes (`_Arena`), and every device allocates the largest rank's
  extent (in SPMD every device runs the same program), not the busiest
  rank's count times the widest stage;
- the gradient accumulator, laid out like the packed parameters.

**Memory actions** (`jpipe.lower.spmd.ticks.TickPlan`'s `moves` and ``f_mode``): an FC
runs a branch of its class that writes no residuals, a recompute the F's
own branch reading the FC's kept io slot; evictions and loads ride *lanes*,
one `ppermute` each every tick outside any branch (`move_lanes`), written
on arrival in a two-way `cond`; offloads and reloads copy rows to and from
a host buffer (`jax.memory.Space.Host`) in a `cond` per class. All copies
run at the start of their tick, before its pieces (docs/design.md, "Memory
actions in the SPMD program").

Values in the io buffer are flat, one vector per dtype (`jpipe.stage.pieces.FlatLayout`);
in the residual and carry buffers each leaf starts on a row of its own and
is written and read by itself.
Parameters arrive packed in buckets (`jpipe.stage.pack`): a rank's row of a bucket
is one of its own stages' arrays, which the stage's branch reshapes in place.

**Replicated stages** (Chimera, DualPipe): a stage's copies sit in the same
buckets on each rank that holds one, so its branch is the same program on
every copy. The tick plan places each ``(stage, microbatch)`` on its own
rank (`TickPlan.key_rank`), so a microbatch's values travel between the
ranks it runs on, on a channel per shift. After the scan, one masked `psum`
over ``pipe`` per replicated stage adds its copies' gradient sums
(`_StepBuilder.sum_copies`); the loss, summed over ``pipe`` already, takes
every copy's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jpipe.lower.spmd.ticks import COLUMNS, STAGE_COLUMNS, TickPlan, pack_lifetimes
from jpipe.schedule.actions import Overlap
from jpipe.stage.carry import carried, check_carry
from jpipe.stage.contract import check_stage_outputs
from jpipe.stage.manual import DeviceView
from jpipe.stage.pack import ParamLayout
from jpipe.stage.pieces import FlatLayout, StageKernels, WeightedLoss, loss_seed, merge_widths

ROW = 128
"""32-bit words per row of the value buffer: values are placed at row offsets,
so offsets stay small integers whatever the model's size, and a leaf wastes
less than a row."""


class Program(NamedTuple):
    """A lowered plan.

    Attributes:
      run: ``run(packed_params, batch_mb) -> (loss, packed_grads)``, pure and
        unjitted; `batch_mb` is the batch cut by `split_microbatches`.
      kernels: the stages' F, I and W pieces it runs.
      classes: the class of each stage: stages of one class share one branch.
      table: the integer table ``[ticks, ranks, columns]`` the program scans.
      arena_rows: ``{"res", "carry", "host"}``: each buffer's size in rows of
        `ROW` 32-bit words (every residual, I-to-W carry and offloaded
        residual a device keeps, whatever its dtype).
      control: ``"cond"`` or ``"switch"``, the shape of its conditionals
        (`CONTROLS`).
      lanes: the collectives that carry evicted and loaded residuals (`Lane`).
    """

    run: Callable
    kernels: tuple[StageKernels, ...]
    classes: tuple[int, ...] = ()
    table: np.ndarray | None = None
    arena_rows: dict | None = None
    control: str = "cond"
    lanes: tuple = ()

    ROW = ROW  # words per row of the value buffer


CONTROLS = ("auto", "cond", "switch")
"""How a tick branches (`build_step`'s `control`): ``"cond"``, a two-way
`lax.cond` around a switch over the stage classes for W, F and I a cond per
class (``2 classes + 2`` conditionals a tick); ``"switch"``, one `lax.switch`
per piece kind with an idle branch, every branch writing its buffer in place
(3 a tick); ``"auto"``, the switch where this XLA updates a buffer in place
through one (`switch_writes_in_place`), else the conds."""


@functools.cache
def switch_writes_in_place(platform: str) -> bool:
    """Whether XLA on `platform` updates a buffer in place through a multi-way switch.

    Compiles (does not run) a scan whose body writes a 2 MiB buffer through
    ``switch(identity, write, write)``, the shape the ``"switch"`` control
    has, and reads the compiled temp bytes: a copy of the buffer shows as
    temp at least its size. Measured (`python -m bench.xla_limits`,
    `docs/compiler-measurements.md`): jaxlib 0.10.2's XLA:CPU copies the
    buffer in each writing branch; 0.12's updates it in place.
    """
    rows = 4096
    device = jax.local_devices(backend=platform)[0]  # addressable in every process
    sharding = jax.sharding.SingleDeviceSharding(device)

    def writer(k):
        def write(buf, offset):
            value = jnp.full((k + 1, ROW), offset, buf.dtype)
            return lax.dynamic_update_slice_in_dim(buf, value, offset, 0)

        return write

    def run(buf, offsets):
        def tick(buf, offset):
            branch = jnp.clip(offset % 3, 0, 2)
            return lax.switch(branch, [lambda b, o: b, writer(0), writer(1)], buf, offset), None

        return lax.scan(tick, buf, offsets)[0]

    buffer = jax.ShapeDtypeStruct((rows, ROW), jnp.float32, sharding=sharding)
    offsets = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=sharding)
    compiled = jax.jit(run, donate_argnums=0).lower(buffer, offsets).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    return temp < rows * ROW * 4 // 2


def _resolve_control(control: str, mesh) -> str:
    if control not in CONTROLS:
        raise ValueError(f"control must be one of {CONTROLS}, got {control!r}")
    if control != "auto":
        return control
    platform = mesh.devices.flat[0].platform
    return "switch" if switch_writes_in_place(platform) else "cond"


def axis_env(axis_sizes: dict[str, int]):
    """Binds mesh axis names while tracing, so stage functions may name them in collectives.

    The program runs every piece inside a `jax.shard_map` manual over the
    whole mesh; tracing the pieces on their own, outside it, needs the axis
    names bound the same way (as ``jax.make_jaxpr(..., axis_env=)`` does).
    """
    from jax._src import core

    return core.extend_axis_env_nd(list(axis_sizes.items()))


def trace_kernels(
    stage_fns,
    layout: ParamLayout,
    microbatch_inputs,
    mesh,
    pipe_axis: str = "pipe",
    batch_axes: tuple[str, ...] = (),
    carries=None,
) -> list[StageKernels]:
    """Traces every stage's F, I and W, feeding each the previous one's output shape.

    Each stage is traced as one device of `mesh` sees it (`jpipe.stage.manual`;
    `mesh` and `layout` may also be lists, one per stage, for ranks whose
    meshes differ in shape):
    varying over `pipe_axis` and the `batch_axes` (``data``, ``fsdp``), each
    parameter over the model axes its spec splits it over, so that the
    stage's own collectives over the model axes (``tensor``) get JAX's
    gradients; a collective over `pipe_axis` is refused here.

    `carries`, for a sliced schedule: per stage, the shape structs of its
    slice carry, or None for a stage without one (`jpipe.stage.carry`).
    """
    kernels: list[StageKernels] = []
    x = None
    for s, fn in enumerate(stage_fns):
        # Per stage, where the stages' ranks have meshes of their own shapes (lists).
        m = mesh[s] if isinstance(mesh, (list, tuple)) else mesh
        lay = layout[s] if isinstance(layout, (list, tuple)) else layout
        carry = None if carries is None else carries[s]
        if carry is not None:
            fn, x = carried(fn, s), (x, carry)
        with axis_env(dict(m.shape)):
            view = DeviceView(m.abstract_mesh, pipe_axis, tuple(batch_axes), lay.stage_axes(s))
            k = StageKernels.trace(
                fn,
                lay.stage_avals(s),
                x,
                microbatch_inputs,
                view,
                name=f"stage {s}",
                carry_leaves=len(jax.tree.leaves(carry)),
            )
        if carry is not None:
            check_carry(s, carry, k.y[1])
            k = dataclasses.replace(k, slice_carried=True)
        kernels.append(k)
        x = k.out
    return kernels


def _signature(k: StageKernels) -> tuple:
    """What two stages must share to run as one branch: their pieces' programs and shapes."""

    def program(fn, *args):
        closed = jax.make_jaxpr(fn)(*args)
        consts = tuple(
            (np.asarray(c).shape, str(np.asarray(c).dtype), np.asarray(c).tobytes())
            for c in closed.consts
        )
        return str(closed.jaxpr), consts

    res = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in k.res_avals]
    carry = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in k.carry_avals]
    g = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(k.y)]
    return (
        program(k.forward, k.params, k.x, k.inputs),
        program(k.input_grad, k.params, k.inputs, res, g),
        program(k.weight_grad, k.params, k.inputs, res, carry),
        jax.tree.structure(k.x),
        jax.tree.structure(k.y),
    )


def stage_classes(kernels, layout: ParamLayout) -> tuple[int, ...]:
    """Groups stages that can share one branch; returns each stage's class, numbered from 0.

    Two stages share a class when their F, I and W trace to the same programs
    (same equations, shapes and constants), they read the same parameter
    buckets, and they are both first, both last, or both neither (the first
    reads no activation; the last starts the backward from the loss).
    """
    S = len(kernels)
    keys: dict = {}
    out = []
    for s, k in enumerate(kernels):
        key = (s == 0, s == S - 1, layout.trees[s], layout.leaves[s], _signature(k))
        out.append(keys.setdefault(key, len(keys)))
    return tuple(out)


def _rows(n: int) -> int:
    return -(-n // ROW)


WORD = np.dtype(np.uint32)
"""What the value buffer holds: every kept value as raw 32-bit words, whatever its dtypes."""


def _words_per(dt) -> tuple[int, np.dtype]:
    """How a dtype becomes words: ``(elements per word, the raw dtype bitcast on the way)``.

    Negative counts mean words per element (64-bit types: ``-2``). Booleans go
    through ``uint8``; floats and integers narrower than 32 bits are packed,
    2 or 4 to a word, as raw bits. (A bfloat16 buffer was costly on XLA:CPU
    in jaxlib 0.10: it computed a `dynamic_update_slice` into it in float32,
    a loop that converted every element of the whole buffer there and back
    for each write, where a write of raw words touches only its own rows.)
    """
    dt = np.dtype(dt)
    if dt == np.bool_:
        return 4, np.dtype(np.uint8)
    size = dt.itemsize
    if size >= 4:
        return -(size // 4), dt
    return 4 // size, np.dtype({1: np.uint8, 2: np.uint16}[size])


def _leaf_rows(shape, dt) -> int:
    n = math.prod(shape)
    per, _ = _words_per(dt)
    words = n * -per if per < 0 else -(-n // per)
    return _rows(words)


def _value_rows(layout: FlatLayout) -> tuple[int, list[int]]:
    """A value's rows in the buffer: ``(rows, [row of each leaf])``.

    Each leaf starts on a row of its own, so it is written and read by itself
    (one `dynamic_update_slice` or `dynamic_slice` per leaf): no concatenation
    of the leaves, and no copy of the whole value, exists on the way.
    """
    rows, at = 0, []
    for shape, dt in zip(layout.shapes, layout.dtypes):
        at.append(rows)
        rows += _leaf_rows(shape, dt)
    return rows, at


def _as_rows(leaf):
    """`leaf` as ``[rows, ROW]`` words, zero-padded to a row (`_words_per`)."""
    per, raw = _words_per(leaf.dtype)
    flat = jnp.ravel(leaf)
    if flat.dtype == np.bool_:
        flat = flat.astype(raw)
    elif flat.dtype != raw:
        flat = lax.bitcast_convert_type(flat, raw)
    if per > 1:  # several elements to a word
        pad = -flat.shape[0] % (per * ROW)
        if pad:
            flat = jnp.concatenate([flat, jnp.zeros((pad,), raw)])
        flat = lax.bitcast_convert_type(flat.reshape(-1, per), WORD)
    else:  # one word per element, or several words to one
        flat = lax.bitcast_convert_type(flat, WORD).reshape(-1)
        pad = -flat.shape[0] % ROW
        if pad:
            flat = jnp.concatenate([flat, jnp.zeros((pad,), WORD)])
    return flat.reshape(-1, ROW)


def _from_rows(rows, shape, dt):
    """The inverse of `_as_rows`: a leaf of `shape` and `dt` from its ``[rows, ROW]`` words."""
    n = math.prod(shape)
    dt = np.dtype(dt)
    per, raw = _words_per(dt)
    flat = rows.reshape(-1)
    if per > 1:
        flat = lax.bitcast_convert_type(flat, raw).reshape(-1)[:n]
    elif per < 0:
        flat = lax.bitcast_convert_type(flat[: n * -per].reshape(n, -per), raw)
    else:
        flat = lax.bitcast_convert_type(flat[:n], raw)
    if dt == np.bool_:
        return (flat != 0).reshape(shape)
    if raw != dt:
        flat = lax.bitcast_convert_type(flat, dt)
    return flat.reshape(shape)


class _Arena:
    """A value buffer: ``[rows, ROW]`` words per device, and where each value sits in it.

    The residuals live in one such buffer, the I-to-W carries in another,
    the offloaded residuals in a third (in host memory where the platform
    has it), each of raw 32-bit words (`WORD`) so that values of every dtype
    share its rows: each rank's values are placed by `pack_lifetimes` at
    their own sizes, and the buffer is the largest rank's extent of all its
    values together. (A buffer per dtype made every device allocate the sum
    over dtypes of the largest rank's extent of each: on GPT-2-small's ZB-H1
    at 8 ranks the head's rank keeps the most float32 residuals, the middle
    ranks the most bfloat16 ones, 2.1 GiB more than any one rank's values.)
    Residuals and carries in one buffer would need less where the ranks
    keeping the most of each differ (ZB-V: 0.6 GiB on GPT-2-small shapes),
    but an I reads residuals and writes its carry in one branch, and with
    both in one buffer XLA copied the whole buffer: in float32 models even
    with the write ordered after every read, in bfloat16 ones where a read
    fed nothing but the input gradient.

    A value's leaves each start on a row (`_value_rows`) and are written and
    read one by one, as raw bits, inside the branch of the piece that makes
    or reads them, as wide as they are.
    """

    def __init__(self, plan: TickPlan, layouts: dict):
        """Places `plan`'s values: ``layouts[kind][stage]`` is each kind's `FlatLayout`."""
        self.value_rows = {
            kind: [_value_rows(lay)[0] for lay in lays] for kind, lays in layouts.items()
        }
        self.leaf_rows = {
            kind: [_value_rows(lay)[1] for lay in lays] for kind, lays in layouts.items()
        }
        self.offset: dict = {}  # (kind, stage, microbatch[, j]) -> row
        self.rows = 0
        for r in range(plan.num_ranks):
            intervals = [
                (start, end, (kind, *key))
                for kind in layouts
                for start, end, key in (plan.lifetimes.get(kind) or [()] * plan.num_ranks)[r]
            ]
            extent, offsets = pack_lifetimes(intervals, lambda key: self.value_rows[key[0]][key[1]])
            self.rows = max(self.rows, extent)
            self.offset.update(offsets)

    def zeros(self):
        return jnp.zeros((self.rows, ROW), WORD)

    def write_value(self, buf, kind: str, stage: int, leaves, offset):
        """Writes `leaves` at `offset`, each by itself, as wide as they are."""
        if not self.rows:  # a forward-only program keeps nothing
            return buf
        for leaf, row in zip(leaves, self.leaf_rows[kind][stage]):
            if leaf.size:
                # Every slice here is `_in_dim`: its other start index is a zero
                # of the offset's own dtype, where a literal 0 is int64 under
                # jax_enable_x64 and XLA refuses mixed index types.
                buf = lax.dynamic_update_slice_in_dim(buf, _as_rows(leaf), offset + row, 0)
        return buf

    def load(self, buf, kind: str, stage: int, layout: FlatLayout, offset) -> list:
        """Reads a value's leaves back, each by its own `dynamic_slice`."""
        out = []
        for shape, dt, row in zip(layout.shapes, layout.dtypes, self.leaf_rows[kind][stage]):
            if not math.prod(shape):
                out.append(jnp.zeros(shape, dt))
                continue
            rows = lax.dynamic_slice_in_dim(buf, offset + row, _leaf_rows(shape, dt), 0)
            out.append(_from_rows(rows, shape, dt))
        return out


class Lane(NamedTuple):
    """One collective that carries evicted and loaded residuals between ranks, every tick.

    Attributes:
      stage_class: the class of the stages whose residuals it carries (all
        as wide: `rows`).
      perm: its ``(sender, receiver)`` pairs, each rank at most once on each
        side (a `lax.ppermute` permutation).
      rows: the rows of the buffer it moves.
    """

    stage_class: int
    perm: tuple[tuple[int, int], ...]
    rows: int


def move_lanes(plan: TickPlan, classes, value_rows) -> tuple[tuple[Lane, ...], dict]:
    """Groups the plan's evictions and loads into lanes: ``(lanes, {move: lane index})``.

    A lane carries residuals of one stage class, along a fixed permutation
    of ranks, at most one value per sender a tick. Each move takes the first
    lane of its class that has its pair, or can take it (neither rank
    already in the permutation on that side), and is free in its tick; else
    a new lane. BPipe's pairs (rank r and R - 1 - r, both ways) make one
    lane per class.
    """
    lanes: list[dict] = []  # {"c": class, "perm": {src: dst}, "busy": set of ticks}
    index = {}
    for move in plan.moves:
        if move.kind not in ("EVICT", "LOAD"):
            continue
        c = classes[move.stage]

        def fits(lane, move=move, c=c):
            perm = lane["perm"]
            pair = perm.get(move.src) == move.dst or (
                move.src not in perm and move.dst not in perm.values()
            )
            return lane["c"] == c and pair and move.tick not in lane["busy"]

        i = next((i for i, lane in enumerate(lanes) if fits(lane)), len(lanes))
        if i == len(lanes):
            lanes.append({"c": c, "perm": {}, "busy": set()})
        lanes[i]["perm"][move.src] = move.dst
        lanes[i]["busy"].add(move.tick)
        index[move] = i
    out = tuple(
        Lane(lane["c"], tuple(sorted(lane["perm"].items())), value_rows[classes.index(lane["c"])])
        for lane in lanes
    )
    return out, index


def plan_cells(plan: TickPlan) -> dict[tuple[int, int], tuple[int, int]]:
    """The `Overlap` cells whose two halves the plan puts in one tick on their rank.

    ``{(tick, rank): (forward's stage, backward's stage)}``, for the program
    to run each as one branch (`_StepBuilder.run_cells`). The packed
    tick layout puts a cell's forward and its backward's I in one tick; the
    unit layout never does. A cell whose backward is of its own forward's
    stage and microbatch is left out: its I reads what its F writes.
    """
    tick = {(piece.kind, piece.stage, piece.microbatch): (t, r) for t, r, piece in plan.pieces()}
    out = {}
    for row in plan.schedule.ranks:
        for step in row:
            if not isinstance(step, Overlap):
                continue
            f, b = step.forward, step.backward
            at = tick.get(("F", f.stage, f.microbatch))
            if at is not None and at == tick.get(("I", b.stage, b.microbatch)) and f.key != b.key:
                out[at] = (f.stage, b.stage)
    return out


def cell_classes(cells: dict, classes) -> tuple[tuple[int, int], ...]:
    """The distinct ``(F's class, I's class)`` of `cells` (`plan_cells`), in order: one
    branch each."""
    return tuple(sorted({(classes[sf], classes[sb]) for sf, sb in cells.values()}))


def program_table(
    plan: TickPlan,
    classes,
    arenas: dict,
    idle: bool = False,
    fc_classes: tuple = (),
    lanes=((), {}),
    cells: dict | None = None,
) -> tuple[np.ndarray, dict]:
    """The plan's table with each piece's branch and value buffer rows added.

    Returns the ``int32`` table and ``{column name: index}``. Beside
    `TickPlan.COLUMNS` and the channels' io slots, for each kind ``k`` in
    ``f, i, w``: ``k_branch`` (0: none; 1 + the stage's class; for an FC,
    1 + the number of classes + its class's place in `fc_classes`) and, for
    each value the piece reads or writes, its row in that value's buffer
    (``k_res_row``, ``k_carry_row``; `arenas` maps ``"res"``, ``"carry"``
    and ``"host"`` to their `_Arena`).

    The copies of memory actions (`TickPlan.moves`): for each of `lanes`
    (``(lanes, {move: lane})``, `move_lanes`), ``lane{i}_send`` (the row the
    sender reads), ``lane{i}_recv`` (the row the receiver writes) and
    ``lane{i}_on`` (1 where the receiver writes); for the host copies,
    ``host_class`` (0: none; 1 + the stage's class), ``host_reload`` (0: an
    offload, 1: a reload), ``host_res_row`` and ``host_row``.

    `cells` (`plan_cells`), where given: ``cell_branch`` (0: none; 1 + the
    place of the cell's ``(F class, I class)`` in `cell_classes` of the same
    cells), with ``f_branch`` and ``i_branch`` 0 there, the cell's branch
    running both.
    """
    base = plan.table(idle=idle).astype(np.int32)
    T, R, _ = base.shape
    col = {name: i for i, name in enumerate(COLUMNS)}
    extra: list[np.ndarray] = []
    names = dict(col)

    def add(name, values):
        names[name] = base.shape[2] + len(extra)
        extra.append(values)

    C = max(classes) + 1
    lookup = np.array((0,) + tuple(1 + c for c in classes), np.int32)
    fc_lookup = np.array(
        (0,) + tuple(1 + C + fc_classes.index(c) if c in fc_classes else 0 for c in classes),
        np.int32,
    )
    for kind in STAGE_COLUMNS:
        branch = lookup[base[:, :, col[kind]]]
        if kind == "f_stage":
            fc = base[:, :, col["f_mode"]] == TickPlan.F_MODES["FC"]
            branch = np.where(fc, fc_lookup[base[:, :, col[kind]]], branch)
        add(kind.replace("stage", "branch"), branch)
    modes = {v: k for k, v in TickPlan.F_MODES.items()}
    for value, kinds in (("res", "fiw"), ("carry", "iw")):
        for k in kinds:
            stage = base[:, :, col[f"{k}_stage"]] - 1
            mb = base[:, :, col[f"{k}_microbatch"]]
            values = np.zeros((T, R), np.int32)
            for t, r in zip(*np.nonzero(stage >= 0)):
                s, m = int(stage[t, r]), int(mb[t, r])
                piece = modes[int(base[t, r, col["f_mode"]])] if k == "f" else k.upper()
                key = plan.res_key.get((piece, s, m), (s, m)) if value == "res" else (s, m)
                values[t, r] = arenas[value].offset.get((value, *key), 0)
            add(f"{k}_{value}_row", values)
    if cells:
        pairs = cell_classes(cells, classes)
        branch = np.zeros((T, R), np.int32)
        for (t, r), (sf, sb) in cells.items():
            if not idle:
                branch[t, r] = 1 + pairs.index((classes[sf], classes[sb]))
                extra[names["f_branch"] - base.shape[2]][t, r] = 0
                extra[names["i_branch"] - base.shape[2]][t, r] = 0
        add("cell_branch", branch)
    if not plan.moves:
        return np.concatenate([base] + [v[:, :, None] for v in extra], axis=2), names
    lane_list, lane_of = lanes
    columns = {}
    for i in range(len(lane_list)):
        for what in ("send", "recv", "on"):
            columns[f"lane{i}_{what}"] = np.zeros((T, R), np.int32)
    for what in ("host_class", "host_reload", "host_res_row", "host_row"):
        columns[what] = np.zeros((T, R), np.int32)
    res, host = arenas["res"], arenas.get("host")
    for move in plan.moves:
        t, s, m = move.tick, move.stage, move.microbatch
        if idle:
            continue
        if move.kind in ("EVICT", "LOAD"):
            i = lane_of[move]
            columns[f"lane{i}_send"][t, move.src] = res.offset[("res", *move.src_key)]
            columns[f"lane{i}_recv"][t, move.dst] = res.offset[("res", *move.dst_key)]
            columns[f"lane{i}_on"][t, move.dst] = 1
            continue
        reload = move.kind == "RELOAD"
        device_key, host_key = (
            (move.dst_key, move.src_key) if reload else (move.src_key, move.dst_key)
        )
        columns["host_class"][t, move.src] = 1 + classes[s]
        columns["host_reload"][t, move.src] = int(reload)
        columns["host_res_row"][t, move.src] = res.offset[("res", *device_key)]
        columns["host_row"][t, move.src] = host.offset[("host", *host_key)]
    for name, values in columns.items():
        add(name, values)
    return np.concatenate([base] + [v[:, :, None] for v in extra], axis=2), names


def build_step(
    stage_fns,
    plan: TickPlan,
    layout: ParamLayout,
    mesh,
    microbatch_inputs,
    pipe_axis: str,
    data_axis: str | None = None,
    forward_only: bool = False,
    kernels: list[StageKernels] | None = None,
    idle: bool = False,
    control: str = "auto",
) -> Program:
    """Lowers a plan to a `Program`: ``run(packed_params, batch_mb) -> (loss, packed_grads)``.

    `batch_mb` is the batch cut into microbatches, ``[rows, M, ...]`` per leaf
    (`jpipe.lower.microbatch.split_microbatches`).

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
        (`jpipe.lower.spmd.ticks.make_forward_tick_plan`); the gradients come back as zeros.
      kernels: the stages' pieces from `trace_kernels`, if already traced.
      idle: run no piece in any tick (`TickPlan.table(idle=True)`), to measure
        the cost of the program's control alone; the results are zeros.
      control: the shape of each tick's conditionals, one of `CONTROLS`
        (default ``"auto"``: what this XLA keeps in place).
    """
    step = _StepBuilder(
        stage_fns,
        plan,
        layout,
        mesh,
        microbatch_inputs,
        pipe_axis,
        data_axis,
        forward_only,
        kernels,
        idle,
        control,
    )
    program = step.program()
    table = step.narrow_table()

    def run(packed, batch_mb):
        return program(packed, batch_mb, jnp.asarray(table))

    arena_rows = {"res": step.res.rows, "carry": step.carry.rows, "host": step.host.rows}
    return Program(
        run, tuple(step.kernels), step.classes, table, arena_rows, step.control, step.lanes[0]
    )


class _StepBuilder:
    """What `build_step` computes up front, and the parts of the program it traces.

    Built once per step: the kernels and their classes (`stage_classes`), the
    io widths, the value buffers (`_Arena`), the memory actions' lanes and
    host classes, the program's table and its columns. Its methods are the
    pieces of `per_rank`, the body of the `jax.shard_map`: the io reads and
    writes, each class's F, I and W branches, a tick's conditionals
    (`CONTROLS`), the memory actions' copies, the hand-overs between ranks,
    the tick itself, and the loss and gradients after the scan.
    """

    def __init__(
        self,
        stage_fns,
        plan: TickPlan,
        layout: ParamLayout,
        mesh,
        microbatch_inputs,
        pipe_axis: str,
        data_axis: str | None,
        forward_only: bool,
        kernels: list[StageKernels] | None,
        idle: bool,
        control: str,
    ):
        """Traces the kernels (unless given), groups them, and places the values (`build_step`)."""
        self.plan, self.layout, self.mesh = plan, layout, mesh
        self.pipe_axis, self.data_axis, self.forward_only = pipe_axis, data_axis, forward_only
        self.S = S = plan.schedule.num_stages
        self.M = plan.schedule.num_microbatches
        self.R = plan.num_ranks

        axis_sizes = dict(mesh.shape)
        if kernels is None:
            batch = tuple(a for a in (data_axis, layout.fsdp_axis) if a is not None)
            kernels = trace_kernels(stage_fns, layout, microbatch_inputs, mesh, pipe_axis, batch)
        check_stage_outputs(kernels)  # the rules both lowerings share, before anything lowers
        self.kernels = kernels
        last = kernels[-1]
        self.weighted = jax.tree.structure(last.out) == jax.tree.structure(WeightedLoss(0.0, 0.0))
        self.loss_leaves = jax.tree.leaves(last.out)
        self.loss_dtype = jnp.result_type(*(leaf.dtype for leaf in self.loss_leaves))
        # The loss accumulator: the sum of the microbatch losses, or of the
        # weighted losses' totals and weights.
        self.loss_zero = jnp.zeros((2,) if self.weighted else (), self.loss_dtype)

        with axis_env(axis_sizes):
            self.classes = classes = stage_classes(kernels, layout)
        self.members = [[s for s in range(S) if classes[s] == c] for c in range(max(classes) + 1)]
        self.io_widths = merge_widths(*(k.y_layout for k in kernels[:-1]))
        self.num_io = max(plan.num_io, 1)  # slots; a table entry of plan.num_io means "none"
        self.control = _resolve_control(control, mesh)
        # (A forward-only plan has no lifetimes: its buffers are empty.)
        # A buffer for the residuals and one for the I-to-W carries, each of
        # every dtype; every value written in place inside its own branch. The
        # pieces pass both on as one pair, ``buf = (residuals, carries)``.
        self.res = _Arena(plan, {"res": [k.res_layout for k in kernels]})
        self.carry = _Arena(plan, {"carry": [k.carry_layout for k in kernels]})
        # Memory actions: the classes with an FC (a branch that keeps nothing),
        # the lanes evictions and loads ride, the host buffer offloads go to.
        self.fc_classes = tuple(
            sorted({classes[s] for _, _, (k, s, _) in plan.pieces() if k == "FC"})
        )
        self.lanes = move_lanes(plan, classes, self.res.value_rows["res"])
        self.host = _Arena(plan, {"host": [k.res_layout for k in kernels]})
        self.host_classes = tuple(
            sorted({classes[m.stage] for m in plan.moves if m.kind in ("OFFLOAD", "RELOAD")})
        )
        self.buckets = layout.buckets
        arenas = {"res": self.res, "carry": self.carry, "host": self.host}
        # Overlap cells whose halves share a tick: one branch each (F, then I).
        self.cells = {} if forward_only else plan_cells(plan)
        self.cell_pairs = cell_classes(self.cells, classes)
        self.table, self.col = program_table(
            plan, classes, arenas, idle, self.fc_classes, self.lanes, self.cells
        )
        self.fsdp = layout.fsdp_axis
        self.local_zeros = {b: (layout.local_shape(b), dt) for b, (_, dt) in self.buckets.items()}

        # Branch c of each switch runs the pieces of class c (any member stands
        # for all: they trace to the same program and read the same buckets).
        self.classes_range = range(len(self.members))
        self.own = [set(layout.stage_buckets(self.members[c][0])) for c in self.classes_range]
        self.several_stages_per_rank = any(
            len(plan.schedule.stages_of(r)) > 1 for r in range(self.R)
        )
        # Each replicated stage's buckets, with the ranks that hold a copy: their
        # gradients are summed over the copies (`sum_copies`).
        self.copies = tuple(
            (ranks, layout.stage_buckets(s))
            for s, ranks in enumerate(layout.stage_ranks)
            if len(ranks) > 1
        )
        keeps = [(c, True) for c in self.classes_range] + [(c, False) for c in self.fc_classes]
        self.f_branches = [functools.partial(self.forward, c, keep) for c, keep in keeps]
        self.i_branches = [functools.partial(self.input_grad, c) for c in self.classes_range]
        self.w_branches = [functools.partial(self.weight_grad, c) for c in self.classes_range]
        self.channels = plan.channels
        self.num_writes = 2 + len(self.channels)  # F's and I's local hand-overs, then arrivals

        self.batch_axes = tuple(a for a in (data_axis, self.fsdp) if a is not None)
        self.loss_axes = (pipe_axis,) + self.batch_axes
        self.fsdp_size = mesh.shape[self.fsdp] if self.fsdp is not None else 1
        self.param_specs = {b: layout.spec(b, pipe_axis) for b in self.buckets}

    # -- io, batch and parameters -------------------------------------------

    def zero_send(self):
        """An io value of zeros, as wide as the io buffer's slots."""
        return {dt: jnp.zeros((n,), dt) for dt, n in self.io_widths.items()}

    def read_io(self, io, slot):
        """The value in io `slot` (clamped to the buffer)."""
        slot = jnp.minimum(slot, self.num_io - 1)
        return {dt: lax.dynamic_index_in_dim(buf, slot, 0, False) for dt, buf in io.items()}

    def write_io(self, io, slot, values):
        """Writes `values` to io `slot`; slot ``plan.num_io`` means none (a select, no branch)."""
        used = slot < self.plan.num_io
        slot = jnp.minimum(slot, self.num_io - 1)
        out = {}
        for dt, buf in io.items():
            old = lax.dynamic_index_in_dim(buf, slot, 0, False)
            new = jnp.where(used, values[dt], old)
            out[dt] = lax.dynamic_update_index_in_dim(buf, new, slot, 0)
        return out

    def inputs_of(self, batch_mb, mb):
        """Microbatch `mb`'s inputs, from the batch cut into microbatches."""
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, mb, 1, False), batch_mb)

    def gathered(self, flat, s):
        """Stage `s`'s rows of the buckets, gathered over ``fsdp`` where it splits them."""
        layout, out = self.layout, {}
        for b in layout.stage_buckets(s):
            d = layout.fsdp_dim(b)
            out[b] = (
                flat[b] if d is None else lax.all_gather(flat[b], self.fsdp, axis=d, tiled=True)
            )
        return out

    def scattered(self, b, g):
        """A weight gradient of bucket `b`, summed over ``fsdp`` and cut to this device's block."""
        g = g.reshape(self.layout.gathered_shape(b))
        d = self.layout.fsdp_dim(b)
        return g if d is None else lax.psum_scatter(g, self.fsdp, scatter_dimension=d, tiled=True)

    # -- the branches: one class's F, I and W --------------------------------

    def forward(self, c, keep, flat, batch_mb, io, buf, row):
        """Class `c`'s F, writing its residuals in place: ``(buf, send, loss_piece)``.

        Without `keep`, its FC: the forward keeping nothing. A recompute runs
        the F's branch: the table points its input at the FC's kept io slot,
        sends its output nowhere and drops its loss.
        """
        s = self.members[c][0]
        k, col, kernels = self.kernels[s], self.col, self.kernels
        x = None
        if s > 0:
            prev = kernels[s - 1]
            x = jax.tree.unflatten(
                prev.y_tree, prev.y_layout.unpack(self.read_io(io, row[col["f_in"]]))
            )
        inputs = self.inputs_of(batch_mb, row[col["f_microbatch"]])
        y, residuals = k.forward(self.layout.stage_params(s, self.gathered(flat, s)), x, inputs)
        if keep:
            res_buf = self.res.write_value(buf[0], "res", s, residuals, row[col["f_res_row"]])
            buf = (res_buf, buf[1])
        if s == self.S - 1:
            loss_dtype = self.loss_dtype
            loss_piece = jnp.stack([v.astype(loss_dtype) for v in y]) if self.weighted else y[0]
            return buf, self.zero_send(), loss_piece.astype(loss_dtype)
        return buf, k.y_layout.pack(y, self.io_widths), self.loss_zero

    def input_grad(self, c, flat, batch_mb, io, buf, row, residuals=None):
        """Class `c`'s I, writing its carry in place: ``(buf, send)``.

        Its residuals from the buffer, unless given (an `Overlap` cell's,
        read before its F writes, `run_cells`).
        """
        s, S = self.members[c][0], self.S
        k, col, kernels = self.kernels[s], self.col, self.kernels
        if residuals is None:
            residuals = self.res.load(buf[0], "res", s, k.res_layout, row[col["i_res_row"]])
        if s == S - 1 and self.weighted:
            # d(total) = 1 and d(weight) = 0: the step divides by the summed
            # weights once, at the end (the weight must not depend on the
            # parameters).
            g = [jnp.ones((), leaf.dtype) * (i == 0) for i, leaf in enumerate(self.loss_leaves)]
        elif s == S - 1:
            g = loss_seed(self.M, self.loss_dtype)
        else:
            g = k.y_layout.unpack(self.read_io(io, row[col["i_in"]]))
        inputs = self.inputs_of(batch_mb, row[col["i_microbatch"]])
        params = self.layout.stage_params(s, self.gathered(flat, s))
        dx, kept = k.input_grad(params, inputs, residuals, g)
        send = kernels[s - 1].y_layout.pack(dx, self.io_widths) if s > 0 else self.zero_send()
        at = row[col["i_carry_row"]]
        return (buf[0], self.carry.write_value(buf[1], "carry", s, kept, at)), send

    def weight_grad(self, c, flat, batch_mb, buf, row):
        """Class `c`'s W: its weight gradients, every local bucket (zeros where not its own)."""
        s = self.members[c][0]
        k, col = self.kernels[s], self.col
        names = self.layout.stage_buckets(s)
        residuals = self.res.load(buf[0], "res", s, k.res_layout, row[col["w_res_row"]])
        kept = self.carry.load(buf[1], "carry", s, k.carry_layout, row[col["w_carry_row"]])
        inputs = self.inputs_of(batch_mb, row[col["w_microbatch"]])
        params = self.layout.stage_params(s, self.gathered(flat, s))
        dp = dict(zip(names, k.weight_grad(params, inputs, residuals, kept)))
        return {
            b: self.scattered(b, dp[b]) if b in dp else jnp.zeros(sh, dt)
            for b, (sh, dt) in self.local_zeros.items()
        }

    # -- a tick's conditionals ------------------------------------------------

    def pieces_by_switch(self, flat, batch_mb, io, grads, buf, row, classes):
        """One switch per kind, branch 0 idle, every branch writing the buffer in place."""
        f_class, i_class, w_class = classes
        f_branches, i_branches, w_branches = self.f_branches, self.i_branches, self.w_branches
        zero_send, loss_zero, own = self.zero_send, self.loss_zero, self.own

        def forward_case(c):
            return lambda b: f_branches[c](flat, batch_mb, io, b, row)

        buf, send_f, loss_piece = lax.switch(
            f_class + 1,
            [lambda b: (b, zero_send(), loss_zero)]
            + [forward_case(c) for c in range(len(f_branches))],
            buf,
        )
        if self.forward_only:
            return grads, buf, send_f, zero_send(), loss_piece

        def input_case(c):
            return lambda b: i_branches[c](flat, batch_mb, io, b, row)

        buf, send_i = lax.switch(
            i_class + 1,
            [lambda b: (b, zero_send())] + [input_case(c) for c in self.classes_range],
            buf,
        )

        def weight_case(c):  # adds to its own stage's buckets only
            def add(grads):
                dp = w_branches[c](flat, batch_mb, buf, row)
                return {b: g + dp[b] if b in own[c] else g for b, g in grads.items()}

            return add

        grads = lax.switch(
            w_class + 1, [lambda g: g] + [weight_case(c) for c in self.classes_range], grads
        )
        return grads, buf, send_f, send_i, loss_piece

    def pieces_by_cond(self, flat, batch_mb, io, grads, buf, row, classes):
        """F and I: a cond per class; W: a cond around a switch (see the module docstring)."""
        f_class, i_class, w_class = classes
        f_branches, i_branches, w_branches = self.f_branches, self.i_branches, self.w_branches
        zero_send, own = self.zero_send, self.own
        # F: a cond per class (then per class with an FC), each writing its
        # residuals in place, as wide as they are.
        forward = (buf, zero_send(), self.loss_zero)
        for c in range(len(f_branches)):

            def run_forward(state, c=c):
                return f_branches[c](flat, batch_mb, io, state[0], row)

            forward = lax.cond(f_class == c, run_forward, lambda state: state, forward)
        buf, send_f, loss_piece = forward
        if self.forward_only:
            return grads, buf, send_f, zero_send(), loss_piece

        # I: a cond per class, each writing its carry in place.
        backward = (buf, zero_send())
        for c in self.classes_range:

            def run_input_grad(state, c=c):
                return i_branches[c](flat, batch_mb, io, state[0], row)

            backward = lax.cond(i_class == c, run_input_grad, lambda state: state, backward)
        buf, send_i = backward

        if self.several_stages_per_rank:
            # One cond per class, each adding to its own stage's
            # buckets only: the switch must give every branch the same
            # outputs, so it would add zeros to the buckets of the
            # rank's other stages (8% slower on the compiler shape).
            for c in self.classes_range:

                def add_weight_grad(grads, c=c):
                    dp = w_branches[c](flat, batch_mb, buf, row)
                    return {b: g + dp[b] if b in own[c] else g for b, g in grads.items()}

                grads = lax.cond(w_class == c, add_weight_grad, lambda g: g, grads)
        else:

            def weight_grad(grads):
                dp = lax.switch(w_class, w_branches, flat, batch_mb, buf, row)
                return {b: g + dp[b] for b, g in grads.items()}

            grads = lax.cond(w_class >= 0, weight_grad, lambda g: g, grads)
        return grads, buf, send_f, send_i, loss_piece

    def run_cells(self, flat, batch_mb, io, buf, row):
        """The tick's `Overlap` cell, if the rank runs one: ``(buf, send_f, send_i, loss_piece)``.

        One branch per kind of cell (`cell_pairs`), which runs the cell's F
        and its I; branch 0 is idle. Under ``"switch"`` control, one switch,
        and the I's residuals are read before the F writes its own (an
        `optimization_barrier` orders the read before the write; the rows
        differ, the F's value starting now and the I's still live), so
        neither half's compute waits on the other's and XLA may interleave
        them. Under ``"cond"``, a cond per kind of cell, as F and I each
        have, and the I reads the buffer the F wrote: an XLA that copies
        through switches (jaxlib 0.10's XLA:CPU) copied the whole residual
        buffer for the early read. Measured on `dualpipev`, 2 and 4 ranks,
        packed, the per-device temp against the program without cell
        branches: jaxlib 0.12.1 "switch" 1.004x and 0.993x (the I reading the
        buffer as the tick found it, with no barrier: 1.45x and 1.53x);
        0.12.1 "cond" 1.05x and 1.03x; 0.10.2 "cond" the same (the early
        read: 1.49x and 1.55x).
        """
        f_branches, i_branches = self.f_branches, self.i_branches
        apart = self.control == "switch"
        idle = (buf, self.zero_send(), self.zero_send(), self.loss_zero)
        which = row[self.col["cell_branch"]]

        def cell(pair):
            cf, ci = pair

            def run(state):
                b = state[0]
                if not apart:  # the I reads the buffer the F wrote
                    f_buf, send_f, loss_piece = f_branches[cf](flat, batch_mb, io, b, row)
                    i_buf, send_i = i_branches[ci](flat, batch_mb, io, f_buf, row)
                    return (f_buf[0], i_buf[1]), send_f, send_i, loss_piece
                # The I's residuals read first; the F writes into the buffer
                # only after that read (the barrier), so the F's and the I's
                # compute depend on nothing of each other.
                s = self.members[ci][0]
                at = row[self.col["i_res_row"]]
                res = self.res.load(b[0], "res", s, self.kernels[s].res_layout, at)
                res, after_read = lax.optimization_barrier((res, b[0]))
                after_read = (after_read, b[1])
                f_buf, send_f, loss_piece = f_branches[cf](flat, batch_mb, io, after_read, row)
                i_buf, send_i = self.input_grad(ci, flat, batch_mb, io, b, row, res)
                return (f_buf[0], i_buf[1]), send_f, send_i, loss_piece

            return run

        if self.control == "switch":
            return lax.switch(which, [lambda s: s] + [cell(p) for p in self.cell_pairs], idle)
        state = idle
        for j, pair in enumerate(self.cell_pairs):
            state = lax.cond(which == 1 + j, cell(pair), lambda s: s, state)
        return state

    # -- memory actions and hand-overs ---------------------------------------

    def move_residuals(self, buf, host_buf, row):
        """`move_residuals_in` on the residuals of the pair ``buf``."""
        res_buf, host_buf = self.move_residuals_in(buf[0], host_buf, row)
        return (res_buf, buf[1]), host_buf

    def move_residuals_in(self, buf, host_buf, row):
        """The tick's evictions, loads, offloads and reloads, before its pieces.

        Every lane's collective runs every tick, outside any branch; the
        receiver writes what arrived, and a host copy runs, in a two-way
        `cond` (in place). Each lane's send reads the buffer as the lanes
        before left it, so every read comes before the write it races.
        """
        col = self.col
        for i, lane in enumerate(self.lanes[0]):
            send = lax.dynamic_slice_in_dim(buf, row[col[f"lane{i}_send"]], lane.rows, 0)
            arrived = lax.ppermute(send, self.pipe_axis, lane.perm)

            def land(b, arrived=arrived, i=i):
                return lax.dynamic_update_slice_in_dim(b, arrived, row[col[f"lane{i}_recv"]], 0)

            buf = lax.cond(row[col[f"lane{i}_on"]] > 0, land, lambda b: b, buf)
        for c in self.host_classes:
            rows = self.res.value_rows["res"][self.members[c][0]]
            here = row[col["host_class"]] == 1 + c
            reload = row[col["host_reload"]] > 0

            # Each copy reads the other buffer as the copy before left it
            # (bound when defined): a read of an older version would keep
            # it alive beside the new one, and XLA would copy both buffers.
            def offload(h, rows=rows, buf=buf):
                v = lax.dynamic_slice_in_dim(buf, row[col["host_res_row"]], rows, 0)
                v = jax.device_put(v, jax.memory.Space.Host)
                return lax.dynamic_update_slice_in_dim(h, v, row[col["host_row"]], 0)

            host_buf = lax.cond(here & ~reload, offload, lambda h: h, host_buf)

            def bring_back(b, rows=rows, host_buf=host_buf):
                v = lax.dynamic_slice_in_dim(host_buf, row[col["host_row"]], rows, 0)
                v = jax.device_put(v, jax.memory.Space.Device)
                return lax.dynamic_update_slice_in_dim(b, v, row[col["host_res_row"]], 0)

            buf = lax.cond(here & reload, bring_back, lambda b: b, buf)
        return buf, host_buf

    def hand_over(self, row, send_f, send_i):
        """The io writes for the next tick: ``(slots, values)``, local outputs then arrivals.

        One collective per channel, every tick, outside any branch. A
        shared channel (unit layout: a rank sends at most one value a tick)
        carries whichever of the F and I outputs this rank made.
        """
        col = self.col
        slots = [row[col["f_local"]], row[col["i_local"]]]
        values = [send_f, send_i]
        if any(kind is None for kind, _ in self.channels):
            runs_f = row[col["f_stage"]] > 0
            either = {dt: jnp.where(runs_f, send_f[dt], send_i[dt]) for dt in send_f}
        sends = {"F": send_f, "I": send_i}
        for i, (kind, d) in enumerate(self.channels):
            value = either if kind is None else sends[kind]
            perm = [(j, (j + d) % self.R) for j in range(self.R)]
            arrived = {dt: lax.ppermute(value[dt], self.pipe_axis, perm) for dt in value}
            slots.append(row[len(COLUMNS) + i])
            values.append(arrived)
        return jnp.stack(slots), values

    # -- the tick, the scan and what follows it -------------------------------

    def initial_state(self):
        """The scan's carry before the first tick: ``(grads, loss, io, buf, host_buf, pending)``."""
        num_writes = self.num_writes
        return (
            {b: jnp.zeros(sh, dt) for b, (sh, dt) in self.local_zeros.items()},
            self.loss_zero,
            {dt: jnp.zeros((self.num_io, n), dt) for dt, n in self.io_widths.items()},
            (self.res.zeros(), self.carry.zeros()),
            # Offloaded residuals, in the host's memory (pinned_host) where
            # the platform has it (XLA:CPU keeps it with the rest).
            (
                jax.device_put(self.host.zeros(), jax.memory.Space.Host)
                if self.host_classes
                else None
            ),
            # The io writes of the tick before: (slot, value) for the local
            # hand-overs of F and I outputs and for each channel's arrival.
            (
                jnp.full((num_writes,), self.plan.num_io, jnp.int32),
                [self.zero_send() for _ in range(num_writes)],
            ),
        )

    def tick(self, flat, batch_mb, state, row):
        """One tick on one rank: the io writes, the memory actions, the pieces, the hand-overs."""
        grads, loss, io, buf, host_buf, (write_slots, write_values) = state
        col = self.col
        row = row.astype(jnp.int32)
        # The previous tick's io writes land first, before this tick reads
        # anything. (Writing them at the end of their own tick, as the
        # plan's phases put it, is equivalent, but XLA cannot then order
        # each write after every read of the same tick, and it copied the
        # whole io buffer three times a tick to be safe.)
        for k in range(self.num_writes):
            io = self.write_io(io, write_slots[k], write_values[k])
        if self.plan.moves:
            buf, host_buf = self.move_residuals(buf, host_buf, row)

        # Column `{kind}_branch` is 0 when no piece of that kind runs here,
        # else 1 + the stage's class.
        classes = tuple(row[col[f"{k}_branch"]] - 1 for k in "fiw")
        if self.cell_pairs:  # an Overlap cell's F and I, before the tick's W
            buf, *cell_out = self.run_cells(flat, batch_mb, io, buf, row)
        run_pieces = self.pieces_by_switch if self.control == "switch" else self.pieces_by_cond
        grads, buf, send_f, send_i, loss_piece = run_pieces(
            flat, batch_mb, io, grads, buf, row, classes
        )
        if self.cell_pairs:  # where the cell ran, the F and I conditionals did not
            on = row[col["cell_branch"]] > 0
            cell_f, cell_i, cell_loss = cell_out
            send_f = {dt: jnp.where(on, cell_f[dt], v) for dt, v in send_f.items()}
            send_i = {dt: jnp.where(on, cell_i[dt], v) for dt, v in send_i.items()}
            loss_piece = jnp.where(on, cell_loss, loss_piece)
        if self.fc_classes:  # a recompute's loss was counted by its FC
            loss_piece = jnp.where(
                row[col["f_mode"]] == TickPlan.F_MODES["R"], jnp.zeros_like(loss_piece), loss_piece
            )
        loss = loss + loss_piece
        pending = self.hand_over(row, send_f, send_i)
        return (grads, loss, io, buf, host_buf, pending), None

    def sum_copies(self, grads):
        """Each replicated stage's gradient sums, added over the ranks that hold a copy.

        One masked ``psum`` over ``pipe`` per stage: the ranks of its copies
        give their sums, the others zeros, and each copy takes the total, so
        every copy's gradient is the same.
        """
        if not self.copies:
            return grads
        rank = lax.axis_index(self.pipe_axis)
        grads = dict(grads)
        for ranks, buckets in self.copies:
            held = jnp.asarray(np.isin(np.arange(self.R), ranks))[rank]
            for b in buckets:
                mine = jnp.where(held, grads[b], jnp.zeros_like(grads[b]))
                total = lax.psum(mine, self.pipe_axis)
                grads[b] = jnp.where(held, total, grads[b])
        return grads

    def finish(self, loss, grads):
        """The step's loss and gradients from the scan's sums: reduced over the mesh, averaged
        (a replicated stage's summed over its copies first, `sum_copies`)."""
        layout, fsdp, data_axis = self.layout, self.fsdp, self.data_axis
        grads = self.sum_copies(grads)
        if fsdp is not None:
            # Summed over fsdp: the split buckets' by each reduce-scatter, the
            # others' (arrays nothing divides) here, once.
            grads = {
                b: g if layout.fsdp_dim(b) is not None else lax.psum(g, fsdp)
                for b, g in grads.items()
            }
        if self.weighted:
            # The weighted mean over every microbatch of every data shard,
            # divided once: sum(totals) / sum(weights), and the gradients of
            # the totals (seeded with 1) by the same sum of weights.
            loss_axes = self.loss_axes
            total, weight = lax.psum(loss[0], loss_axes), lax.psum(loss[1], loss_axes)
            loss = total / weight
            if data_axis is not None:
                grads = {b: lax.psum(g, data_axis) for b, g in grads.items()}
            grads = {b: (g / weight).astype(g.dtype) for b, g in grads.items()}
            return loss, {b: g[None] for b, g in grads.items()}
        loss = lax.psum(loss, self.pipe_axis) / self.M
        if self.batch_axes:
            loss = lax.pmean(loss, self.batch_axes)
        if data_axis is not None:
            grads = {b: lax.pmean(g, data_axis) for b, g in grads.items()}
        if fsdp is not None:
            grads = {b: (g / self.fsdp_size).astype(g.dtype) for b, g in grads.items()}
        return loss, {b: g[None] for b, g in grads.items()}

    def per_rank(self, packed, batch_mb, tab):
        """The program on one device: the scan over its column of the table, then `finish`."""
        flat = {b: v[0] for b, v in packed.items()}
        tab = tab[:, 0]
        state0 = self.initial_state()

        def tick(state, row):
            return self.tick(flat, batch_mb, state, row)

        (grads, loss, *_), _ = lax.scan(tick, state0, tab)
        return self.finish(loss, grads)

    def program(self):
        """`per_rank` as a `jax.shard_map` over the whole mesh: ``(packed, batch_mb, table)``."""
        # Manual over every axis of the mesh: `pipe`, `data` (`build_step`), `fsdp`
        # by the gathers and scatters around each piece, model axes (`tensor`) by
        # the stage functions' own collectives. Left to the partitioner, an axis
        # that splits the values kept in the flat buffers made XLA reshard them
        # with collective-permutes inside the branches, which deadlock when pipe
        # ranks take different branches.
        param_specs = self.param_specs
        return jax.shard_map(
            self.per_rank,
            mesh=self.mesh,
            in_specs=(param_specs, P(self.batch_axes or None), P(None, self.pipe_axis)),
            out_specs=(P(), param_specs),
            axis_names=set(self.mesh.axis_names),
            # The kernels are pre-traced jaxprs replayed with `jaxpr_as_fun`, which
            # does not insert the casts between values that vary over `pipe` and
            # values that do not; the program differentiates nothing across ranks,
            # so the check buys nothing here.
            check_vma=False,
        )

    def narrow_table(self) -> np.ndarray:
        """The table in the narrowest integer type that holds it."""
        table = self.table
        narrow = next(
            (t for t in (np.int8, np.int16) if table.size == 0 or table.max() <= np.iinfo(t).max),
            np.int32,
        )
        return table.astype(narrow)
