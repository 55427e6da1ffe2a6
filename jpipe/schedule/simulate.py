"""Simulation: run a schedule as timed events and report time and memory.

Each rank runs its list in order; an action starts when its rank is free and
the actions it depends on have finished, plus the communication latency when a
dependency ran on another rank (none on the same rank). This is the earliest
start every action can have given the per-rank order, so the makespan is what
a machine that overlaps perfectly would reach.

Costs are per kind and per stage (one value for all stages or one per stage,
so mixed devices can be modelled), and may be given per rank too (a sequence
of `Costs`, one per rank, `rank_costs`: where a replicated stage's copies sit
on devices of different speeds). ``B`` defaults to ``I + W``. The transfer
latency ``comm`` is one value, or one per boundary between stage ``s`` and
``s + 1`` (links differ on a mixed cluster).

Reported: makespan (first start to last end on any rank), busy time per rank,
``bubble_fraction = 1 - total busy / (ranks * makespan)``, peak live
activations per rank (a `(stage, microbatch)` is live from its ``F`` until its
``B`` or ``W`` has run), and the timeline of every action.

Memory in bytes (optional, given as `Sizes`): each stage holds its ``params``
bytes for the whole step; the ``activation`` (residual) bytes of one microbatch
are live from its ``F`` until its ``B`` or ``W`` (as for the live activation
count: jpipe's ``W`` piece reads the residuals too); an ``I`` adds its
``carry`` bytes (what it hands ``W``), live until the ``W``. A rank runs
its list in order, so walking the list gives its live bytes after every action;
the maximum plus the parameters of its stages is the rank's ``peak_bytes``.

Memory actions (`jpipe.schedule.actions.MEMORY_KINDS`) change both figures.

Time. ``FC`` costs a forward and ``RECOMPUTE`` costs a forward too (or
`Costs.recompute`), on the rank's compute like any action. A transfer runs
beside the compute: ``EVICT`` and ``LOAD`` on the rank's link to its partner
(`Costs.evict`, `Costs.load`), ``OFFLOAD_START`` and ``RELOAD_START`` on its
copy engine to the host (`Costs.offload`, `Costs.reload`), one transfer at a
time on each, beginning when the rank reaches it in its list (when the action
before it ends), a load or reload no earlier than the eviction or offload
ended. The rank goes on computing meanwhile: an ``OFFLOAD_END`` or
``RELOAD_END`` waits (taking no time itself) for its copy, and whatever reads
residuals (``RECOMPUTE``, ``B``, ``I``, ``W``) waits for a ``LOAD`` to land.
So the work between a start and its end, or between a ``LOAD`` and the
reader, hides the transfer. Transfers are on the timeline, not in ``busy``.

Bytes are then counted in time, not along the list: an ``FC`` holds the
stage's `Sizes.input` bytes until its ``RECOMPUTE`` ends, which holds the
residuals from its start; an evicted microbatch's residuals stay on the rank
until the eviction lands and are held by the partner from the moment it
begins until the ``LOAD`` back has landed, which takes the rank's buffer when
it begins (so both count while a transfer is in flight); an offload frees the
device copy at its ``OFFLOAD_END``, a reload takes it again when its copy begins.
What a rank holds for a partner is in its ``peak_bytes``;
``peak_bytes_without`` is the same figure for the schedule without its memory
actions (`Schedule.without_memory_actions`). Host memory is not counted.

Replicated stages (a stage on several ranks, as in Chimera): each rank that
holds the stage holds its ``params`` bytes, and once every one of them has
run its last backward of the stage (its last ``B`` or ``W``), the stage's
gradients are summed over them in `Costs.sync` time, beside the compute
(`Simulation.syncs`; each stage's sum on its own, none waiting for
another's). The makespan runs to the last sum's end.
"""

from __future__ import annotations

import dataclasses
import functools

