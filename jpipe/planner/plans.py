"""Planning for mixed devices: score a placement by simulating the schedule that will run.

A `ClusterPlan` says which device holds each pipeline rank in each
data-parallel replica, which layers each stage holds, the microbatch size, the
global batch and the schedule. `evaluate` predicts its step time and memory:

1. Per-stage costs. Each stage's forward, backward (and input/weight-gradient
   halves) are its profile layers summed on its rank's device at the plan's
   microbatch size and tensor-parallel degree (`Profile.layer_times`, which
   derives a missing degree from the profile's own entries). Where the profile
   has only the full backward, schedules that split it get half as ``I`` and
   half as ``W``.
2. Transfers. A stage's output (its last layer's output bytes for one
   sequence, times B) goes to the next stage over the link between their
   nodes, and the gradient of the same size comes back. Transfers are
   *blocking*, as in DeepSpeed's pipeline engine that Sailor's measured plans
   ran: NCCL's send and receive kernels occupy both GPUs, so the sender's
   action and the receiver's each last their compute plus the transfer.
   ``receiver_busy=False`` charges the sender only. Re-decided with the
   transfer bytes read right, on the published plans whose stages send
   (docs/planner-validation.md): both GPUs busy has the lower error there.
   Between stages of one tensor degree T the T devices of a group send their
   copies to their counterparts at once; between stages of different degrees
   (plans for the per-rank lowering) one device of the sending group sends a
   copy to each device of the receiving group, one after another, as that
   lowering regroups a value between ranks of different shapes: T_receiver
   transfers' time forward, T_sender's for the gradient back (`_cut_seconds`).
3. The schedule is built for the plan's ranks and microbatches
   (`get_schedule`, built-ins or the user's ``file.py:function``) and
   simulated once per data-parallel replica (replicas may hold different
   devices, so each has its own costs) by `jpipe.simulate`, with one `Costs`
   per rank: a stage replicated on several ranks (Chimera, DualPipe) runs each
   copy at its own rank's device, and a copy that sends across a boundary to
   several ranks is charged the slowest of those transfers. Once every copy
   has run its last backward, a replicated stage's gradients are summed over
   its ranks (a ring as in item 4, `Costs.sync`); copies must share one
   tensor degree (`_copies_across_degrees`).
4. After its last action (and its copies' sums) each rank all-reduces its
   stages' gradients with its replicas (a ring: ``2 (d - 1) / d * bytes /
   bandwidth`` over the slowest link between replicas; the ``T``
   tensor-parallel shards reduce in parallel over the node's links) and then
   runs the optimizer update (profile
   ``update`` times). The step ends when the last rank has updated:
   ``max over ranks of (latest replica finish + all-reduce + update)``.
5. Memory per device (`memory_footprint`), from the profile's runtime terms
   (`MemoryTerms`): a fixed overhead, ``bytes_per_param x`` the parameters
   one GPU of the rank holds at its T (every copy it holds), the simulator's
   peak of live residuals
   and carries on the rank (`jpipe.Sizes`: the profile's activation bytes at
   T, times B; for schedules that split the backward an ``I``'s carry is taken
   as large as the residuals, which overstates it rather than understates it)
   and the working memory of the running piece (``working_factor x`` one
   microbatch of the rank's largest stage). What a device holds of its rank's
   need is its lowering's byte model (`jpipe.lower.bytes`; the search reads the
   same one), handed the overhead and the tensor degree per rank as inputs.
   Two layouts (`LAYOUTS`):
   ``"mpmd"``, each device holding its own rank's need (what a runtime of
   one program per rank allocates, and what Sailor's runtime ran), and
   ``"spmd"``, what jpipe's one SPMD program allocates on *every* device: the
   largest rank's parameters, the largest rank's live values and the largest
   piece's working memory (docs/design.md), so the smallest device binds.
   Each device group has its own tensor degree, so the stages of a
   ``mpmd`` plan may differ in it (one mesh per rank); a ``spmd`` plan,
   one program on one mesh, keeps one degree (`ClusterPlan.check` refuses
   others). Under remat a stage also holds, once, the bytes of the block its
   backward re-runs (`Profile.recomputes`, in the ``working`` term).

`Evaluation.closed_form_seconds` is the formula the published heterogeneous planners (AMP,
Metis, Sailor, FlashFlex) use on the same inputs:
``(M - 1) max_s(t_s + c_s) + sum_s(t_s + c_s) + update + data-parallel sync``.

`plan` searches device orderings (types in contiguous blocks), tensor-,
data- and pipeline-parallel degrees, microbatch sizes and schedules; for each
shape it splits layers with the exact partitioner (`jpipe.planner.partition`, each
stage's memory under the plan's layout a hard limit), then simulates, and keeps
a plan only if every device's footprint under its layout fits the device's
usable memory less a margin (``memory_margin``, default 10%). Candidates are
visited in order of a lower bound (the busiest rank's work, which no schedule
beats), so the search stops simulating once no remaining candidate can enter
the best ``top``.

With ``tensor_per_stage`` (``mpmd`` only) each device type takes its own
tensor degree, from the divisors of its count that fit in its node: a product
of choices per type instead of one choice, some 16 times the shapes for three
types. That search stays tractable by bounding before it splits: each shape
(device order, degrees, data-parallel degree, B, schedule) is queued at a bound
that needs no split (`_shape_bound`: every layer on the rank where it is
cheapest, every stage boundary moving the smallest output), split only when it
reaches the front of the queue while it could still enter the top, then
queued again at the busiest rank's work with its transfers, all-reduce and
update (`_busy_bound`), and simulated when it reaches the front again. Shapes
whose parameters cannot fit whatever the split (`_parameters_fit`) are
skipped before it. Both bounds never exceed the simulated step, so the best
plans are the ones an exhaustive search would keep.

`plan` runs that search once per attention and remat choice of the model
(`jpipe.planner.choices`), as measured first, and keeps the first choice under
which a plan fits. Where none does it raises one `NoPlanFits`: the shape that
came closest (its binding device's need over what it may hold; for a shape no
split fits, the split that needs the least memory), with the bytes needed and
available, the profile's sequence length and the microbatch size.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import statistics
import time
from collections.abc import Sequence

from jpipe.lower.bytes import RankBytes
from jpipe.lower.interface import MPMD, SPMD
from jpipe.planner.choices import AUTO, MemoryChoice, choices_to_try, with_choice
from jpipe.planner.partition import (
    NoSplitFits,
    Partition,
    partition,
    proportional_partition,
    uniform_partition,
)
from jpipe.planner.profiles import Profile
from jpipe.runtime.jsonfile import read_json
from jpipe.schedule.actions import Schedule
from jpipe.schedule.registry import get_schedule
from jpipe.schedule.simulate import (
    Costs,
    Simulation,
    Sizes,
    _live_events,
    _timed,
    live_peaks,
    simulate,
)
from jpipe.schedule.validate import analyze
from jpipe.search.engine import StageFigures, layout_kind, runs_schedule, search_schedule

PLAN_FORMAT = "jpipe-plan/1"
LAYOUTS = ("spmd", "mpmd")
SEARCH = "search"  # the schedule SPEC that has `jpipe.search_schedule` pick one per shape
MEMORY_MARGIN = 0.10  # kept free on every device until validated on jpipe's own runs
# The planner's text gives bytes in one unit, GiB (2^30 bytes): the unit of the device
# names (an A100-40 holds 40 GiB), of jpipe.search and of the trainer's MiB.
GIB = 1024**3


def gib(nbytes: float) -> str:
    """``"37.3 GiB"``: bytes as the planner's text writes them."""
    return f"{nbytes / GIB:.3g} GiB"


def _renamed(layout) -> str:
    """What to write instead of a layout name of earlier versions, or ""."""
    if layout == "per_rank":
        return " (the per-rank lowering's layout is called 'mpmd' now, as the lowering is)"
    return ""


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """One tensor-parallel group: `tensor_parallel` GPUs of type `kind` on node `node`.

    `gpus_per_node` picks the measured links (Sailor keys links by it).
    """

    kind: str
    tensor_parallel: int = 1
    gpus_per_node: int = 1
    node: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """A placement to evaluate (see the module docstring).

    Attributes:
      ranks: ``ranks[r][d]`` is the device of pipeline rank ``r`` in
        data-parallel replica ``d``.
      stage_layers: the profile layers of each stage, in stage order.
      microbatch_size: B.
      global_batch: sequences per step over all replicas.
      schedule: a schedule SPEC (name or ``file.py:function``).
      num_chunks: stages per rank for the schedule; `None` for its default.
      memory_layout: ``"spmd"`` (jpipe's one program: every device holds the
        largest rank's memory) or ``"mpmd"`` (each its own); see `LAYOUTS`.

    Each `DeviceGroup` carries its own tensor degree, so stages may have different
    ones (`tensor_per_rank`); only the per-rank lowering runs that (one mesh per
    rank), so `check` refuses it under the ``spmd`` layout, whose one program has
    one mesh.
    """

    ranks: tuple[tuple[DeviceGroup, ...], ...]
    stage_layers: tuple[tuple[int, ...], ...]
    microbatch_size: int
    global_batch: int
    schedule: str = "1f1b"
    num_chunks: int | None = None
    memory_layout: str = "spmd"

    @property
    def pipe(self) -> int:
        return len(self.ranks)

    @property
    def data(self) -> int:
        return len(self.ranks[0])

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.microbatch_size * self.data)

    def check(self, num_layers: int) -> None:
        """Raises `ValueError` naming what is inconsistent."""
        if not self.ranks or any(len(r) != self.data for r in self.ranks):
            raise ValueError("every pipeline rank needs the same number of data-parallel replicas")
        if self.memory_layout not in LAYOUTS:
            raise ValueError(
                f"memory layout {self.memory_layout!r} is not one of {', '.join(LAYOUTS)}"
                + _renamed(self.memory_layout)
            )
        if not layout_kind(self.memory_layout).meshes_per_rank and not self.uniform_tensor:
            raise ValueError(
                f"the ranks have tensor degrees {list(self.tensor_per_rank)}, but the spmd "
                "layout's one program has one mesh, one tensor degree for every stage; plan "
                "per-stage degrees with the mpmd layout (--memory-layout mpmd), which "
                "lowering='mpmd' runs with one mesh per rank"
            )
        if self.microbatch_size < 1 or self.global_batch < 1:
            raise ValueError("the microbatch size and the global batch must be positive")
        if self.global_batch % (self.microbatch_size * self.data):
            raise ValueError(
                f"the global batch {self.global_batch} is not a multiple of microbatch size "
                f"{self.microbatch_size} x data-parallel degree {self.data}"
            )
        flat = [l for s in self.stage_layers for l in s]
        missing = sorted(set(range(num_layers)) - set(flat))
        if len(flat) < num_layers and sorted(flat) == list(range(len(flat))):
            gap = f"{missing[0]}..{missing[-1]}" if len(missing) > 1 else f"{missing[0]}"
            raise ValueError(
                f"the stages place {len(flat)} of the model's {num_layers} layers ({gap} missing)"
            )
        if flat != list(range(num_layers)):
            raise ValueError(
                f"the stages must hold layers 0..{num_layers - 1} once each, in order; got "
                f"{[list(s) for s in self.stage_layers]}"
            )

    def to_json(self) -> dict:
        return {
            "ranks": [[d.to_json() for d in r] for r in self.ranks],
            "stage_layers": [list(s) for s in self.stage_layers],
            "microbatch_size": self.microbatch_size,
            "global_batch": self.global_batch,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "num_chunks": self.num_chunks,
            "memory_layout": self.memory_layout,
            "mesh": self.mesh(),
        }

    def mesh(self) -> dict:
        """The plan file's ``mesh``: ``tensor`` is the largest degree (every rank's where
        they agree); where ranks differ, ``tensor_per_rank`` gives each its own."""
        mesh = {"pipe": self.pipe, "data": self.data, "tensor": self.tensor_parallel}
        if not self.uniform_tensor:
            mesh["tensor_per_rank"] = list(self.tensor_per_rank)
        return mesh

    @property
    def tensor_parallel(self) -> int:
        """The largest tensor degree of any device group (the one degree of a uniform plan)."""
        return max(d.tensor_parallel for r in self.ranks for d in r)

    @property
    def tensor_per_rank(self) -> tuple[int, ...]:
        """Each pipeline rank's tensor degree (the largest among its replicas)."""
        return tuple(max(d.tensor_parallel for d in row) for row in self.ranks)

    @property
    def uniform_tensor(self) -> bool:
        """Whether every device group has the same tensor degree."""
        return len({d.tensor_parallel for r in self.ranks for d in r}) == 1


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """One device's memory under a plan: what it has and what it will hold.

    Attributes:
      rank, replica: where it sits (pipeline rank, data-parallel replica).
      kind: its device type.
      memory_bytes: its memory (the profile's figure for the type; `None` if the
        profile does not give it).
      usable_bytes: what the runtime may allocate there (`MemoryTerms.usable_fraction`).
      footprint_bytes: what it holds under the plan's layout.
      parts: the footprint's terms: ``overhead``, ``parameters`` (weights,
        gradients, optimizer state, buffers), ``values`` (live residuals and
        carries) and ``working`` (the running piece's working memory).
    """

    rank: int
    replica: int
    kind: str
    memory_bytes: float | None
    usable_bytes: float | None
    footprint_bytes: float
    parts: dict[str, float]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MemoryFootprint:
    """Every device's footprint under both layouts (`memory_footprint`).

    ``layouts[name][r][d]`` is a `DeviceMemory` for rank ``r``, replica ``d``.
    """

    layouts: dict[str, tuple[tuple[DeviceMemory, ...], ...]]

    def devices(self, layout: str) -> list[DeviceMemory]:
        return [m for row in self.layouts[layout] for m in row]

    def max_bytes(self, layout: str) -> float:
        return max(m.footprint_bytes for m in self.devices(layout))

    def binding(self, layout: str, margin: float = 0.0) -> DeviceMemory:
        """The device with the least room left, as a share of what it may use (its usable
        memory less `margin`)."""

        def room(m):
            if m.usable_bytes is None:
                return math.inf
            usable = m.usable_bytes * (1 - margin)
            return (usable - m.footprint_bytes) / usable if usable > 0 else -math.inf

        known = [m for m in self.devices(layout) if m.usable_bytes is not None]
        if not known:
            return max(self.devices(layout), key=lambda m: m.footprint_bytes)
        return min(known, key=room)

    def fits(self, layout: str, margin: float = 0.0) -> bool:
        """Whether every device whose memory is known holds its footprint."""
        m = self.binding(layout, margin)
        return m.usable_bytes is None or m.footprint_bytes <= m.usable_bytes * (1 - margin)

    def why(self, layout: str, margin: float = 0.0) -> str:
        """One line: which device binds, its footprint and what it may use (in GiB)."""
        m = self.binding(layout, margin)
        parts = ", ".join(f"{k} {v / GIB:.3g}" for k, v in m.parts.items())
        if m.usable_bytes is None:
            return (
                f"memory ({layout} layout): rank {m.rank} replica {m.replica} ({m.kind}) holds "
                f"the most, {gib(m.footprint_bytes)} ({parts}); the profile does not "
                "give the devices' memory"
            )
        room = m.usable_bytes * (1 - margin)
        verdict = "fits" if m.footprint_bytes <= room else "does not fit"
        return (
            f"memory ({layout} layout): rank {m.rank} replica {m.replica} ({m.kind}) binds, "
            f"{gib(m.footprint_bytes)} ({parts}) of {gib(room)} usable "
            f"({gib(m.memory_bytes)} x {m.usable_bytes / m.memory_bytes:.2f} usable "
            f"x {1 - margin:.2f} margin): {verdict}"
        )


def _stage_params(profile: Profile, layers, tp: int) -> float:
    per_gpu = profile.params_per_gpu(tp)
    return sum(per_gpu[l] for l in layers)


def _stage_activations(profile: Profile, layers, mbs: int, tp: int) -> float:
    acts = profile.activations(mbs, tp)
    return sum(acts[l] for l in layers)


def _stage_recompute(profile: Profile, layers, mbs: int, tp: int) -> float:
    """What the stage's backward holds once while a layer re-runs its forward (remat):
    its largest layer's `Profile.recomputes`."""
    rec = profile.recomputes(mbs, tp)
    return max((rec[l] for l in layers), default=0.0)


def _stage_inputs(profile: Profile, stage_layers, mbs: int) -> list[float]:
    """What an FC of each stage keeps: its input, the output of the stage before (the
    first stage's input is the batch)."""
    outputs = profile.outputs(mbs)
    return [0.0] + [outputs[layers[-1]] for layers in stage_layers[:-1]]


def _values_sizes(
    schedule: Schedule, act: Sequence[float], inputs: Sequence[float] | None = None
) -> Sizes:
    # W needs the layer inputs: an I's carry is taken as large as the residuals (conservative)
    return Sizes(
        activation=list(act),
        carry=list(act) if schedule.splits_backward else 0.0,
        input=0.0 if inputs is None else list(inputs),
    )


def _values(
    schedule: Schedule, act: Sequence[float], inputs: Sequence[float] | None = None
) -> tuple[float, ...]:
    """Each rank's peak of live residuals and carries (`act` each stage's residual bytes
    per microbatch; `inputs` what an FC keeps). With memory actions (a built-in such as
    ``1f1b_recompute``, or one `jpipe.search_schedule` chose) the simulator counts them in
    time, with unit costs and free transfers (as the validator places them), what a rank
    holds for a partner included; without, in list order."""
    return live_peaks(schedule, _values_sizes(schedule, act, inputs))


def spmd_values(schedule: Schedule, act: Sequence[float]) -> float:
    """The live residuals and carries every device of an SPMD program holds, as its byte
    model counts them where no tick buffers are sized (the largest rank's peak), with
    `act` each stage's residual bytes per microbatch."""
    values = _values(schedule, act)
    zeros = (0.0,) * len(values)
    need = RankBytes(params=zeros, values=values, working=zeros)
    return SPMD.byte_model().device_bytes(need)[0].values


def memory_footprint(
    plan: ClusterPlan, profile: Profile, schedule: Schedule | None = None
) -> MemoryFootprint:
    """Every device's memory under `plan`, in both layouts (module docstring, item 5).

    What each device's rank needs comes from here (the profile's runtime terms at the
    device's tensor degree, the fixed overhead of its kind, the simulated peak of live
    values); what a device holds of it under a layout is the layout's lowering's byte
    model (`jpipe.lower.interface.LoweringKind.byte_model`), which the schedule search
    reads too. Needs no times: a rank's peak of live values depends only on its own
    actions' order, so this works where a profile has bytes but no times. For a
    ``mpmd`` plan whose ranks differ in tensor degree the ``spmd`` figures are
    what one program would hold if it could run it (it cannot: `ClusterPlan.check`).
    """
    plan.check(profile.num_layers)
    schedule = schedule or _schedule_for(plan)
    _refuse_slices(schedule)
    _check_placement(plan, schedule)
    need = _device_needs(plan, profile, schedule)
    devices = [(r, d) for r in range(plan.pipe) for d in range(plan.data)]
    terms = profile.memory_terms

    def device(r, d, held):
        g = plan.ranks[r][d]
        memory = profile.memory.get(g.kind)
        usable = None if memory is None else memory * terms.usable_fraction
        parts = {"overhead": held.overhead, "parameters": held.params, "values": held.values,
                 "working": held.working}  # fmt: skip
        return DeviceMemory(r, d, g.kind, memory, usable, held.total, parts)

    layouts = {}
    for layout in LAYOUTS:
        held = dict(zip(devices, layout_kind(layout).byte_model().device_bytes(need)))
        layouts[layout] = tuple(
            tuple(device(r, d, held[r, d]) for d in range(plan.data)) for r in range(plan.pipe)
        )
    return MemoryFootprint(layouts)