from jpipe.schedule.actions import Action, Schedule
from jpipe.schedule.events import (
    Costs,
    CostsGiven,
    PerStage,
    _check_values,
    _live_events,
    _parse_items,
    _per_stage,
    _run,
    rank_costs,
)
from jpipe.schedule.validate import _rows, analyze


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Bytes each stage holds, one value for all stages or one per stage.

    Attributes:
      activation: residuals one microbatch keeps from its ``F`` until its ``B``
        (or ``W``, which reads them too).
      carry: what an ``I`` hands its ``W``, live from the ``I`` until the ``W``.
      params: bytes held for the whole step (weights, gradients, optimizer state).
      input: what an ``FC`` keeps of one microbatch (the stage's input) until
        its ``RECOMPUTE`` has rebuilt the residuals.
    """

    activation: PerStage = 0
    carry: PerStage = 0
    params: PerStage = 0
    input: PerStage = 0

    _KEYS = ("activation", "carry", "params", "input")

    def __post_init__(self):
        _check_values(self, self._KEYS, "size")

    @classmethod
    def parse(cls, text: str) -> Sizes:
        """Reads ``"activation=1e6,carry=5e5,params=4e8,input=2e5"``; every key is optional."""
        return cls(**_parse_items(text, cls._KEYS, "size", "a number of bytes"))

    def table(self, num_stages: int) -> dict[str, tuple[float, ...]]:
        """Per-stage sizes, `{name: (bytes of stage 0, ...)}`."""
        return {
            name: _per_stage("size", name, getattr(self, name), num_stages) for name in self._KEYS
        }


def peak_bytes(schedule: Schedule, sizes: Sizes, num_stages: int) -> tuple[float, ...]:
    """Each rank's peak bytes: its stages' parameters plus its most live activations and carries."""
    size = sizes.table(num_stages)
    return tuple(
        peak + sum(size["params"][s] for s in schedule.stages_of(r))
        for r, peak in enumerate(_list_peaks(schedule, size))
    )


def live_peaks(schedule: Schedule, sizes: Sizes, costs: Costs | None = None) -> tuple[float, ...]:
    """Each rank's most live values at once, without its parameters: residuals, carries,
    kept inputs and what it holds for a partner (module docstring), the figure a
    lowering's byte model takes as each rank's values (`jpipe.lower.bytes.RankBytes`).

    Counted in time, run with `costs` (unit costs if None), where `schedule` has memory
    actions; along each rank's list otherwise, where no costs change it.
    """
    if schedule.has_memory_actions:
        timed = _timed(schedule, costs or Costs())[:3]
        return tuple(_peaks(_events_in_time(schedule, sizes, timed)))
    return tuple(_list_peaks(schedule, sizes.table(schedule.num_stages)))


def _list_peaks(schedule: Schedule, size: dict) -> list[float]:
    """Each rank's most live activations and carries, walking its list (no memory actions);
    `size` is `Sizes.table`."""
    act, carry = size["activation"], size["carry"]
    peaks = []
    for row in _rows(schedule):
        live = peak = 0.0
        for a in row:
            s, kind = a.stage, a.kind
            if kind == "F":
                live += act[s]
            elif kind == "B":
                live -= act[s]
            elif kind == "I":
                live += carry[s]
            else:  # W: the residuals and the carry both go
                live -= carry[s] + act[s]
            if live > peak:
                peak = live
        peaks.append(peak)
    return peaks


@dataclasses.dataclass(frozen=True)
class Event:
    """One action on the timeline."""

    rank: int
    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Sync:
    """A replicated stage's gradients summed over the ranks that hold it."""

    stage: int
    ranks: tuple[int, ...]
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Simulation:
    """What `simulate` reports (see the module docstring)."""

    schedule: Schedule
    costs: CostsGiven  # one Costs, or one per rank
    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    peak_activations: tuple[int, ...]
    starts: tuple[tuple[float, ...], ...] = dataclasses.field(repr=False)
    ends: tuple[tuple[float, ...], ...] = dataclasses.field(repr=False)
    sizes: Sizes | None = None
    peak_bytes: tuple[float, ...] | None = None
    peak_bytes_without: tuple[float, ...] | None = None
    syncs: tuple[Sync, ...] = ()

    @functools.cached_property
    def timeline(self) -> tuple[Event, ...]:
        """Every plain action with its start and end, rank by rank in list order."""
        return tuple(
            Event(r, a, self.starts[r][i], self.ends[r][i])
            for r in range(self.schedule.num_ranks)
            for i, a in enumerate(self.schedule.actions(r))
        )

    def peak_activations_text(self) -> str:
        """Each rank's peak live activations in words that say what is counted.

        `peak_activations` counts live ``(stage, microbatch)`` pairs. With one
        stage a rank that is microbatches of the rank's layers; with ``V``
        stages a rank each pair is one stage's share, so the text also gives
        the count over ``V``: microbatches of all the rank's layers, exact
        when its stages are of one size (as `jpipe.models.split_layers`
        makes them). So interleaved 1F1B with 4 stages a rank reads ``[18,
        17, 18, 19] (stage, microbatch) pairs ... [4.5, 4.25, 4.5, 4.75]``,
        not 18 microbatches.
        """
        s = self.schedule
        peaks = list(self.peak_activations)
        held = {len(s.stages_of(r)) for r in range(s.num_ranks)} - {0}
        if s.replicated:  # a rank's stages include copies: no share of the model to count in
            return f"peak live activations per rank {peaks} (stage, microbatch) pairs"
        if held <= {1}:
            return f"peak live activations per rank {peaks} microbatches"
        text = f"peak live activations per rank {peaks} (stage, microbatch) pairs"
        if len(held) == 1:
            (V,) = held
            whole = ", ".join(f"{p / V:g}" for p in peaks)
            text += (
                f"; with {V} stages a rank, [{whole}] microbatches of a rank's layers "
                "(if its stages are of one size)"
            )
        return text

    def summary(self) -> dict:
        """The figures as plain JSON-ready values."""
        return {
            "schedule": self.schedule.name,
            "ranks": self.schedule.num_ranks,
            "stages": self.schedule.num_stages,
            "microbatches": self.schedule.num_microbatches,
            **({"slices": list(self.schedule.slices)} if self.schedule.slices else {}),
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "busy": list(self.busy),
            "peak_activations": list(self.peak_activations),
            **(
                {"syncs": [{**dataclasses.asdict(x), "ranks": list(x.ranks)} for x in self.syncs]}
                if self.syncs
                else {}
            ),
            **(
                {}
                if self.peak_bytes is None
                else {
                    "peak_bytes": list(self.peak_bytes),
                    "peak_bytes_without_memory_actions": list(self.peak_bytes_without),
                }
            ),
        }


def simulate(
    schedule: Schedule, costs: CostsGiven | None = None, sizes: Sizes | None = None
) -> Simulation:
    """Runs `schedule` (validated first) as timed events with `costs` (one `Costs`, or
    one per rank: `jpipe.schedule.events.rank_costs`).

    With `sizes`, the result also has each rank's `peak_bytes` (see the module
    docstring), and `peak_bytes_without`, the same for the schedule without its
    memory actions; without `sizes`, both are `None`.
    """
    costs = costs or Costs()
    return _simulation(schedule, costs, _timed(schedule, costs), sizes)


def _simulation(
    schedule: Schedule, costs: CostsGiven, timed, sizes: Sizes | None = None
) -> Simulation:
    """`simulate(schedule, costs, sizes)` from its run in time (`timed`, `_timed`'s result
    with these costs), for a caller that ran it already (the search's walk)."""
    info = analyze(schedule)
    S, M = info.num_stages, info.num_microbatches
    rows = info.rows
    starts, ends, issue, busy, makespan = timed
    total = len(rows) * makespan
    bubble = 1.0 - sum(busy) / total if total > 0 else 0.0
    peaks = plain = None
    if schedule.has_memory_actions:  # counted in time (the analysis's is never read)
        ones = ((1.0,) * S, (0.0,) * S, (0.0,) * S)
        events = _live_events(rows, starts, ends, issue, S, M, len(rows), *ones)
        peak_live = tuple(int(p) for p in _peaks(events))
        if sizes is not None:
            peaks = _peak_bytes_in_time(schedule, sizes, (starts, ends, issue))
            plain = peak_bytes(schedule.without_memory_actions(), sizes, S)
    else:
        peak_live = info.peak_live
        if sizes is not None:
            peaks = plain = peak_bytes(schedule, sizes, S)
    return Simulation(
        schedule=schedule,
        costs=costs,
        makespan=makespan,
        busy=tuple(busy),
        bubble_fraction=bubble,
        peak_activations=peak_live,
        starts=tuple(map(tuple, starts)),
        ends=tuple(map(tuple, ends)),
        sizes=sizes,
        peak_bytes=peaks,
        peak_bytes_without=plain,
        syncs=_syncs(schedule, ends, costs),
    )


def _timed(schedule: Schedule, costs: CostsGiven):
    """`schedule` (validated) run in time: `(starts, ends, issue, busy, makespan)` (`_run`),
    before the figures `simulate` derives from them. What the tick planner and the
    search's walk read of a simulation."""
    info = analyze(schedule)
    S, M = info.num_stages, info.num_microbatches
    starts, ends, issue, busy = _run(info.rows, info.order, S, M, info.key_rank, costs)
    first_start = min((min(row) for row in starts if row), default=0.0)
    last_end = max((max(row) for row in ends if row), default=0.0)
    if schedule.replicated:
        last_end = max([last_end] + [x.end for x in _syncs(schedule, ends, costs)])
    return starts, ends, issue, busy, last_end - first_start


def _syncs(schedule: Schedule, ends, costs: CostsGiven) -> tuple[Sync, ...]:
    """Each replicated stage's gradient sum: it starts when every rank that holds the
    stage has ended its last backward of it (``B`` or ``W``), and takes `Costs.sync`."""
    if not schedule.replicated:
        return ()
    info = analyze(schedule)
    sync = rank_costs(costs, len(info.rows))[0].sync_table(info.num_stages)
    done = [0.0] * info.num_stages
    for r, row in enumerate(info.rows):
        for i, a in enumerate(row):
            if a.kind in ("B", "W") and ends[r][i] > done[a.stage]:
                done[a.stage] = ends[r][i]
    return tuple(
        Sync(s, ranks, done[s], done[s] + sync[s])
        for s, ranks in enumerate(schedule.stage_ranks)
        if len(ranks) > 1
    )


def _peak_bytes_in_time(schedule: Schedule, sizes: Sizes, timed) -> tuple[float, ...]:
    """`simulate(...).peak_bytes` of a schedule with memory actions, from its run in time
    (`timed`: the starts, ends and issue times of `_timed`), alone."""
    size = sizes.table(schedule.num_stages)
    return tuple(
        p + sum(size["params"][s] for s in schedule.stages_of(r))
        for r, p in enumerate(_peaks(_events_in_time(schedule, sizes, timed)))
    )


def _events_in_time(schedule: Schedule, sizes: Sizes, timed):
    """`_live_events` of a schedule run in time (`timed`: `_timed`'s starts, ends and issue
    times) with `sizes`' bytes."""
    info = analyze(schedule)
    S, M, rows = info.num_stages, info.num_microbatches, info.rows
    starts, ends, issue = timed
    size = sizes.table(S)
    return _live_events(
        rows, starts, ends, issue, S, M, len(rows),
        size["activation"], size["input"], size["carry"],
    )  # fmt: skip


def _start_times(schedule: Schedule, costs: Costs) -> list[list[float]]:
    """`simulate(schedule, costs).starts` alone (the tick planner needs only these)."""
    info = analyze(schedule)
    S, M = info.num_stages, info.num_microbatches
    return _run(info.rows, info.order, S, M, info.key_rank, costs)[0]


def _peaks(events) -> list[float]:
    """The most live at once on each rank, from `_live_events`."""
    peaks = []
    for row in events:
        live = peak = 0.0
        for _, delta, _ in row:
            live += delta
            peak = max(peak, live)
        peaks.append(peak)
    return peaks