def _device_needs(plan: ClusterPlan, profile: Profile, schedule: Schedule) -> RankBytes:
    """What each device of `plan` needs, rank by rank and replica by replica (one entry
    each, rank-major): its fixed overhead at its kind and tensor degree, the runtime's
    bytes per parameter times the parameters one GPU of the rank holds at its degree,
    the rank's peak of live values in its replica (`_values`), and the working memory of
    its largest stage (``working_factor`` of its residuals, plus what a remat re-run
    holds). The replicas of one program may hold different devices, so each is its own
    entry; each rank holds its own stages' parameters (one mesh per rank), a copy of a
    replicated stage's on every rank that holds one (their residuals are sized at the
    first copy's device: `_check_placement` keeps copies on one tensor degree)."""
    terms = profile.memory_terms
    S = schedule.num_stages
    owner = list(schedule.stage_to_rank)
    mbs = plan.microbatch_size
    own = [[None] * plan.data for _ in range(plan.pipe)]
    for d in range(plan.data):
        dev = [plan.ranks[owner[s]][d] for s in range(S)]
        act = [
            _stage_activations(profile, layers, mbs, dev[s].tensor_parallel)
            for s, layers in enumerate(plan.stage_layers)
        ]
        rec = [
            _stage_recompute(profile, layers, mbs, dev[s].tensor_parallel)
            for s, layers in enumerate(plan.stage_layers)
        ]
        values = _values(schedule, act, _stage_inputs(profile, plan.stage_layers, mbs))
        for r in range(plan.pipe):
            stages = schedule.stages_of(r)
            tp = plan.ranks[r][d].tensor_parallel
            own[r][d] = (
                terms.overhead_for(plan.ranks[r][d].kind, tp),
                terms.bytes_per_param
                * sum(_stage_params(profile, plan.stage_layers[s], tp) for s in stages),
                values[r],
                max((terms.working_factor * act[s] + rec[s] for s in stages), default=0.0),
            )
    rows = [own[r][d] for r in range(plan.pipe) for d in range(plan.data)]
    overhead, params, values, working = (tuple(col) for col in zip(*rows))
    return RankBytes(params=params, values=values, working=working, overhead=overhead)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What `evaluate` predicts for a plan.

    Attributes:
      plan: the plan.
      step_seconds: predicted seconds per training step.
      pipeline_seconds: the slowest replica's simulated makespan.
      allreduce_seconds, update_seconds: per rank (slowest replica).
      memory: every device's footprint under both layouts.
      stage_seconds: per stage, F + B of one microbatch (slowest replica, with sends).
      transfer_seconds: per stage boundary, one send (slowest replica; between stages of
        different tensor degrees the longer of the activation and its gradient).
      closed_form_seconds: the closed-form formula on the same inputs.
      simulation: the slowest replica's simulation (for charts).
    """

    plan: ClusterPlan
    step_seconds: float
    pipeline_seconds: float
    allreduce_seconds: tuple[float, ...]
    update_seconds: tuple[float, ...]
    memory: MemoryFootprint
    stage_seconds: tuple[float, ...]
    transfer_seconds: tuple[float, ...]
    closed_form_seconds: float
    simulation: Simulation = dataclasses.field(repr=False, compare=False)

    @property
    def peak_bytes(self) -> tuple[tuple[float, ...], ...]:
        """Per rank, per replica: one device's footprint under the plan's layout."""
        rows = self.memory.layouts[self.plan.memory_layout]
        return tuple(tuple(m.footprint_bytes for m in row) for row in rows)

    @property
    def max_peak_bytes(self) -> float:
        return self.memory.max_bytes(self.plan.memory_layout)

    def summary(self, margin: float = MEMORY_MARGIN) -> dict:
        layout = self.plan.memory_layout
        return {
            **self.plan.to_json(),
            "predicted_seconds": self.step_seconds,
            "pipeline_seconds": self.pipeline_seconds,
            "allreduce_seconds": list(self.allreduce_seconds),
            "update_seconds": list(self.update_seconds),
            "predicted_max_mem_bytes": self.max_peak_bytes,
            "peak_bytes": [list(r) for r in self.peak_bytes],
            "devices": [m.to_json() for m in self.memory.devices(layout)],
            "memory_margin": margin,
            "stage_seconds": list(self.stage_seconds),
            "transfer_seconds": list(self.transfer_seconds),
            "closed_form_seconds": self.closed_form_seconds,
        }


def _link_seconds(profile: Profile, a: DeviceGroup, b: DeviceGroup, nbytes: float) -> float:
    if a.node == b.node:
        return profile.intra_link(a.kind, a.gpus_per_node).seconds(nbytes)
    link = profile.inter_link(a.kind, a.gpus_per_node, b.kind, b.gpus_per_node)
    return link.seconds(nbytes)


def _cut_seconds(
    profile: Profile, a: DeviceGroup, b: DeviceGroup, nbytes: float
) -> tuple[float, float]:
    """Seconds to move a stage's output of `nbytes` from its group `a` to the next
    stage's group `b`, and its gradient (as large) back: ``(forward, backward)``.

    Within a stage the value is the same on every device of the tensor group. Between
    groups of one degree each device sends its copy to its counterpart, all at once
    (one transfer's time). Between degrees the per-rank lowering gives each device of
    the receiving group the copy of one device of the sender (`Pipeline`'s regrouping
    between ranks of different shapes), so that device sends as many copies as the
    receiver has devices, one after another over its link.
    """
    c = _link_seconds(profile, a, b, nbytes)
    if a.tensor_parallel == b.tensor_parallel:
        return c, c
    return b.tensor_parallel * c, a.tensor_parallel * c


def _pair_sharing(ranks, a: int, b: int) -> list[int]:
    """``[replica]``: how many transfers from rank `a` to rank `b` cross the same pair of
    nodes at once. Replicas run in step, so when several send across the same two nodes
    they share that link's bandwidth (each transfer takes that many times longer)."""
    pairs = [(ranks[a][j].node, ranks[b][j].node) for j in range(len(ranks[0]))]
    return [pairs.count(p) if p[0] != p[1] else 1 for p in pairs]


def _sharing(ranks, owner) -> list[list[int]]:
    """``[boundary][replica]``: `_pair_sharing` across each stage boundary of `owner`."""
    return [_pair_sharing(ranks, owner[s], owner[s + 1]) for s in range(len(owner) - 1)]


def _allreduce_seconds(profile: Profile, group: Sequence[DeviceGroup], per_gpu: float) -> float:
    """Ring all-reduce among replicas of `per_gpu` gradient bytes, over the slowest link.

    Each of the T tensor-parallel shards has its own ring, all crossing the same
    pair of nodes, so the link carries T of them.
    """
    d = len(group)
    if d < 2 or per_gpu <= 0:
        return 0.0
    tp = max(x.tensor_parallel for x in group)
    slowest = max(
        _link_seconds(profile, a, b, per_gpu) * tp for a, b in itertools.combinations(group, 2)
    )
    return 2 * (d - 1) / d * slowest


def _schedule_for(plan: ClusterPlan) -> Schedule:
    schedule = get_schedule(plan.schedule, plan.pipe, plan.num_microbatches, plan.num_chunks)
    if schedule.num_ranks != plan.pipe:
        raise ValueError(
            f"schedule {plan.schedule!r} has {schedule.num_ranks} ranks, the plan {plan.pipe}"
        )
    return schedule


def _refuse_slices(schedule: Schedule) -> None:
    """The planner's profiles time whole sequences; a slice's share of a layer's time
    (causal attention grows with the tokens before it) is not in them yet."""
    if schedule.slices:
        raise ValueError(
            f"the planner does not plan sequence slices yet ({schedule.name or 'the schedule'}"
            f" cuts each sequence into {schedule.num_slices}): its profiles time whole "
            "sequences; jpipe.simulate takes the schedule with your own per-slice costs"
        )


def _copies_across_degrees(schedule: Schedule, ranks) -> str | None:
    """Why a replicated stage of `schedule` cannot sit on `ranks`, or `None`: its copies
    hold the same arrays, so the ranks that hold them must have one tensor degree (the
    per-rank lowering refuses copies across mesh shapes, and each copy's gradient sum
    adds shards of one shape)."""
    for s, holders in enumerate(schedule.stage_ranks):
        degrees = {r: max(g.tensor_parallel for g in ranks[r]) for r in holders}
        if len(set(degrees.values())) > 1:
            where = ", ".join(f"rank {r} tensor {t}" for r, t in degrees.items())
            return f"stage {s} is replicated on ranks of different tensor degrees ({where})"
    return None


def _check_placement(plan: ClusterPlan, schedule: Schedule) -> None:
    why_not = _copies_across_degrees(schedule, plan.ranks)
    if why_not:
        raise ValueError(f"the planner cannot place {plan.schedule!r} on this plan: {why_not}")


def _boundary_pairs(schedule: Schedule) -> list[tuple[tuple[int, int], ...]]:
    """Per stage boundary ``s`` -> ``s + 1``, the pairs of ranks ``(rank of (s, m), rank
    of (s + 1, m))`` its microbatches cross: one pair where each stage has one rank,
    one per direction in Chimera."""
    info = analyze(schedule)
    S, M, at = info.num_stages, info.num_microbatches, info.key_rank
    return [
        tuple(sorted({(at[s * M + m], at[(s + 1) * M + m]) for m in range(M)}))
        for s in range(S - 1)
    ]


def _microbatches_on(schedule: Schedule) -> list[list[int]]:
    """``[rank][stage]``: how many microbatches of the stage the rank runs (all of them
    on its one rank, where a stage is not replicated)."""
    info = analyze(schedule)
    S, M, at = info.num_stages, info.num_microbatches, info.key_rank
    count = [[0] * S for _ in range(len(info.rows))]
    for k, r in enumerate(at):
        count[r][k // M] += 1
    return count


@dataclasses.dataclass(frozen=True)
class _ReplicaCosts:
    """One data-parallel replica's costs, per place ``(rank, stage)`` (zeros where the
    rank does not hold the stage), blocking transfers folded in.

    Attributes:
      F, I, W, B: ``[rank][stage]`` seconds of one microbatch's action.
      update: per rank, its optimizer update over every stage it holds.
      sync: per stage, the ring all-reduce of a replicated stage's gradients over the
        ranks that hold its copies (0 for a stage on one rank).
      moved: per stage boundary, the longest single transfer across it.
      stage: per stage, F + B of one microbatch on its slowest copy.
    """

    F: list
    I: list
    W: list
    B: list
    update: list
    sync: list
    moved: list
    stage: list

    def costs(self) -> tuple[Costs, ...]:
        """One `Costs` per rank, for `simulate`."""
        sync = tuple(self.sync)
        return tuple(
            Costs(F=tuple(f), I=tuple(i), W=tuple(w), B=tuple(b), sync=sync)
            for f, i, w, b in zip(self.F, self.I, self.W, self.B, strict=True)
        )


def _replica_costs(
    profile: Profile, plan: ClusterPlan, schedule: Schedule, d: int, receiver_busy
) -> _ReplicaCosts:
    """Replica `d`'s costs on every place of `schedule` (`_ReplicaCosts`).

    Each copy of a stage computes at its own rank's device. A transfer blocks both
    ends (module docstring); where a copy sends across a boundary to several ranks (a
    schedule may place microbatches freely) it is charged the slowest of those pairs.
    """
    S, R, mbs = schedule.num_stages, plan.pipe, plan.microbatch_size
    outputs = profile.outputs(mbs)
    F, I, W, B = ([[0.0] * S for _ in range(R)] for _ in range(4))
    update = [0.0] * R
    for s, layers in enumerate(plan.stage_layers):
        for r in schedule.stage_ranks[s]:
            g = plan.ranks[r][d]
            t = profile.layer_times(g.kind, mbs, g.tensor_parallel)
            i_half, w_half = t.split()
            F[r][s] = sum(t.forward[l] for l in layers)
            B[r][s] = sum(t.backward[l] for l in layers)
            I[r][s] = sum(i_half[l] for l in layers)
            W[r][s] = sum(w_half[l] for l in layers)
            update[r] += sum(t.update[l] for l in layers)
    moved = [0.0] * max(S - 1, 0)
    for s, pairs in enumerate(_boundary_pairs(schedule)):
        nbytes = outputs[plan.stage_layers[s][-1]]
        send, take, back, got = {}, {}, {}, {}  # the most each end pays, per rank
        for a, b in pairs:
            if a == b:
                continue
            out, grad = _cut_seconds(profile, plan.ranks[a][d], plan.ranks[b][d], nbytes)
            share = _pair_sharing(plan.ranks, a, b)[d]
            out, grad = out * share, grad * share
            moved[s] = max(moved[s], out, grad)
            send[a] = max(send.get(a, 0.0), out)  # blocking send of the activation forward
            back[b] = max(back.get(b, 0.0), grad)  # and of the gradient back
            take[b] = max(take.get(b, 0.0), out)  # the receivers' side of the same
            got[a] = max(got.get(a, 0.0), grad)
        for a, x in send.items():
            F[a][s] += x
        for b, x in back.items():
            I[b][s + 1] += x
            B[b][s + 1] += x
        if receiver_busy:
            for b, x in take.items():
                F[b][s + 1] += x
            for a, x in got.items():
                I[a][s] += x
                B[a][s] += x
    stage = [max(F[r][s] + B[r][s] for r in schedule.stage_ranks[s]) for s in range(S)]
    sync = [0.0] * S
    for s, holders in enumerate(schedule.stage_ranks):
        if len(holders) > 1:
            group = [plan.ranks[r][d] for r in holders]
            grads = _stage_params(profile, plan.stage_layers[s], group[0].tensor_parallel)
            grads *= profile.memory_terms.gradient_bytes  # one GPU's shard
            sync[s] = _allreduce_seconds(profile, group, grads)
    return _ReplicaCosts(F, I, W, B, update, sync, moved, stage)


def _allreduce_per_rank(profile: Profile, plan: ClusterPlan, schedule: Schedule) -> list[float]:
    """Each rank's data-parallel all-reduce of its stages' gradients (module docstring),
    copies of replicated stages included."""
    allreduce = []
    for r in range(plan.pipe):
        tp = max(g.tensor_parallel for g in plan.ranks[r])
        params = sum(
            _stage_params(profile, plan.stage_layers[s], tp) for s in schedule.stages_of(r)
        )
        grads = params * profile.memory_terms.gradient_bytes  # one GPU's shard
        allreduce.append(_allreduce_seconds(profile, plan.ranks[r], grads))
    return allreduce


def _busy_bound(profile: Profile, plan: ClusterPlan, schedule: Schedule, receiver_busy) -> float:
    """A bound on `plan`'s step before simulating it: in every replica each rank runs
    the forward and backward (with their blocking transfers) of each microbatch it
    holds, one action at a time, then all-reduces and updates."""
    count = _microbatches_on(schedule)
    busy = [0.0] * plan.pipe
    updates = [0.0] * plan.pipe
    for d in range(plan.data):
        c = _replica_costs(profile, plan, schedule, d, receiver_busy)
        for r in range(plan.pipe):
            work = sum(
                n * (c.F[r][s] + min(c.B[r][s], c.I[r][s] + c.W[r][s]))  # what it may run
                for s, n in enumerate(count[r])
                if n
            )
            busy[r] = max(busy[r], work)
            updates[r] = max(updates[r], c.update[r])
    allreduce = _allreduce_per_rank(profile, plan, schedule)
    return max(busy[r] + allreduce[r] + updates[r] for r in range(plan.pipe))


def evaluate(
    plan: ClusterPlan,
    profile: Profile,
    schedule: Schedule | None = None,
    *,
    receiver_busy: bool = True,
) -> Evaluation:
    """Predicts `plan`'s step time and memory by simulating its schedule (module docstring).

    Args:
      plan: the placement.
      profile: the model's profile.
      schedule: the built schedule, if already at hand (else built from `plan`).
      receiver_busy: whether a transfer occupies the receiving rank as well as
        the sender (NCCL's send and receive kernels run on both GPUs, in the
        compute stream under DeepSpeed); `False` charges the sender only.
    """
    plan.check(profile.num_layers)
    schedule = schedule or _schedule_for(plan)
    _refuse_slices(schedule)
    S = schedule.num_stages
    if S != len(plan.stage_layers):
        raise ValueError(
            f"schedule {plan.schedule!r} has {S} stages but the plan splits layers into "
            f"{len(plan.stage_layers)}"
        )
    _check_placement(plan, schedule)
    finish = [[0.0] * plan.data for _ in range(plan.pipe)]
    updates = [[0.0] * plan.data for _ in range(plan.pipe)]
    stage_seconds = [0.0] * S
    transfer = [0.0] * max(S - 1, 0)
    worst = None
    for d in range(plan.data):
        c = _replica_costs(profile, plan, schedule, d, receiver_busy)
        transfer = [max(x, y) for x, y in zip(transfer, c.moved, strict=True)]
        stage_seconds = [max(x, y) for x, y in zip(stage_seconds, c.stage, strict=True)]
        sim = simulate(schedule, c.costs())
        summed = {x.stage: x.end for x in sim.syncs}  # a replicated stage's gradient sum
        for r in range(plan.pipe):
            own = [summed[s] for s in schedule.stages_of(r) if s in summed]
            finish[r][d] = max([*sim.ends[r], *own], default=0.0)
            updates[r][d] = c.update[r]
        if worst is None or sim.makespan > worst.makespan:
            worst = sim
    allreduce = _allreduce_per_rank(profile, plan, schedule)
    update = [max(u) for u in updates]
    step = max(max(finish[r]) + allreduce[r] + update[r] for r in range(plan.pipe))
    M = plan.num_microbatches
    closed = (M - 1) * max(stage_seconds) + sum(stage_seconds) + max(update) + max(allreduce)
    return Evaluation(
        plan=plan,
        step_seconds=step,
        pipeline_seconds=worst.makespan,
        allreduce_seconds=tuple(allreduce),
        update_seconds=tuple(update),
        memory=memory_footprint(plan, profile, schedule),
        stage_seconds=tuple(stage_seconds),
        transfer_seconds=tuple(transfer),
        closed_form_seconds=closed,
        simulation=worst,
    )


# --- Sailor plan files -------------------------------------------------------------------


def plan_from_sailor(config: dict, schedule: str = "1f1b") -> ClusterPlan:
    """Reads a Sailor ``plan_config_*.json`` (already parsed) as a `ClusterPlan`.

    Each ``tmp_per_stage`` entry is one data-parallel replica of the stage:
    ``[[[gpu type, GPUs per node, zone]], tensor-parallel degree]``. Every
    replica's tensor-parallel group is taken to be on its own node (in the
    measured plans the degree equals the GPUs per node), so stage-to-stage and
    replica-to-replica traffic crosses nodes. Sailor ran DeepSpeed's pipeline
    engine, a 1F1B schedule, hence the default `schedule`.
    """
    try:
        pipelines = config["pipeline_list"]
        if len(pipelines) != 1:
            raise ValueError(f"expected one pipeline in pipeline_list, got {len(pipelines)}")
        pipe = pipelines[0]
        layers = tuple(tuple(int(l) for l in s) for s in pipe["layers_per_stage"])
        per_stage = pipe["tmp_per_stage"]
        dps = {len(s) for s in per_stage}
        if len(dps) != 1:
            raise ValueError(f"stages have different data-parallel degrees {sorted(dps)}")
        ranks = []
        node = 0
        for replicas in per_stage:
            row = []
            for gpus, tp in replicas:
                kind, per_node, _zone = gpus[0]
                row.append(DeviceGroup(str(kind), int(tp), int(per_node), node))
                node += 1
            ranks.append(tuple(row))
        return ClusterPlan(
            ranks=tuple(ranks),
            stage_layers=layers,
            microbatch_size=int(config["mbs"]),
            global_batch=int(config["gbs"]),
            schedule=schedule,
            memory_layout="mpmd",  # Sailor's runtime: one program per rank
        )
    except (KeyError, TypeError, IndexError) as e:
        raise ValueError(f"not a Sailor plan file: cannot read {e!r}") from None


def load_sailor_plan(path: str, schedule: str = "1f1b") -> tuple[ClusterPlan, dict]:
    """Reads a Sailor plan file; returns the plan and the raw JSON (with ``real``, ``max_mem``)."""
    raw = read_json(path, "Sailor plan file")
    return plan_from_sailor(raw, schedule), raw


# --- Searching ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A plan the search kept, with why it ranks where it does."""

    evaluation: Evaluation
    reasons: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SearchResult:
    best: tuple[Candidate, ...]
    considered: int
    simulated: int
    skipped: tuple[str, ...]
    seconds: float
    memory_margin: float = MEMORY_MARGIN
    unsplit: int = 0  # shapes whose bound before the split kept them out of the top
    # the attention and remat the plans assume (`None`: the profile's bytes as measured),
    # the choices tried before it that fit nothing, and the profile under that choice
    memory_choice: MemoryChoice | None = None
    tried: tuple[MemoryChoice, ...] = ()
    profile: Profile | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class MemoryMiss:
    """The shape that came closest to fitting when none did, and its binding device.

    Attributes:
      plan: the shape with a split (the fastest one the split found, or, where no
        split fits each stage alone, the split that needs the least memory).
      device: its binding device (`MemoryFootprint.binding`).
      available_bytes: what that device may hold (usable memory less the margin).
      note: why the planner's own split did not fit, where it found none.
      shapes: how many shapes ran out of memory.
      choice: the attention and remat it assumed (`None`: as measured).
    """

    plan: ClusterPlan
    device: DeviceMemory
    available_bytes: float
    note: str = ""
    shapes: int = 1
    choice: MemoryChoice | None = None

    @property
    def needed_bytes(self) -> float:
        return self.device.footprint_bytes

    @property
    def ratio(self) -> float:
        return self.needed_bytes / self.available_bytes if self.available_bytes > 0 else math.inf


class NoPlanFits(ValueError):
    """No plan fits. Where memory is why, `miss` is the closest shape (`MemoryMiss`);
    `sequence_length` is the profile's (`None` where it does not say), `tried` the
    attention and remat choices searched."""

    def __init__(self, message: str, miss=None, sequence_length=None, tried=()):
        super().__init__(message)
        self.miss, self.sequence_length, self.tried = miss, sequence_length, tuple(tried)
        self.per_rank = None  # the best plan under the mpmd layout, where one fits there
        self.per_rank_choice = None  # its attention and remat (`MemoryChoice`), if chosen

    def to_json(self) -> dict:
        """The error as the command line's ``--json`` gives it."""
        out = {"error": str(self)}
        m = self.miss
        if m is not None:
            out |= {
                "binding_device": m.device.kind,
                "binding_rank": m.device.rank,
                "binding_replica": m.device.replica,
                "needed_bytes": m.needed_bytes,
                "available_bytes": m.available_bytes,
                "memory_bytes": m.device.memory_bytes,
                "parts": m.device.parts,
                "sequence_length": self.sequence_length,
                "microbatch_size": m.plan.microbatch_size,
                "shape": describe_shape(m.plan),
                "stage_layers": [list(x) for x in m.plan.stage_layers],
                **(m.choice.to_json() if m.choice is not None else {}),
            }
        if self.tried:
            out["tried"] = [c.to_json() for c in self.tried if c is not None]
        if self.per_rank is not None:
            ev = self.per_rank
            choice = self.per_rank_choice
            out["per_rank_plan"] = {
                "shape": describe_shape(ev.plan),
                "memory_layout": MPMD.layout,
                "peak_bytes": ev.memory.max_bytes(MPMD.layout),
                "step_seconds": ev.step_seconds,
                **(choice.to_json() if choice is not None else {}),
            }
        return out


def parse_devices(text: str) -> list[tuple[str, int]]:
    """Reads ``"A100-40:4,V100-16:4"`` as ``[("A100-40", 4), ("V100-16", 4)]``."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        kind, sep, count = item.rpartition(":")
        if not sep or not kind:
            raise ValueError(f"cannot read device {item!r}: expected TYPE:COUNT like A100-40:4")
        try:
            n = int(count)
        except ValueError:
            raise ValueError(f"device count in {item!r} must be a whole number") from None
        if n < 1:
            raise ValueError(f"device count in {item!r} must be at least 1")
        out.append((kind, n))
    if not out:
        raise ValueError("no devices given: expected TYPE:COUNT[,TYPE:COUNT...]")
    kinds = [k for k, _ in out]
    if len(set(kinds)) != len(kinds):
        raise ValueError(f"a device type is listed twice in {text!r}")
    return out


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _live_units(schedule: Schedule) -> list[float]:
    """Per stage, the most of its own values its rank holds at once, in units of the
    stage's residuals per microbatch (its residuals and, where the backward is split,
    its carries, taken as large), as `memory_footprint` counts them. With memory actions,
    each stage's peak on its own rank as the simulator counts it (`_values`; what a
    partner holds for it is left to the footprint checked after the split). A stage
    replicated on several ranks: the most any one of them holds of it."""
    carry = 1.0 if schedule.splits_backward else 0.0
    if schedule.has_memory_actions:
        # Stage s's peak on a rank that holds it in the run with unit costs,
        # `simulate(schedule, Costs(), sizes).peak_bytes[r]` with sizes 1 (and `carry`)
        # for stage s alone: one run and one pass over each rank's events, each stage's
        # running sum taking only its own changes (the others' are zeros there).
        info = analyze(schedule)
        S, M, rows = info.num_stages, info.num_microbatches, info.rows
        holders = schedule.stage_ranks
        starts, ends, issue, _, _ = _timed(schedule, Costs())
        events = _live_events(
            rows, starts, ends, issue, S, M, len(rows), (1.0,) * S, (0.0,) * S, (carry,) * S
        )
        most = [0.0] * S
        for r, changes in enumerate(events):
            live = [0.0] * S
            for _, delta, (src, j) in changes:
                s = rows[src][j].stage
                if r in holders[s]:
                    live[s] += delta
                    if live[s] > most[s]:
                        most[s] = live[s]
        return most
    most = [0.0] * schedule.num_stages
    for r in range(schedule.num_ranks):
        live = [0.0] * schedule.num_stages
        for a in schedule.actions(r):
            s = a.stage
            if a.kind == "F":
                live[s] += 1.0
            elif a.kind == "B":
                live[s] -= 1.0
            elif a.kind == "I":
                live[s] += carry
            else:  # W: the residuals and the carry both go
                live[s] -= 1.0 + carry
            most[s] = max(most[s], live[s])
    return most


def _fitting_split(
    profile: Profile,
    shape: ClusterPlan,
    schedule: Schedule,
    usable,
    margin: float,
    receiver_busy: bool,
    attempts: int = 8,
    live: Sequence[float] | None = None,
) -> ClusterPlan:
    """`shape` with the fastest layer split whose footprint fits its layout, or the
    last split tried (which the caller's check after simulation then refuses).

    The split checks each stage alone (`_split_layers`); under ``spmd`` the
    footprint is the largest parameters plus the largest values and working
    memory, which may come from different stages. Where the fastest split's
    footprint does not fit, the room left after the overhead is shared between
    parameters and values in ``attempts - 1`` ways (a budget for each, per
    stage), and the fastest split that fits as a whole is kept.
    """
    S, owner = schedule.num_stages, schedule.stage_to_rank
    ranks = shape.ranks
    # the first replica's devices decide it (of a replicated stage, its first copy's)
    devs = [ranks[owner[s]][0] for s in range(S)]
    # what each stage may hold besides the fixed overhead of the device that holds it
    terms = profile.memory_terms
    room_of = lambda g: usable(g.kind) - terms.overhead_for(g.kind, g.tensor_parallel)  # noqa: E731
    model = layout_kind(shape.memory_layout).byte_model()
    capacity = model.stage_room([[room_of(g) for g in row] for row in ranks], schedule.stage_ranks)
    share = [x[0] for x in _sharing(ranks, owner)]
    live = _live_units(schedule) if live is None else live
    split = lambda budgets=None: _split_layers(  # noqa: E731
        profile, devs, shape.microbatch_size, live, capacity, receiver_busy, share, budgets
    )
    first = split()
    candidate = dataclasses.replace(shape, stage_layers=first.layers)
    if memory_footprint(candidate, profile, schedule).fits(shape.memory_layout, margin):
        return candidate
    # The largest parameters, values and working memory may sit on different stages:
    # give each a share of what the smallest device has left after the overhead, and
    # keep the fastest split that fits as a whole.
    room = min(capacity)
    best = None
    for i in range(1, attempts):
        budgets = (room * i / attempts, room * (attempts - i) / attempts)
        try:
            found = split(budgets)
        except ValueError:
            continue
        trial = dataclasses.replace(shape, stage_layers=found.layers)
        fits = memory_footprint(trial, profile, schedule).fits(shape.memory_layout, margin)
        if fits and (best is None or found.bottleneck < best[0]):
            best = (found.bottleneck, trial)
    return candidate if best is None else best[1]


def _split_layers(
    profile: Profile,
    devs: Sequence[DeviceGroup],
    mbs: int,
    live: Sequence[int],
    capacity: Sequence[float],
    receiver_busy: bool = True,
    share: Sequence[int] | None = None,
    budgets: tuple[float, float] | None = None,
) -> Partition:
    """The exact min-bottleneck split of layers over stages on `devs`, memory a hard limit.

    A stage fits when its own footprint (its parameters, `live`
    (`_live_units`) microbatches of its residuals and one piece's working
    memory) is within ``capacity[s]``, what a device may hold besides its fixed
    overhead: its own devices' under the ``mpmd`` layout, the smallest
    device's under ``spmd`` (where this
    is necessary but not sufficient: the plan's footprint is checked again
    after simulation). With `budgets` ``(parameters, values)`` each stage's
    parameter bytes and its live values and working memory must also stay
    within them (`_fitting_split` searches them).
    """
    terms = profile.memory_terms
    outputs = profile.outputs(mbs)
    share = share or [1] * len(devs)
    rows = []
    for d in devs:
        t = profile.layer_times(d.kind, mbs, d.tensor_parallel)
        rows.append([f + b for f, b in zip(t.forward, t.backward)])
    S = len(devs)
    pcount = [
        list(itertools.accumulate(profile.params_per_gpu(d.tensor_parallel), initial=0.0))
        for d in devs
    ]
    abytes = [
        list(itertools.accumulate(profile.activations(mbs, d.tensor_parallel), initial=0.0))
        for d in devs
    ]
    # recompute[s][a][b]: the most a layer of [a, b) holds while its backward re-runs it
    recompute = None
    if profile.recompute_bytes:
        recompute = []
        for d in devs:
            rec = profile.recomputes(mbs, d.tensor_parallel)
            table = []
            for a in range(len(rec)):
                row, most = [0.0] * (len(rec) + 1), 0.0
                for b in range(a + 1, len(rec) + 1):
                    most = max(most, rec[b - 1])
                    row[b] = most
                table.append(row)
            recompute.append(table)

    # fwd[s][l], bwd[s][l]: seconds to move layer l's output across the cut after stage
    # s, and its gradient back (`_cut_seconds`)
    cuts = []
    for s in range(S - 1):
        each = {x: _cut_seconds(profile, devs[s], devs[s + 1], x) for x in set(outputs)}
        cuts.append([each[x] for x in outputs])
    fwd = [[share[s] * out for out, _ in cuts[s]] for s in range(S - 1)]
    bwd = [[share[s] * back for _, back in cuts[s]] for s in range(S - 1)]

    # as in `evaluate`: a stage sends its output and its input gradient, and also
    # receives their counterparts when transfers occupy the receiver
    def extra(s, a, b):
        out = back = 0.0
        if s < S - 1:
            out = fwd[s][b - 1] + bwd[s][b - 1] if receiver_busy else fwd[s][b - 1]
        if s > 0:
            back = bwd[s - 1][a - 1] + fwd[s - 1][a - 1] if receiver_busy else bwd[s - 1][a - 1]
        return out + back

    def fits(s, a, b):
        params = terms.bytes_per_param * (pcount[s][b] - pcount[s][a])
        values = (live[s] + terms.working_factor) * (abytes[s][b] - abytes[s][a])
        if recompute is not None:
            values += recompute[s][a][b]
        if budgets is not None and (params > budgets[0] or values > budgets[1]):
            return False
        return params + values <= capacity[s]

    return partition(rows, fits, extra)


def plan(
    profile: Profile,
    devices: Sequence[tuple[str, int]],
    global_batch: int,
    *,
    schedules: Sequence[str] = ("1f1b",),
    microbatch_sizes: Sequence[int] | None = None,
    gpus_per_node: int = 8,
    top: int = 3,
    receiver_busy: bool = True,
    memory_layout: str = "spmd",
    memory_margin: float = MEMORY_MARGIN,
    tensor_parallel: Sequence[int] | None = None,
    tensor_per_stage: bool = False,
    attention: str = AUTO,
    remat: str = AUTO,
) -> SearchResult:
    """Searches placements of `devices` and returns the `top` plans by predicted step time.

    Args:
      profile: the model's profile.
      devices: ``[(device type, count), ...]``.
      global_batch: sequences per step.
      schedules, microbatch_sizes, gpus_per_node, top, receiver_busy, memory_layout,
        memory_margin, tensor_parallel, tensor_per_stage: the search's options
        (`_plan_once`).
      attention, remat: the model's attention implementation and remat policy the
        plans assume (`jpipe.models.attention`), each ``"auto"`` (the default) to
        let the search choose. Under each choice the profile's bytes and times are
        derived (`jpipe.planner.choices`; it needs the profile's model shape) and
        the search below runs; the first choice under which some plan fits wins
        (`SearchResult.memory_choice`). The choices are tried as measured first,
        then by their cost in time (no remat, ``dots``, ``full``; flash-style
        ``blockwise`` attention where the remat re-runs the forward), so a model
        that fits as measured gets the plans it always got.

    Raises:
      NoPlanFits: no plan fits under any choice; where memory is why, it names the
        binding device of the shape that came closest, the bytes it needs and
        those it has, and the profile's sequence length (`NoPlanFits.to_json`).
      ValueError: bad arguments.
    """
    kwargs = dict(
        schedules=schedules,
        microbatch_sizes=microbatch_sizes,
        gpus_per_node=gpus_per_node,
        top=top,
        receiver_busy=receiver_busy,
        memory_layout=memory_layout,
        memory_margin=memory_margin,
        tensor_parallel=tensor_parallel,
        tensor_per_stage=tensor_per_stage,
    )
    choices = choices_to_try(profile, attention, remat)
    failed: list[tuple[MemoryChoice | None, NoPlanFits]] = []
    for choice in choices:
        adjusted = with_choice(profile, choice)
        try:
            result = _plan_once(adjusted, devices, global_batch, **kwargs)
        except NoPlanFits as e:
            if e.miss is not None and choice is not None:
                e.miss = dataclasses.replace(e.miss, choice=choice)
            failed.append((choice, e))
            continue
        return dataclasses.replace(
            result, memory_choice=choice, tried=tuple(c for c, _ in failed), profile=adjusted
        )
    error = _no_plan_fits(profile, devices, global_batch, failed, kwargs)
    if layout_kind(memory_layout).every_device_holds_busiest and error.miss is not None:
        error = _per_rank_advice(error, profile, devices, global_batch, attention, remat, kwargs)
    raise error


PER_RANK_ADVICE = 1.10
"""Where the SPMD layout's fullest device holds more than this times the per-rank
lowering's, a plan names the per-rank lowering and its figure (issue 35: the one
program sizes every device for the largest rank)."""


def _per_rank_advice(error, profile, devices, global_batch, attention, remat, kwargs):
    """`error` (nothing fits under the SPMD layout), saying what fits under the per-rank
    lowering's layout, where something does."""
    try:
        other = plan(
            profile, devices, global_batch, attention=attention, remat=remat,
            **(kwargs | {"memory_layout": MPMD.layout, "top": 1}),
        )  # fmt: skip
    except NoPlanFits:
        return error
    ev = other.best[0].evaluation
    choice = f", with {other.memory_choice}" if other.memory_choice is not None else ""
    text = (
        f"{error}; under the per-rank lowering's layout (--memory-layout mpmd, "
        f"lowering='mpmd', each rank on a mesh of its own: each device holds its "
        f"own rank's) {describe_shape(ev.plan)} fits, "
        f"{gib(ev.memory.max_bytes(MPMD.layout))} on its fullest device, "
        f"{ev.step_seconds:.4g} s per step{choice}"
    )
    out = NoPlanFits(text, error.miss, error.sequence_length, error.tried)
    out.per_rank, out.per_rank_choice = ev, other.memory_choice
    return out


def _no_plan_fits(profile, devices, global_batch, failed, kwargs) -> NoPlanFits:
    """One error for every choice that fit nothing: where memory is why, the closest
    shape of any choice, its binding device, what it needs and has, and the profile's
    sequence length and the shape's microbatch size."""
    shape = profile.shape
    seq = shape.sequence_length if shape is not None else None
    tried = [c for c, _ in failed]
    misses = [e.miss for _, e in failed if e.miss is not None]
    what = f"{profile.model} on {','.join(f'{k}:{n}' for k, n in devices)}"
    if not misses:
        return NoPlanFits(str(failed[-1][1]), None, seq, tried)
    m = min(misses, key=lambda x: x.ratio)
    dev = m.device
    if dev.usable_bytes is None or not dev.memory_bytes:  # its memory unknown: no figures
        return NoPlanFits(str(failed[-1][1]), None, seq, tried)
    margin = kwargs.get("memory_margin", MEMORY_MARGIN)
    parts = ", ".join(f"{k} {v / GIB:.3g}" for k, v in dev.parts.items())
    where = f"rank {dev.rank}" + (f" replica {dev.replica}" if m.plan.data > 1 else "")
    B = m.plan.microbatch_size
    text = (
        f"no plan fits: out of memory: the closest shape, {describe_shape(m.plan)}, needs "
        f"{gib(m.needed_bytes)} on the {dev.kind} of {where} ({parts} GiB), which has "
        f"{gib(dev.memory_bytes)}, {gib(m.available_bytes)} of it usable "
        f"({dev.usable_bytes / dev.memory_bytes:.2f} usable x {1 - margin:.2f} margin): "
        "it does not fit"
    )
    if m.note:
        text += f" ({m.note}; the split shown needs the least)"
    sequences = f"sequences of {seq} tokens" if seq else "one sequence"
    text += (
        f"; the profile's activations are for {sequences}, {B} "
        f"{'sequence' if B == 1 else 'sequences'} a microbatch here"
    )
    if m.choice is not None:
        text += f", with {m.choice}"
    if len([c for c in tried if c is not None]) > 1:
        text += (
            " (tried, attention/remat: "
            + ", ".join(f"{c.attention}/{c.remat}" for c in tried)
            + ")"
        )
    elif shape is not None and m.choice is not None:
        text += " (--attention auto --remat auto tries the choices that hold less)"
    text += f"; {m.shapes} shapes of {what} at global batch {global_batch} ran out of memory"
    return NoPlanFits(text, m, seq, tried)


def _plan_once(
    profile: Profile,
    devices: Sequence[tuple[str, int]],
    global_batch: int,
    *,
    schedules: Sequence[str] = ("1f1b",),
    microbatch_sizes: Sequence[int] | None = None,
    gpus_per_node: int = 8,
    top: int = 3,
    receiver_busy: bool = True,
    memory_layout: str = "spmd",
    memory_margin: float = MEMORY_MARGIN,
    tensor_parallel: Sequence[int] | None = None,
    tensor_per_stage: bool = False,
) -> SearchResult:
    """`plan`'s search under the profile's bytes and times as they stand.

    Args:
      profile: the model's profile.
      devices: ``[(device type, count), ...]``.
      global_batch: sequences per step.
      schedules: schedule SPECs to try (built-in names or ``file.py:function``).
      microbatch_sizes: B values to try; default every size the profile has for
        all the device types.
      gpus_per_node: GPUs of one type share a node up to this many.
      top: how many plans to return.
      receiver_busy: see `evaluate`.
      memory_layout: the layout the plans will run under (`LAYOUTS`): ``"spmd"``
        for jpipe's one-program lowering, ``"mpmd"`` for one program per rank.
      memory_margin: the share of every device's usable memory kept free.
      tensor_parallel: tensor-parallel degrees to try; default 1, 2, 4 and 8
        where they divide every type's count and fit in a node.
      tensor_per_stage: give each device type its own degree from `tensor_parallel`
        (one that divides that type's count and fits in its node), so the stages
        on different types may differ in tensor degree; the same degree for every
        type is among the choices. Only the per-rank lowering runs such plans
        (one mesh per rank), so this needs ``memory_layout="mpmd"``. The
        search then splits a shape's layers only when a bound computed before the
        split (`_shape_bound`) could still enter the top, and skips unsplit the
        shapes whose parameters cannot fit at all (`_parameters_fit`); the
        uniform search splits every shape, so it reports every reason a shape
        was skipped.
    """
    start = time.perf_counter()
    _check_search_options(memory_layout, memory_margin, tensor_per_stage)
    usable = lambda kind: (  # noqa: E731
        profile.memory_of(kind) * profile.memory_terms.usable_fraction * (1 - memory_margin)
    )
    _check_profiled(profile, devices)
    if microbatch_sizes is None:
        common = set.intersection(*({b for b, _ in profile.times[k]} for k, _ in devices))
        microbatch_sizes = sorted(common)
    node_size = {k: min(n, gpus_per_node) for k, n in devices}
    assignments = _tensor_assignments(
        devices, tensor_parallel, node_size, gpus_per_node, tensor_per_stage
    )
    search = _ShapeSearch(
        profile, usable, memory_layout, memory_margin, receiver_busy, lazy=tensor_per_stage
    )
    for ranks, degrees_text, order in _placements(
        devices, assignments, node_size, profile.num_layers
    ):
        search.queue_placement(
            ranks, degrees_text, order, microbatch_sizes, schedules, global_batch
        )
    found, simulated = search.best_plans(top)
    if not found:
        raise search.no_plan_fits()
    best = tuple(
        Candidate(
            ev,
            _reasons(profile, ev, found, receiver_busy, memory_margin)
            + ((search.chosen[ev.plan],) if ev.plan in search.chosen else ()),
        )
        for ev in found
    )
    return SearchResult(
        best,
        search.considered,
        simulated,
        tuple(search.skipped),
        time.perf_counter() - start,
        memory_margin,
        search.unsplit(),
    )


def _check_search_options(memory_layout: str, memory_margin: float, tensor_per_stage: bool):
    """Raises `ValueError` for a memory layout or margin `_plan_once` cannot take, or for
    per-stage tensor degrees under a layout whose one program has one mesh."""
    if memory_layout not in LAYOUTS:
        raise ValueError(
            f"memory layout {memory_layout!r} is not one of {', '.join(LAYOUTS)}"
            + _renamed(memory_layout)
        )
    if not 0 <= memory_margin < 1:
        raise ValueError(
            f"the memory margin (--memory-margin) must be in [0, 1), got {memory_margin!r}"
        )
    if tensor_per_stage and not layout_kind(memory_layout).meshes_per_rank:
        raise ValueError(
            "per-stage tensor degrees (--tensor-per-stage) need the mpmd layout "
            f"(--memory-layout mpmd): the {memory_layout} layout's one program has one "
            "mesh, one tensor degree for every stage"
        )


def _check_profiled(profile: Profile, devices: Sequence[tuple[str, int]]) -> None:
    """Raises `ValueError` for a device type the profile has no times for, or whose memory
    it does not say (`Profile.memory_of`)."""
    for kind, _ in devices:
        if kind not in profile.times:
            raise ValueError(
                f"the {profile.model} profile has no device {kind!r}; it has "
                f"{', '.join(profile.devices)}"
            )
        profile.memory_of(kind)


def _tensor_assignments(
    devices: Sequence[tuple[str, int]],
    tensor_parallel: Sequence[int] | None,
    node_size: dict[str, int],
    gpus_per_node: int,
    per_type: bool,
) -> list[dict[str, int]]:
    """The tensor degrees to try, one ``{device type: degree}`` a choice, from
    `tensor_parallel` (default 1, 2, 4 and 8): with `per_type` every combination of the
    degrees that divide each type's count and fit in its node (`node_size`), otherwise
    each degree that does so for every type. Raises `ValueError` where none does."""
    kinds = [k for k, _ in devices]
    degrees = list(tensor_parallel or (1, 2, 4, 8))
    fits_node = lambda k, n, t: n % t == 0 and t <= node_size[k]  # noqa: E731
    if per_type:
        per_kind = [[t for t in degrees if fits_node(k, n, t)] for k, n in devices]
        for (k, n), ts in zip(devices, per_kind, strict=True):
            if not ts:
                raise ValueError(
                    f"no tensor-parallel degree in {degrees} divides the {n} {k} devices and "
                    f"fits in a node of {node_size[k]}"
                )
        return [dict(zip(kinds, c, strict=True)) for c in itertools.product(*per_kind)]
    tps = [t for t in degrees if all(fits_node(k, n, t) for k, n in devices)]
    if not tps:
        raise ValueError(
            f"no tensor-parallel degree in {degrees} divides every "
            f"device type's count and fits in a node of {gpus_per_node}"
        )
    return [dict.fromkeys(kinds, t) for t in tps]


class _ShapeSearch:
    """One `_plan_once` search: its queue, what it has built and what it skipped.

    The queue holds, each at a bound on its step time (ties in the order pushed), the
    shapes still to split (``("split", shape, key, where)`` for a built schedule,
    ``("search", shape)`` for ``--schedules search``) and the candidates split and ready
    to simulate (``("ready", plan, schedule)``). The eager search (`lazy` False) splits
    every shape as it is found; the lazy one (``tensor_per_stage``) queues it at a bound
    that needs no split (`_shape_bound`) and splits it only when it reaches the front.
    `best_plans` then pops the smallest bound first and stops once the top plans beat
    every bound left.
    """

    def __init__(self, profile, usable, memory_layout, memory_margin, receiver_busy, lazy):
        self.profile, self.usable = profile, usable
        self.memory_layout, self.memory_margin = memory_layout, memory_margin
        self.receiver_busy, self.lazy = receiver_busy, lazy
        self.queue: list = []  # (bound, order pushed, item): to split, and to simulate
        self.pushed = itertools.count()
        self.skipped: list[str] = []
        self.chosen: dict[ClusterPlan, str] = {}  # plans whose schedule the search picked: why
        self.built: dict = {}  # (spec, ranks, microbatches) -> (schedule or None, error, runs)
        self.live_of: dict = {}  # the same key -> `_live_units` of the schedule
        self.searched: dict = {}  # what the searches of `--schedules search` share (`_searched`)
        self.considered = 0
        # shapes out of memory: those no split fits (their least-memory split is found only if
        # no plan fits), and the simulated candidates that did not fit (a `MemoryMiss` each)
        self.unsplittable: dict = {}
        self.too_big: list[MemoryMiss] = []

    def _push(self, bound: float, item) -> None:
        heapq.heappush(self.queue, (bound, next(self.pushed), item))

    def schedule_of(self, spec: str, p: int, M: int):
        """``(schedule or None, its error or None, whether the layout's lowering runs it)``
        for `spec` on `p` ranks and `M` microbatches, built once."""
        key = (spec, p, M)
        if key not in self.built:
            try:
                schedule = get_schedule(spec, p, M)
            except ValueError as e:
                self.built[key] = (None, e, False)
            else:
                self.built[key] = (schedule, None, runs_schedule(self.memory_layout, schedule))
                self.live_of[key] = _live_units(schedule)
        return self.built[key]

    def queue_placement(
        self, ranks, degrees_text, order, microbatch_sizes, schedules, global_batch
    ) -> None:
        """Queues every shape of one placement (`_placements`): each microbatch size that
        divides `global_batch` over the replicas into whole microbatches, with each schedule
        SPEC. The lazy search first skips a placement that cannot hold the parameters."""
        d = len(ranks[0])
        if self.lazy:
            why_not = _parameters_fit(self.profile, ranks, self.usable)
            if why_not:
                self.skipped.append(f"{degrees_text} {order}: {why_not}")
                return
        mirrored = _mirrored(ranks)  # tried too for a replicated schedule
        for mbs in microbatch_sizes:
            if global_batch % (mbs * d):
                continue
            for spec in schedules:
                shape = ClusterPlan(ranks, (), mbs, global_batch, spec, None, self.memory_layout)
                self._queue_shape(shape, f"{degrees_text} B={mbs} {order}")
                if mirrored != ranks and spec != SEARCH:
                    schedule = self.schedule_of(spec, shape.pipe, shape.num_microbatches)[0]
                    if schedule is not None and schedule.replicated:
                        shape = dataclasses.replace(shape, ranks=mirrored)
                        self._queue_shape(shape, f"{degrees_text} B={mbs} {order} mirrored")

    def _queue_shape(self, shape: ClusterPlan, where: str) -> None:
        """Queues one shape to split (lazily, at `_shape_bound`) or splits it now; or notes
        why its schedule cannot run on it."""
        spec, p, M = shape.schedule, shape.pipe, shape.num_microbatches
        owner, replicated = None, False
        if spec == SEARCH:
            item = ("search", shape)
        else:
            schedule, error, runs = self.schedule_of(spec, p, M)
            if error is not None:
                self.skipped.append(f"{spec} on {p} ranks x {M} microbatches: {error}")
                return
            why_not = _copies_across_degrees(schedule, shape.ranks)
            if schedule.slices:
                why_not = "the planner does not plan sequence slices yet"
            if why_not:
                self.skipped.append(f"{spec} on {where}: {why_not}")
                return
            if not runs:
                self.skipped.append(
                    f"{spec}: the SPMD lowering does not run its memory actions "
                    "(plan with --memory-layout mpmd for lowering='mpmd')"
                )
                return
            if schedule.num_stages > self.profile.num_layers:
                return
            why_not = _evicts_across_degrees(schedule, shape.ranks)
            if why_not:
                self.skipped.append(f"{spec} on {where}: {why_not}")
                return
            item = ("split", shape, (spec, p, M), where)
            owner = schedule.stage_to_rank
            replicated = schedule.replicated
        if self.lazy:
            bound = _shape_bound(
                self.profile, shape.ranks, shape.microbatch_size, M, owner, self.receiver_busy,
                replicated,
            )  # fmt: skip
            self._push(bound, item)
        else:
            self.split(-math.inf, item)

    def split(self, bound: float, item) -> None:
        """Splits the layers of a shape (`item`); queues the candidate at its bound."""
        if item[0] == "search":
            got = self._split_by_search(item[1])
        else:
            got = self._split_for_schedule(*item[1:])
        if got is None:
            return
        candidate, schedule = got
        self.considered += 1
        after = _lower_bound(self.profile, candidate, schedule)
        if self.lazy:  # tighter, and worth its cost where most shapes are never simulated
            after = _busy_bound(self.profile, candidate, schedule, self.receiver_busy)
        self._push(max(bound, after), ("ready", candidate, schedule))

    def _split_by_search(self, shape: ClusterPlan):
        """``(plan, schedule)`` as `jpipe.search_schedule` picks them for `shape`
        (`_searched`), noting why it picked them; or None, noting why there is none."""
        try:
            candidate, schedule, why = _searched(
                self.profile, shape, self.usable, self.memory_margin, self.receiver_busy,
                self.searched,
            )  # fmt: skip
        except ValueError as e:
            self.skipped.append(f"{describe_shape(shape)}: {e}")
            return None
        why_not = _evicts_across_degrees(schedule, shape.ranks)
        if why_not:  # the search was told so; kept as a check
            self.skipped.append(f"{describe_shape(shape)}: {why_not}")
            return None
        self.chosen[candidate] = why
        return candidate, schedule

    def _split_for_schedule(self, shape: ClusterPlan, key, where: str):
        """``(plan, schedule)``: `shape` split to fit under its schedule, built under `key`
        (`_fitting_split`); or None, noting why (and keeping aside a shape no split fits)."""
        schedule = self.built[key][0]
        try:
            candidate = _fitting_split(
                self.profile, shape, schedule, self.usable, self.memory_margin,
                self.receiver_busy, live=self.live_of[key],
            )  # fmt: skip
        except NoSplitFits as e:
            self.skipped.append(f"{where}: {e}")
            self.unsplittable.setdefault((shape.ranks, shape.microbatch_size, key), (shape, e))
            return None
        except ValueError as e:
            self.skipped.append(f"{where}: {e}")
            return None
        return candidate, schedule

    def best_plans(self, top: int) -> tuple[list[Evaluation], int]:
        """Pops the queue (splitting shapes, simulating candidates) until no bound left can
        enter the `top` plans that fit: those plans, fastest first, and how many candidates
        were simulated."""
        found: list[Evaluation] = []
        simulated = 0
        while self.queue:
            bound, _, item = heapq.heappop(self.queue)
            if len(found) >= top and bound >= found[top - 1].step_seconds:
                break  # no candidate left can beat the top plans
            if item[0] != "ready":
                self.split(bound, item)
                continue
            _, candidate, schedule = item
            ev = evaluate(candidate, self.profile, schedule, receiver_busy=self.receiver_busy)
            simulated += 1
            if not ev.memory.fits(self.memory_layout, self.memory_margin):
                self.skipped.append(
                    f"{describe_shape(candidate)}: out of memory, "
                    + ev.memory.why(self.memory_layout, self.memory_margin)
                )
                self.too_big.append(_miss(candidate, ev.memory, self.memory_margin))
                continue
            found.append(ev)
            found.sort(key=lambda e: e.step_seconds)
            del found[top:]
        return found, simulated

    def unsplit(self) -> int:
        """How many shapes the queue still held unsplit when the search stopped."""
        return sum(item[0] != "ready" for _, _, item in self.queue)

    def no_plan_fits(self) -> NoPlanFits:
        """The error where no plan fits: every reason a shape was skipped, and the shape out
        of memory that came closest (of those no split fits, their least-memory split)."""
        for shape, e in self.unsplittable.values():
            schedule = self.built[(shape.schedule, shape.pipe, shape.num_microbatches)][0]
            least = _least_memory_split(self.profile, shape, schedule)
            memory = memory_footprint(least, self.profile, schedule)
            self.too_big.append(_miss(least, memory, self.memory_margin, str(e).split(";")[0]))
        closest = min(self.too_big, key=lambda m: m.ratio, default=None)
        if closest is not None:
            closest = dataclasses.replace(
                closest, shapes=len(self.too_big), choice=self.profile.memory_choice
            )
        return NoPlanFits("no plan fits: " + _summarise(self.skipped), closest)


def _miss(plan_: ClusterPlan, memory: MemoryFootprint, margin: float, note: str = ""):
    """`plan_`'s binding device as a `MemoryMiss` (none known: an infinite need)."""
    m = memory.binding(plan_.memory_layout, margin)
    available = math.inf if m.usable_bytes is None else m.usable_bytes * (1 - margin)
    return MemoryMiss(plan_, m, available, note)


def _least_memory_split(profile: Profile, shape: ClusterPlan, schedule: Schedule) -> ClusterPlan:
    """`shape` with the split whose fullest stage needs the least memory: its parameters,
    its live microbatches of residuals and its working memory (`_split_layers`' terms,
    the exact partitioner minimising their largest sum)."""
    terms, mbs = profile.memory_terms, shape.microbatch_size
    live = _live_units(schedule)
    rows = []
    for s in range(schedule.num_stages):
        tp = shape.ranks[schedule.stage_to_rank[s]][0].tensor_parallel
        per = live[s] + terms.working_factor
        rows.append([
            terms.bytes_per_param * n + per * a
            for n, a in zip(profile.params_per_gpu(tp), profile.activations(mbs, tp))
        ])  # fmt: skip
    return dataclasses.replace(shape, stage_layers=partition(rows).layers)


def _evicts_across_degrees(schedule: Schedule, ranks) -> str | None:
    """Why the per-rank lowering cannot run `schedule` on `ranks`, or `None`: it moves a
    rank's residuals (EVICT) only to a rank of the same mesh shape, since each device's
    residuals are its own block of its tensor group."""
    degrees = [max(g.tensor_parallel for g in row) for row in ranks]
    if len(set(degrees)) == 1 or not schedule.has_memory_actions:
        return None
    for r, _, a in schedule.all_actions():
        if a.kind == "EVICT" and degrees[a.partner] != degrees[r]:
            return (
                f"rank {r}'s {a} sends residuals to rank {a.partner}, of tensor degree "
                f"{degrees[a.partner]} against {degrees[r]}; the per-rank lowering evicts only "
                "to a rank of the same mesh shape"
            )
    return None


def _placements(devices, assignments, node_size, num_layers):
    """Every placement of `devices`: for each tensor degree per type (`assignments`),
    data-parallel degree and order of the types, ``(ranks, text)`` with ``ranks[r][j]``
    the `DeviceGroup` of rank ``r`` in replica ``j`` (replica j's ranks take the next
    groups of each type, filling nodes in order), and for reports ``"tp=T dp=D pp=P"``
    and the order, ``"TYPE/TYPE"``."""
    kinds = [k for k, _ in devices]
    for tp_of in assignments:
        units = {k: n // tp_of[k] for k, n in devices}
        for d in _divisors(math.gcd(*units.values())):
            per_replica = {k: u // d for k, u in units.items()}
            p = sum(per_replica.values())
            if p > num_layers:
                continue
            for order in itertools.permutations(kinds):
                used = {k: 0 for k in kinds}
                ranks = [[None] * d for _ in range(p)]
                for j in range(d):
                    r = 0
                    for k in order:
                        for _ in range(per_replica[k]):
                            g = used[k]
                            used[k] += 1
                            node = kinds.index(k) * 1000 + (g * tp_of[k]) // node_size[k]
                            ranks[r][j] = DeviceGroup(k, tp_of[k], node_size[k], node)
                            r += 1
                tp = "/".join(str(tp_of[k]) for k in order)
                if len(set(tp_of.values())) == 1:
                    tp = str(tp_of[kinds[0]])
                yield tuple(tuple(x) for x in ranks), f"tp={tp} dp={d} pp={p}", "/".join(order)


def _mirrored(ranks):
    """`ranks` reordered to read alike from both ends: the placement's i-th rank goes to
    position i / 2 from the front (i even) or from the back (i odd), so where a device
    type fills an even block, ranks r and R - 1 - r are of one type. Chimera and DualPipe
    put a stage's two copies on ranks r and R - 1 - r: on the contiguous blocks of
    `_placements` their copies sit on different types and the faster waits."""
    R = len(ranks)
    out = [None] * R
    for i, row in enumerate(ranks):
        out[i // 2 if i % 2 == 0 else R - 1 - i // 2] = row
    return tuple(out)


def _shape_bound(
    profile: Profile, ranks, mbs: int, M: int, owner, receiver_busy, replicated: bool = False
) -> float:
    """A bound on any plan of `ranks` before its layers are split.

    Every layer runs on some rank, at best on the one where it is cheapest, and every
    stage boundary between ranks (`owner`, the schedule's stage-to-rank map; `None`
    when the schedule is not yet chosen) moves at least the smallest output any cut
    could send: so the busiest rank of the first replica does at least the average of
    that work and those transfers, and at least the costliest layer, M times over.
    Where the schedule replicates stages (`replicated`), a layer's M microbatches may
    be shared among its copies' ranks, and a boundary crossed between different pairs
    of ranks: the bound keeps the average work alone.
    """
    dev = [row[0] for row in ranks]
    rows = [profile.layer_times(g.kind, mbs, g.tensor_parallel) for g in dev]
    cheapest = [min(t.forward[l] + t.backward[l] for t in rows) for l in range(profile.num_layers)]
    if replicated:
        return M * sum(cheapest) / len(ranks)
    moving = 0.0
    if owner is not None:
        outputs = profile.outputs(mbs)[:-1]  # a cut follows any layer but the last
        share = [x[0] for x in _sharing(ranks, owner)]
        for s in range(len(owner) - 1):
            a, b = owner[s], owner[s + 1]
            if a == b:
                continue
            cuts = [_cut_seconds(profile, dev[a], dev[b], x) for x in set(outputs)]
            out = share[s] * min(c[0] for c in cuts)
            back = share[s] * min(c[1] for c in cuts)
            moving += (out + back) * (2 if receiver_busy else 1)
    return M * max((sum(cheapest) + moving) / len(ranks), max(cheapest))


def _parameters_fit(profile: Profile, ranks, usable) -> str | None:
    """Why no split of layers over `ranks` can hold the model's parameters, or `None`.

    A rank holds at most its room (its devices' usable memory less the fixed overhead),
    and each layer's parameter state takes, on the rank where it takes the least, some
    share of that rank's room: those shares cannot sum to more than the ranks there are.
    Necessary, not sufficient (residuals and the split's contiguity come later), and
    cheap enough to run before any split."""
    terms = profile.memory_terms
    shares = [math.inf] * profile.num_layers
    for row in ranks:
        tp = max(g.tensor_parallel for g in row)
        room = min(usable(g.kind) - terms.overhead_for(g.kind, g.tensor_parallel) for g in row)
        for l, n in enumerate(profile.params_per_gpu(tp)):
            need = terms.bytes_per_param * n
            share = need / room if room > 0 else (0.0 if need <= 0 else math.inf)
            shares[l] = min(shares[l], share)
    total = sum(shares)
    if total <= len(ranks):
        return None
    return (
        f"the parameters need {total:.3g} ranks' room at the least (each layer where it takes "
        f"the smallest share), more than the {len(ranks)} ranks have"
    )


class _PlanFigures:
    """`jpipe.search_schedule`'s figures for one shape of a plan: each schedule gets its
    own layer split (`_fitting_split`) and the per-stage costs and bytes `evaluate` and
    `memory_footprint` would count for it (`_stage_figures`)."""

    def __init__(self, profile, shape, usable, margin, receiver_busy, live=None):
        self.profile, self.shape = profile, shape
        self.usable, self.margin, self.receiver_busy = usable, margin, receiver_busy
        self.plans: dict[Schedule, ClusterPlan] = {}
        self._splits: dict = {}
        # `_live_units` of each schedule, by its id (the schedule kept beside them): a dict
        # the planner keeps over its shapes, whose searches share their schedules
        self._live = {} if live is None else live

    def _live_units(self, schedule: Schedule) -> tuple[float, ...]:
        got = self._live.get(id(schedule))
        if got is None or got[0] is not schedule:
            got = self._live[id(schedule)] = (schedule, tuple(_live_units(schedule)))
        return got[1]

    def for_schedule(self, schedule: Schedule):
        if schedule.num_stages > self.profile.num_layers:
            raise ValueError(
                f"{schedule.num_stages} stages, more than the profile's {self.profile.num_layers}"
                " layers"
            )
        # With one stage a rank and no memory actions, schedules that keep as many of each
        # stage's values split the layers alike (`_fitting_split` and the footprint it
        # checks read nothing else of them): 1F1B and eager 1F1B, for instance.
        alike = not schedule.has_memory_actions and schedule.num_stages == schedule.num_ranks
        key = (
            None if alike else schedule,
            schedule.stage_to_rank,
            schedule.splits_backward,
            self._live_units(schedule),
        )
        if key not in self._splits:
            self._splits[key] = _fitting_split(
                self.profile, self.shape, schedule, self.usable, self.margin, self.receiver_busy,
                live=key[3],
            )  # fmt: skip
        plan_ = self._splits[key]
        self.plans[schedule] = plan_
        return _stage_figures(self.profile, plan_, schedule, self.receiver_busy)


def _stage_figures(profile: Profile, plan_: ClusterPlan, schedule: Schedule, receiver_busy):
    """Per-stage costs and bytes of `plan_`'s first replica, as `evaluate` and
    `memory_footprint` count them (blocking sends folded into the actions; the runtime's
    bytes per parameter, residuals, carries as large as them where the backward is split,
    ``working_factor`` of the residuals). A recompute costs the stage's forward without
    its send; an eviction the residuals over the link to the partner rank's device."""
    S, owner, R = schedule.num_stages, schedule.stage_to_rank, plan_.pipe
    mbs, terms = plan_.microbatch_size, profile.memory_terms
    dev = [plan_.ranks[owner[s]][0] for s in range(S)]
    outputs = profile.outputs(mbs)
    F, I, W, B, forward, act, rec, evict, params = ([] for _ in range(9))
    for s, layers in enumerate(plan_.stage_layers):
        g = dev[s]
        t = profile.layer_times(g.kind, mbs, g.tensor_parallel)
        i_half, w_half = t.split()
        forward.append(sum(t.forward[l] for l in layers))
        F.append(forward[-1])
        B.append(sum(t.backward[l] for l in layers))
        I.append(sum(i_half[l] for l in layers))
        W.append(sum(w_half[l] for l in layers))
        act.append(_stage_activations(profile, layers, mbs, g.tensor_parallel))
        rec.append(_stage_recompute(profile, layers, mbs, g.tensor_parallel))
        partner = plan_.ranks[R - 1 - owner[s]][0]
        evict.append(_link_seconds(profile, g, partner, act[-1]) if partner != g else 0.0)
        params.append(terms.bytes_per_param * _stage_params(profile, layers, g.tensor_parallel))
    for s in range(S - 1):
        if owner[s] == owner[s + 1]:
            continue
        out, back = _cut_seconds(profile, dev[s], dev[s + 1], outputs[plan_.stage_layers[s][-1]])
        F[s] += out
        I[s + 1] += back
        B[s + 1] += back
        if receiver_busy:
            F[s + 1] += out
            I[s] += back
            B[s] += back
    sizes = _values_sizes(schedule, act, _stage_inputs(profile, plan_.stage_layers, mbs))
    return StageFigures(
        Costs(F=F, I=I, W=W, B=B, recompute=forward, evict=evict),
        dataclasses.replace(sizes, params=params),
        working=[terms.working_factor * a + r for a, r in zip(act, rec)],
        num_stages=S,
        source=f"the {profile.model} profile",
    )


def _searched(
    profile: Profile, shape: ClusterPlan, usable, margin: float, receiver_busy, built=None
):
    """`jpipe.search_schedule` for one shape: `(plan, schedule, why)`, or `ValueError`.

    The budget is what the tightest device of the shape may hold besides its fixed
    overhead (its usable memory less the margin); under ``spmd`` every device must hold
    the largest rank's terms, under ``mpmd`` each its own, the search's layouts.
    The candidates are the built-ins and their options (V shapes and memory actions
    where the layout's lowering runs them: recomputes and evictions; the profiles give
    no host bandwidth for offloads), each split by `_fitting_split`; not the local
    search, whose schedules have no name a plan file could give the trainer.

    `built`, a dict the caller keeps over its shapes, holds the schedules built and what
    is worked out on them alone (`search_schedule`'s `built`, `_live_units`).
    """
    terms = profile.memory_terms
    budget = min(
        usable(g.kind) - terms.overhead_for(g.kind, g.tensor_parallel)
        for row in shape.ranks
        for g in row
    )
    if budget <= 0:
        raise ValueError("search: the fixed overhead alone fills the smallest device")
    if built is None:
        built = {}
    live = built.setdefault("live units", {})  # beside search_schedule's, which are tuples
    figures = _PlanFigures(profile, shape, usable, margin, receiver_busy, live)
    # the built-ins evict to rank R - 1 - r, which must have the same mesh shape
    degrees = shape.tensor_per_rank
    same = all(degrees[r] == degrees[shape.pipe - 1 - r] for r in range(shape.pipe))
    result = search_schedule(
        figures,
        shape.pipe,
        shape.num_microbatches,
        budget,
        layout=shape.memory_layout,
        local=False,
        margin=0.0,
        memory_actions=("recompute", "evict") if same else ("recompute",),
        built=built.setdefault("schedules", {}),
    )
    w = result.winner
    if w is None:
        raise ValueError(f"search: {'; '.join(result.reasons())}")
    plan_ = dataclasses.replace(
        figures.plans[w.schedule], schedule=w.spec, num_chunks=w.chunks if w.chunks > 1 else None
    )
    fitting = sum(c.fits for c in result.candidates)
    why = (
        f"schedule chosen by jpipe.search_schedule: {w.label}, the fastest of {fitting} that "
        f"fit {gib(budget)} besides the overhead ({shape.memory_layout} layout) among "
        f"{len(result.candidates)} simulated"
    )
    return plan_, w.schedule, why


def _summarise(skipped: Sequence[str], most: int = 5) -> str:
    """The reasons candidates were skipped, each once, with how many shapes it stopped."""
    if not skipped:
        return "no candidate shapes for these devices"
    why: dict[str, list[str]] = {}
    for line in skipped:
        shape, _, reason = line.partition(": ")
        why.setdefault(reason or shape, []).append(shape)
    parts = [
        f"{reason} ({shapes[0]}"
        + (f" and {len(shapes) - 1} more shapes)" if len(shapes) > 1 else ")")
        for reason, shapes in list(why.items())[:most]
    ]
    if len(why) > most:
        parts.append(f"and {len(why) - most} more reasons")
    return "; ".join(parts)


def _lower_bound(profile: Profile, plan: ClusterPlan, schedule: Schedule) -> float:
    """No schedule beats the busiest rank doing all its microbatches back to back."""
    mbs = plan.microbatch_size
    count = _microbatches_on(schedule)
    busiest = 0.0
    for r, row in enumerate(plan.ranks):
        for dev in row:
            t = profile.layer_times(dev.kind, mbs, dev.tensor_parallel)
            work = sum(
                n * sum(t.forward[l] + t.backward[l] for l in plan.stage_layers[s])
                for s, n in enumerate(count[r])
                if n
            )
            busiest = max(busiest, work)
    return busiest


def describe_shape(p: ClusterPlan) -> str:
    """A plan's shape in one line: ``pp=2 dp=1 tp=8 B=1 M=256 1f1b ranks=A100-40,A100-40``."""
    kinds = [p.ranks[r][0].kind for r in range(p.pipe)]
    tp = p.tensor_parallel if p.uniform_tensor else "/".join(map(str, p.tensor_per_rank))
    return (
        f"pp={p.pipe} dp={p.data} tp={tp} B={p.microbatch_size} "
        f"M={p.num_microbatches} {p.schedule} ranks={','.join(kinds)}"
    )


def _reasons(
    profile: Profile,
    ev: Evaluation,
    found: Sequence[Evaluation],
    receiver_busy: bool = True,
    memory_margin: float = MEMORY_MARGIN,
) -> tuple[str, ...]:
    """Why this plan: its bottleneck, its cost breakdown, and how it compares."""
    p = ev.plan
    s = max(range(len(ev.stage_seconds)), key=lambda k: ev.stage_seconds[k])
    dev = p.ranks[ev.simulation.schedule.stage_to_rank[s]][0].kind
    out = [
        f"{describe_shape(p)}: {ev.step_seconds:.4g} s per step = pipeline "
        f"{ev.pipeline_seconds:.4g} s "
        f"+ all-reduce {max(ev.allreduce_seconds):.3g} s + update {max(ev.update_seconds):.3g} s",
        f"bottleneck stage {s} ({len(p.stage_layers[s])} layers"
        + f" on {dev}"
        + f"): {ev.stage_seconds[s]:.4g} s per microbatch; stages hold "
        f"{[len(x) for x in p.stage_layers]} layers",
        f"closed-form estimate {ev.closed_form_seconds:.4g} s "
        f"({(ev.closed_form_seconds / ev.step_seconds - 1) * 100:+.1f}% vs simulated)",
        ev.memory.why(p.memory_layout, memory_margin),
    ]
    if layout_kind(p.memory_layout).every_device_holds_busiest and p.uniform_tensor:
        held, own = ev.memory.max_bytes(p.memory_layout), ev.memory.max_bytes(MPMD.layout)
        if held > PER_RANK_ADVICE * own:
            out.append(
                f"the per-rank lowering (--memory-layout mpmd, lowering='mpmd' with a mesh "
                f"per rank) would hold "
                f"{gib(own)} on its fullest device, where every device of the one program "
                f"holds the largest rank's terms, {gib(held)} ({held / own:.2f}x)"
            )
    if not p.uniform_tensor:
        out.append(
            f"tensor degree per rank {list(p.tensor_per_rank)}: one mesh per rank, "
            "lowering='mpmd' (values regroup between ranks of different degrees, within a "
            "process or across processes)"
        )
    if found and ev is not found[0]:
        out.append(f"{(ev.step_seconds / found[0].step_seconds - 1) * 100:+.1f}% vs the best plan")
    elif len(found) > 1:
        out.append(
            f"{(found[1].step_seconds / ev.step_seconds - 1) * 100:.1f}% faster than the next"
        )
    if p.pipe > 1:
        owner_devs = [p.ranks[r][0] for r in range(p.pipe)]
        for name, split in (
            ("uniform", uniform_partition),
            ("speed-proportional", proportional_partition),
        ):
            if len(p.stage_layers) != p.pipe:
                break
            rows = []
            for d in owner_devs:
                t = profile.layer_times(d.kind, p.microbatch_size, d.tensor_parallel)
                rows.append([f + b for f, b in zip(t.forward, t.backward)])
            base = dataclasses.replace(p, stage_layers=split(rows).layers)
            try:
                other = evaluate(
                    base, profile, ev.simulation.schedule, receiver_busy=receiver_busy
                ).step_seconds
            except ValueError:
                continue
            out.append(
                f"the {name} layer split would take {other:.4g} s "
                f"({(other / ev.step_seconds - 1) * 100:+.1f}%)"
            )
    return tuple(out)


# --- Plan files for the trainer ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainerSettings:
    """What the trainer needs from a plan file.

    Attributes:
      pipe, data, tensor: mesh sizes.
      layers_per_stage: transformer blocks per stage (embedding and head excluded).
      schedule: the schedule SPEC.
      num_chunks: stages per rank, or 0 for the schedule's own.
      num_microbatches: M.
      batch_size: the global batch.
      lowering: the lowering whose memory the plan was checked for: ``"spmd"``
        (layout ``spmd``: every device holds the largest rank's) or
        ``"mpmd"`` (layout ``mpmd``: each device its own rank's, as the
        per-rank lowering gives).
      tensor_per_rank: each pipeline rank's tensor degree where they differ (the
        file's ``mesh.tensor_per_rank``; only with lowering ``"mpmd"``, one mesh per
        rank), `None` where every rank has ``tensor``.
      process_devices: the devices of each process (host) that runs the plan, in
        launch order (the file's ``processes``: per-rank plans), or `None`.
    """

    pipe: int
    data: int
    tensor: int
    layers_per_stage: tuple[int, ...]
    schedule: str
    num_chunks: int
    num_microbatches: int
    batch_size: int
    lowering: str = "spmd"
    tensor_per_rank: tuple[int, ...] | None = None
    process_devices: tuple[int, ...] | None = None


def plan_file(ev: Evaluation, profile: Profile) -> dict:
    """The JSON plan file for `ev` (``"jpipe-plan/1"``): read back by `read_plan_file`.

    Its ``mesh`` gives ``tensor`` as the largest degree and, where ranks differ,
    ``tensor_per_rank`` (`ClusterPlan.mesh`). Where the profile gives the model's
    shape, ``model_options`` names the attention and remat its memory assumes
    (`SearchResult.memory_choice`; pass the profile `plan` planned with,
    `SearchResult.profile`), for the model's config to set."""
    p = ev.plan
    why_not = _evicts_across_degrees(ev.simulation.schedule, p.ranks)
    if why_not:
        raise ValueError(f"the trainer cannot run this plan: {why_not}")
    choice = profile.memory_choice
    if choice is None and profile.shape is not None:  # the bytes as measured
        choice = MemoryChoice(profile.shape.attention, profile.shape.remat)
    for r, row in enumerate(p.ranks):
        if len({g.tensor_parallel for g in row}) > 1:
            raise ValueError(
                f"pipeline rank {r}'s replicas have tensor degrees "
                f"{[g.tensor_parallel for g in row]}; the trainer gives each rank one mesh of "
                "data x tensor devices, so its replicas need one degree"
            )
    # The hosts are listed where the ranks' degrees differ (hosts of different device counts).
    degrees = {row[0].tensor_parallel for row in p.ranks}
    per_rank = layout_kind(p.memory_layout).meshes_per_rank and len(degrees) > 1
    processes = plan_processes(p.ranks) if per_rank else None
    return {
        "format": PLAN_FORMAT,
        "model": profile.model,
        **p.to_json(),
        **({"processes": processes} if processes else {}),
        "blocks_per_stage": [sum(profile.blocks(l) for l in s) for s in p.stage_layers],
        "predicted_seconds": ev.step_seconds,
        "predicted_max_mem_bytes": ev.max_peak_bytes,
        "devices": [m.to_json() for m in ev.memory.devices(p.memory_layout)],
        **({"model_options": choice.to_json()} if choice is not None else {}),
    }


def plan_processes(ranks) -> list[dict] | None:
    """The processes that run a per-rank plan, one per host: ``[{"node", "kind", "ranks",
    "devices"}, ...]`` in launch order (process 0 first), or None where the plan's ranks
    cannot be split so.

    Under the per-rank lowering each rank's devices (its data replicas x its
    tensor group) belong to one process, and the processes hold the ranks in
    order (`jpipe.make_rank_meshes` takes devices sorted by process). So a
    process is a run of consecutive ranks on one node; a node whose ranks
    are not consecutive runs one process per run. None where a rank's
    replicas sit on different nodes.
    """
    processes: list[dict] = []
    for r, row in enumerate(ranks):
        nodes = {g.node for g in row}
        if len(nodes) != 1:
            return None
        (node,) = nodes
        devices = sum(g.tensor_parallel for g in row)
        if processes and processes[-1]["node"] == node:
            processes[-1]["ranks"].append(r)
            processes[-1]["devices"] += devices
        else:
            processes.append({"node": node, "kind": row[0].kind, "ranks": [r], "devices": devices})
    return processes


def _read_processes(d: dict, pipe: int, per_rank: tuple[int, ...], data: int, where: str):
    """A plan file's ``processes`` (`plan_processes`), checked against its mesh: the devices
    of each process, or None where the file has none."""
    given = d.get("processes")
    if given is None:
        return None
    problem = None
    if not isinstance(given, list) or not given or not all(isinstance(p, dict) for p in given):
        problem = f"must be a list of objects {{node, kind, ranks, devices}}, got {given!r}"
    else:
        for i, p in enumerate(given):
            _unknown(p, ("node", "kind", "ranks", "devices"), where, f"processes[{i}]")
        ranks = [p.get("ranks") for p in given]
        if not all(isinstance(r, list) and r for r in ranks) or [
            x for r in ranks for x in r
        ] != list(range(pipe)):
            problem = (
                f"must give each process a run of consecutive ranks, together 0 to {pipe - 1} "
                f"in order, got {ranks!r}"
            )
        else:
            for i, p in enumerate(given):
                want = sum(per_rank[r] for r in p["ranks"]) * data
                if _whole(p.get("devices"), where, f"processes[{i}].devices") != want:
                    problem = (
                        f"gives process {i} {p['devices']} devices, but its ranks {p['ranks']} "
                        f"take {want} (mesh.data x each rank's tensor degree)"
                    )
                    break
    if problem:
        raise _plan_error(where, "processes", problem)
    return tuple(p["devices"] for p in given)


def _check_model_options(options, where: str) -> None:
    """A plan file's ``model_options``, where present: the model's attention and remat."""
    from jpipe.planner.choices import ATTENTION, REMAT

    if options is None:
        return
    if not isinstance(options, dict):
        raise _plan_error(where, "model_options", f"must be an object, got {options!r}")
    _unknown(options, ("attention", "remat"), where, "model_options")
    for name, accepted in (("attention", ATTENTION), ("remat", REMAT)):
        if name in options and options[name] not in accepted:
            raise _plan_error(
                where,
                f"model_options.{name}",
                f"is {options[name]!r}; accepted: {', '.join(accepted)}",
            )


# The fields of a plan file (`plan_file` writes them all): those the trainer reads, and
# those it only checks, the planner's record of what it planned. Any other is refused.
_PLAN_FIELDS = {
    "format": "the format name, 'jpipe-plan/1'",
    "model": "the profile's model name",
    "mesh": "pipe, data, tensor (and tensor_per_rank)",
    "blocks_per_stage": "transformer blocks per stage",
    "schedule": "the schedule SPEC",
    "num_chunks": "stages per rank, or null",
    "num_microbatches": "M",
    "microbatch_size": "B",
    "global_batch": "sequences per step",
    "memory_layout": "spmd or mpmd",
    "ranks": "the device group of each rank and replica",
    "stage_layers": "the profile layers of each stage",
    "predicted_seconds": "the predicted step time",
    "predicted_max_mem_bytes": "the predicted footprint of the fullest device",
    "devices": "each device's predicted memory",
    "model_options": "the attention and remat the predicted memory assumes",
    "processes": "per-rank plans: the process (host) of each run of ranks, in launch order",
}
_MESH_FIELDS = ("pipe", "data", "tensor", "tensor_per_rank")
_GROUP_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceGroup))
_DEVICE_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceMemory))
# More devices than any machine has: a plan past it is a typo (train.py would try to
# fake that many CPU devices).
MAX_PLAN_DEVICES = 2**17


def _plan_error(where: str, field: str, problem: str) -> ValueError:
    return ValueError(f"{where}: {field} {problem}")


def _whole(value, where: str, field: str, minimum: int = 1) -> int:
    """A JSON integer of at least `minimum` (not a float, a string or a boolean)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _plan_error(
            where, field, f"must be a JSON integer of at least {minimum}, got {value!r}"
        )
    return value


def _size(value, where: str, field: str, optional: bool = False) -> float | None:
    """A finite number of bytes or seconds, at least 0 (`None` where `optional`)."""
    if value is None and optional:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise _plan_error(where, field, f"must be a number >= 0, got {value!r}")
    return float(value)


def _finite(value, where: str, field: str) -> None:
    """Refuses Infinity and NaN anywhere in the file, naming the field."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _plan_error(where, field or "the file", f"is {value}; a plan holds finite numbers")
    if isinstance(value, dict):
        for k, v in value.items():
            _finite(v, where, f"{field}.{k}" if field else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite(v, where, f"{field}[{i}]")


def _unknown(d: dict, known, where: str, field: str) -> None:
    import difflib

    for key in d:
        if key not in known:
            near = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            name = f"{field}.{key}" if field else str(key)
            raise _plan_error(
                where,
                name,
                f"is not a field of a plan file{hint} (the fields: {', '.join(known)})",
            )


def known_device_kind(kind: str) -> bool:
    """Whether jpipe knows `kind`: a device type of Sailor's profiles, or a name JAX gives
    (``cpu``, ``NVIDIA ...``, ``AMD ...``, ``TPU ...``, as measured profiles record it)."""
    from jpipe.planner.profiles import DEVICE_MEMORY

    return (
        kind in DEVICE_MEMORY
        or kind.lower() == "cpu"
        or kind.split(" ")[0]
        in (
            "NVIDIA",
            "AMD",
            "TPU",
            "Intel",
        )
    )


def _check_devices(d: dict, pipe: int, data: int, stages: int, where: str) -> None:
    """The planner's record (`ranks`, `stage_layers`, `devices`), where present, checked."""
    import warnings

    kinds = {}
    if "ranks" in d:
        ranks = d["ranks"]
        if not isinstance(ranks, list) or len(ranks) != pipe:
            raise _plan_error(where, "ranks", f"must list mesh.pipe={pipe} ranks, got {ranks!r}")
        for r, row in enumerate(ranks):
            if not isinstance(row, list) or len(row) != data:
                raise _plan_error(where, f"ranks[{r}]", f"must list mesh.data={data} device groups")
            for i, g in enumerate(row):
                field = f"ranks[{r}][{i}]"
                if not isinstance(g, dict):
                    raise _plan_error(where, field, f"must be an object, got {g!r}")
                _unknown(g, _GROUP_FIELDS, where, field)
                if not isinstance(g.get("kind"), str) or not g["kind"].strip():
                    raise _plan_error(where, f"{field}.kind", "must name a device type")
                kinds.setdefault(g["kind"], f"{field}.kind")
                for name in ("tensor_parallel", "gpus_per_node", "node"):
                    if name in g:
                        _whole(g[name], where, f"{field}.{name}", 0 if name == "node" else 1)
    if "stage_layers" in d:
        layers = d["stage_layers"]
        if (
            not isinstance(layers, list)
            or len(layers) != stages
            or not all(isinstance(s, list) for s in layers)
        ):
            raise _plan_error(
                where, "stage_layers", f"must list the layers of each of the {stages} stages"
            )
        for s, row in enumerate(layers):
            for i, l in enumerate(row):
                _whole(l, where, f"stage_layers[{s}][{i}]", 0)
    if "devices" in d:
        devices = d["devices"]
        if not isinstance(devices, list) or len(devices) != pipe * data:
            raise _plan_error(
                where,
                "devices",
                f"must list one entry per device, mesh.pipe x mesh.data = {pipe * data}",
            )
        for i, m in enumerate(devices):
            field = f"devices[{i}]"
            if not isinstance(m, dict):
                raise _plan_error(where, field, f"must be an object, got {m!r}")
            _unknown(m, _DEVICE_FIELDS, where, field)
            for name in ("rank", "replica", "kind", "footprint_bytes"):
                if name not in m:
                    raise _plan_error(where, f"{field}.{name}", "is missing")
            _whole(m["rank"], where, f"{field}.rank", 0)
            _whole(m["replica"], where, f"{field}.replica", 0)
            if m["rank"] >= pipe or m["replica"] >= data:
                raise _plan_error(
                    where,
                    field,
                    f"is rank {m['rank']} replica {m['replica']}, outside mesh.pipe={pipe} x "
                    f"mesh.data={data}",
                )
            if not isinstance(m["kind"], str) or not m["kind"].strip():
                raise _plan_error(where, f"{field}.kind", "must name a device type")
            kinds.setdefault(m["kind"], f"{field}.kind")
            _size(m["footprint_bytes"], where, f"{field}.footprint_bytes")
            for name in ("memory_bytes", "usable_bytes"):
                _size(m.get(name), where, f"{field}.{name}", optional=True)
            parts = m.get("parts", {})
            if not isinstance(parts, dict):
                raise _plan_error(where, f"{field}.parts", f"must be an object, got {parts!r}")
            for k, v in parts.items():
                _size(v, where, f"{field}.parts.{k}")
    for kind, field in kinds.items():
        if not known_device_kind(kind):
            warnings.warn(
                f"{where}: {field} {kind!r} is neither a device type of jpipe's profiles nor "
                "a name JAX gives a device (cpu, NVIDIA ..., TPU ...); the plan's memory "
                "figures are for that device, unchecked against the devices this run has",
                stacklevel=3,
            )


def read_plan_file(source: str | dict) -> TrainerSettings:
    """Reads a plan file (path or parsed JSON) into `TrainerSettings`; errors say what to fix.

    Strict: every field has its JSON type (integers are integers, not ``2.7``,
    ``true`` or ``"2"``), numbers are finite, sizes within jpipe's limits
    (`jpipe.schedule.actions.MAX_RANKS`, `MAX_ACTIONS`, `MAX_PLAN_DEVICES`), and a
    field that is not one of a plan's is refused; each error is one line
    naming the file and the field. A device kind jpipe does not know
    (`known_device_kind`) is warned about. The ``schedule`` is returned as
    written: a ``file.py:function`` runs code, which the trainer refuses from
    a plan unless told to trust it (``config.trust_plan``, docs/trust.md).
    """
    from jpipe.schedule.actions import MAX_RANKS, check_size

    if isinstance(source, str):
        d, where = read_json(source, "plan file"), source
    else:
        d, where = source, "the plan"
    if not isinstance(d, dict):
        raise ValueError(
            f"{where} is not a jpipe plan: it holds a JSON {type(d).__name__}, not an object "
            "(write one with python -m jpipe.plan ... --save plan.json)"
        )
    if d.get("format") != PLAN_FORMAT:
        raise ValueError(
            f"{where} is not a jpipe plan: 'format' is {d.get('format')!r}, not {PLAN_FORMAT!r} "
            "(write one with python -m jpipe.plan ... --save plan.json)"
        )
    _finite(d, where, "")
    _unknown(d, _PLAN_FIELDS, where, "")
    for name in ("mesh", "blocks_per_stage", "schedule", "num_microbatches", "global_batch"):
        if name not in d:
            raise ValueError(f"{where} has no field {name!r}")
    if "microbatch_size" not in d:
        raise ValueError(f"{where} has no field 'microbatch_size'")
    mesh = d["mesh"]
    if not isinstance(mesh, dict):
        raise _plan_error(where, "mesh", f"must be an object {{pipe, data, tensor}}, got {mesh!r}")
    _unknown(mesh, _MESH_FIELDS, where, "mesh")
    for name in ("pipe", "data"):
        if name not in mesh:
            raise ValueError(f"{where} has no field 'mesh.{name}'")
    pipe = _whole(mesh["pipe"], where, "mesh.pipe")
    data = _whole(mesh["data"], where, "mesh.data")
    tensor = _whole(mesh.get("tensor", 1), where, "mesh.tensor")
    blocks = d["blocks_per_stage"]
    if not isinstance(blocks, list) or not blocks:
        raise _plan_error(
            where,
            "blocks_per_stage",
            f"must be a list of whole numbers such as [3, 3], got {blocks!r}",
        )
    blocks = tuple(_whole(b, where, f"blocks_per_stage[{i}]", 0) for i, b in enumerate(blocks))
    schedule = d["schedule"]
    if not isinstance(schedule, str) or not schedule.strip():
        raise _plan_error(
            where, "schedule", f"must be a schedule SPEC (a string), got {schedule!r}"
        )
    chunks = d.get("num_chunks")
    chunks = 0 if chunks is None else _whole(chunks, where, "num_chunks")
    M = _whole(d["num_microbatches"], where, "num_microbatches")
    batch = _whole(d["global_batch"], where, "global_batch")
    mbs = _whole(d["microbatch_size"], where, "microbatch_size")
    if not isinstance(d.get("model", ""), str):
        raise _plan_error(where, "model", f"must be a string, got {d['model']!r}")
    for name in ("predicted_seconds", "predicted_max_mem_bytes"):
        if name in d:
            _size(d[name], where, name, optional=True)
    _check_model_options(d.get("model_options"), where)
    layout = d.get("memory_layout", "spmd")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"{where}: memory_layout {layout!r} is not one the trainer runs; accepted: "
            f"{', '.join(LAYOUTS)}" + _renamed(layout)
        )
    tensor_per_rank = _tensor_per_rank(mesh, pipe, tensor, layout, where)
    devices = sum(tensor_per_rank or (tensor,) * pipe) * data
    if devices > MAX_PLAN_DEVICES:
        raise _plan_error(
            where,
            "mesh",
            f"takes {devices:,} devices, more than jpipe's limit of MAX_PLAN_DEVICES="
            f"{MAX_PLAN_DEVICES:,} (jpipe.planner.plans)",
        )
    stages = len(blocks)
    if stages % pipe:
        raise ValueError(f"{where}: {stages} stages do not divide over mesh.pipe={pipe} ranks")
    if chunks and stages != pipe * chunks:
        raise _plan_error(
            where,
            "num_chunks",
            f"is {chunks} but blocks_per_stage has {stages} stages over mesh.pipe={pipe} "
            f"ranks, {stages // pipe} per rank",
        )
    try:
        check_size(pipe, M, stages // pipe)
    except ValueError as e:
        field = "mesh.pipe" if pipe > MAX_RANKS else "num_microbatches"
        raise _plan_error(where, field, f"is too large: {e}") from None
    if any(b < 1 for b in blocks):
        raise ValueError(
            f"{where}: blocks_per_stage {list(blocks)} has a stage without a transformer block; "
            "the trainer needs at least one per stage"
        )
    if M * mbs * data != batch:
        raise ValueError(
            f"{where}: num_microbatches {M} x microbatch_size {mbs} x mesh.data {data} "
            f"!= global_batch {batch}"
        )
    _check_devices(d, pipe, data, stages, where)
    processes = _read_processes(d, pipe, tensor_per_rank or (tensor,) * pipe, data, where)
    return TrainerSettings(
        pipe,
        data,
        tensor,
        blocks,
        schedule,
        chunks,
        M,
        batch,
        layout_kind(layout).name,
        tensor_per_rank,
        processes,
    )


def _tensor_per_rank(mesh: dict, pipe: int, tensor: int, layout: str, where: str):
    """``mesh.tensor_per_rank`` read and checked: a tuple where the degrees differ, `None`
    where the field is absent or gives every rank the same degree."""
    if "tensor_per_rank" not in mesh:
        return None
    given = mesh["tensor_per_rank"]
    whole = lambda t: isinstance(t, int) and not isinstance(t, bool) and t >= 1  # noqa: E731
    degrees = tuple(given) if isinstance(given, list | tuple) else ()
    if not degrees or not all(whole(t) for t in degrees):
        raise ValueError(
            f"{where}: mesh.tensor_per_rank must list one whole number of at least 1 per "
            f"pipeline rank, got {given!r}"
        )
    if len(degrees) != pipe:
        raise ValueError(
            f"{where}: mesh.tensor_per_rank gives {len(degrees)} degrees for mesh.pipe={pipe} "
            "ranks; it needs one per pipeline rank"
        )
    if max(degrees) != tensor:
        raise ValueError(
            f"{where}: mesh.tensor is {tensor} but the largest of mesh.tensor_per_rank "
            f"{list(degrees)} is {max(degrees)}; jpipe writes the largest degree as mesh.tensor"
        )
    if len(set(degrees)) == 1:
        return None
    if not layout_kind(layout).meshes_per_rank:
        raise ValueError(
            f"{where}: mesh.tensor_per_rank {list(degrees)} gives the pipeline ranks different "
            "tensor degrees, which only the per-rank lowering runs (lowering='mpmd', one mesh "
            f"per rank), but the plan's memory_layout is {layout!r}, one SPMD program with one "
            "mesh; plan again with python -m jpipe.plan --memory-layout mpmd "
            "--tensor-per-stage"
        )
    return degrees


def median_abs_error(pairs: Sequence[tuple[float, float]]) -> float:
    """Median of ``|predicted - measured| / measured`` over ``(predicted, measured)`` pairs."""
    return statistics.median(abs(p - m) / m for p, m in pairs)
