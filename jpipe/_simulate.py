"""Simulation: run a schedule as timed events and report time and memory.

Each rank runs its list in order; an action starts when its rank is free and
the actions it depends on have finished, plus the communication latency when a
dependency ran on another rank (none on the same rank). This is the earliest
start every action can have given the per-rank order, so the makespan is what
a machine that overlaps perfectly would reach.

Costs are per kind and per stage (one value for all stages or one per stage,
so mixed devices can be modelled). ``B`` defaults to ``I + W``. The transfer
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

Memory actions (`jpipe._schedule.MEMORY_KINDS`) change both figures.

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
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence

from jpipe._schedule import Action, Schedule
from jpipe._validate import _rows, analyze

Number = float | int
PerStage = Number | Sequence[Number]


def _check_values(obj, names: tuple[str, ...], word: str, allow_none: bool = False) -> None:
    """Lists become tuples; every value must be finite and non-negative (or None, if allowed)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, list):
            value = tuple(value)
            object.__setattr__(obj, name, value)
        for v in value if isinstance(value, tuple) else (value,):
            if (v is not None or not allow_none) and (
                not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
            ):
                raise ValueError(f"{word} {name} must be a finite non-negative number, got {v!r}")


def _parse_items(text: str, keys: tuple[str, ...], word: str, unit: str) -> dict[str, float]:
    """``"K=V,K=V"`` into ``{K: float(V)}``, refusing unknown keys and non-numbers."""
    kwargs = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in keys:
            raise ValueError(
                f"cannot read {word} {item!r}: expected KEY=VALUE with KEY one of {', '.join(keys)}"
            )
        try:
            kwargs[key] = float(value)
        except ValueError:
            raise ValueError(f"{word} {key} must be {unit}, got {value!r}") from None
    return kwargs


def _per_stage(word: str, name: str, value, num_stages: int) -> tuple[float, ...]:
    """One value per stage, from one value for all or a tuple of exactly `num_stages`."""
    if isinstance(value, tuple):
        if len(value) != num_stages:
            raise ValueError(
                f"{word} {name} has {len(value)} values but the schedule has {num_stages} stages"
            )
        return tuple(float(v) for v in value)
    return (float(value),) * num_stages


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time each kind of action takes, one value for all stages or one per stage.

    Attributes:
      F, I, W: forward, input-gradient and weight-gradient costs.
      B: full-backward cost; `None` means ``I + W``.
      comm: latency of a transfer between two different ranks.
      recompute: a ``RECOMPUTE``'s cost; `None` means ``F`` (an ``FC`` costs ``F``).
      evict, load: moving one microbatch's residuals to the partner and back
        (`None` for `load` means `evict`); they run beside the compute.
      offload, reload: copying them to the host and back (`None` for
        `reload` means `offload`); beside the compute too.
    """

    F: PerStage = 1
    I: PerStage = 1
    W: PerStage = 1
    B: PerStage | None = None
    comm: PerStage = 0
    recompute: PerStage | None = None
    evict: PerStage = 0
    load: PerStage | None = None
    offload: PerStage = 0
    reload: PerStage | None = None

    _KEYS = ("F", "I", "W", "B", "comm", "recompute", "evict", "load", "offload", "reload")

    def __post_init__(self):
        _check_values(self, self._KEYS, "cost", allow_none=True)

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Reads ``"F=1,I=1,W=1,B=2,comm=0"`` (and the memory actions' keys); all optional."""
        return cls(**_parse_items(text, cls._KEYS, "cost", "a number"))

    def memory_table(self, num_stages: int) -> dict[str, tuple[float, ...]]:
        """Per-stage costs of the memory actions, `{kind: (stage 0, ...)}`.

        ``FC`` and ``RECOMPUTE`` run on the compute; the transfers
        (``EVICT``, ``LOAD``, ``OFFLOAD_START``, ``RELOAD_START``) beside it; the
        ends take no time of their own.
        """

        def per_stage(name, value):
            return _per_stage("cost", name, value, num_stages)

        f = per_stage("F", self.F)
        evict = per_stage("evict", self.evict)
        offload = per_stage("offload", self.offload)
        zero = (0.0,) * num_stages
        return {
            "FC": f,
            "RECOMPUTE": f if self.recompute is None else per_stage("recompute", self.recompute),
            "EVICT": evict,
            "LOAD": evict if self.load is None else per_stage("load", self.load),
            "OFFLOAD_START": offload,
            "RELOAD_START": offload if self.reload is None else per_stage("reload", self.reload),
            "OFFLOAD_END": zero,
            "RELOAD_END": zero,
        }

    def table(self, num_stages: int) -> dict[str, tuple[float, ...]]:
        """Per-stage costs, `{kind: (cost of stage 0, cost of stage 1, ...)}`."""

        def per_stage(name, value):
            return _per_stage("cost", name, value, num_stages)

        f = per_stage("F", self.F)
        i = per_stage("I", self.I)
        w = per_stage("W", self.W)
        b = tuple(x + y for x, y in zip(i, w)) if self.B is None else per_stage("B", self.B)
        return {"F": f, "I": i, "W": w, "B": b}

    def comm_table(self, num_stages: int) -> tuple[float, ...]:
        """Transfer latency across each boundary, stage ``s`` to ``s + 1`` (``S - 1`` values)."""
        if isinstance(self.comm, tuple):
            if len(self.comm) != num_stages - 1:
                raise ValueError(
                    f"cost comm has {len(self.comm)} values but a schedule of {num_stages} "
                    f"stages has {num_stages - 1} boundaries"
                )
            return tuple(float(v) for v in self.comm)
        return (float(self.comm),) * max(num_stages - 1, 0)


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
    act, carry = size["activation"], size["carry"]
    peaks = []
    for r, row in enumerate(_rows(schedule)):
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
        peaks.append(peak + sum(size["params"][s] for s in schedule.stages_of(r)))
    return tuple(peaks)


@dataclasses.dataclass(frozen=True)
class Event:
    """One action on the timeline."""

    rank: int
    action: Action
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Simulation:
    """What `simulate` reports (see the module docstring)."""

    schedule: Schedule
    costs: Costs
    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    peak_activations: tuple[int, ...]
    starts: tuple[tuple[float, ...], ...] = dataclasses.field(repr=False)
    ends: tuple[tuple[float, ...], ...] = dataclasses.field(repr=False)
    sizes: Sizes | None = None
    peak_bytes: tuple[float, ...] | None = None
    peak_bytes_without: tuple[float, ...] | None = None

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
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "busy": list(self.busy),
            "peak_activations": list(self.peak_activations),
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
    schedule: Schedule, costs: Costs | None = None, sizes: Sizes | None = None
) -> Simulation:
    """Runs `schedule` (validated first) as timed events with `costs`.

    With `sizes`, the result also has each rank's `peak_bytes` (see the module
    docstring), and `peak_bytes_without`, the same for the schedule without its
    memory actions; without `sizes`, both are `None`.
    """
    costs = costs or Costs()
    info = analyze(schedule)
    S, M = info.num_stages, info.num_microbatches
    rows = info.rows
    starts, ends, issue, busy, makespan = _timed(schedule, costs)
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
    )


def _timed(schedule: Schedule, costs: Costs):
    """`schedule` (validated) run in time: `(starts, ends, issue, busy, makespan)` (`_run`),
    before the figures `simulate` derives from them. What the tick planner and the
    search's walk read of a simulation."""
    info = analyze(schedule)
    S, M = info.num_stages, info.num_microbatches
    starts, ends, issue, busy = _run(info.rows, info.order, S, M, info.stage_to_rank, costs)
    first_start = min((min(row) for row in starts if row), default=0.0)
    last_end = max((max(row) for row in ends if row), default=0.0)
    return starts, ends, issue, busy, last_end - first_start


def _peak_bytes_in_time(schedule: Schedule, sizes: Sizes, timed) -> tuple[float, ...]:
    """`simulate(...).peak_bytes` of a schedule with memory actions, from its run in time
    (`timed`: the starts, ends and issue times of `_timed`), alone."""
    info = analyze(schedule)
    S, M, rows = info.num_stages, info.num_microbatches, info.rows
    starts, ends, issue = timed
    size = sizes.table(S)
    events = _live_events(
        rows, starts, ends, issue, S, M, len(rows),
        size["activation"], size["input"], size["carry"],
    )  # fmt: skip
    return tuple(
        p + sum(size["params"][s] for s in schedule.stages_of(r))
        for r, p in enumerate(_peaks(events))
    )


def _start_times(schedule: Schedule, costs: Costs) -> list[list[float]]:
    """`simulate(schedule, costs).starts` alone (the tick planner needs only these)."""
    info = analyze(schedule)
    S, M = info.num_stages, info.num_microbatches
    return _run(info.rows, info.order, S, M, info.stage_to_rank, costs)[0]


def _run(rows, order, S: int, M: int, owner, costs: Costs):
    """Times every action in `order` (a dependency order, `Analysis.order`).

    Returns `(starts, ends, issue, busy)`: per rank, each action's start and end
    (a transfer's span for the transfers), the time its rank reached it in its
    list, and the rank's busy (compute) time. See the module docstring.
    """
    cost = costs.table(S)
    comm = costs.comm_table(S)
    if any(a.kind not in cost for row in rows for a in row):
        cost = {**cost, **costs.memory_table(S)}
    R = len(rows)
    end_f = [0.0] * (S * M)
    end_g = [0.0] * (S * M)  # end of the B or I of (s, m)
    end_i = [0.0] * (S * M)
    readable = [0.0] * (S * M)  # when the residuals can be read on their rank
    away = [0.0] * (S * M)  # when the eviction or offload of (s, m) ended
    free = [0.0] * R  # the rank's compute (and its place in its list)
    link = [0.0] * R  # its transfers to and from its partner
    host = [0.0] * R  # its copies to and from the host
    busy = [0.0] * R
    starts = [[0.0] * len(row) for row in rows]
    ends = [[0.0] * len(row) for row in rows]
    issue = [[0.0] * len(row) for row in rows]
    last = S - 1
    for r, i in order:
        a = rows[r][i]
        s, kind = a.stage, a.kind
        k = s * M + a.microbatch
        ready = issue[r][i] = free[r]
        duration = cost[kind][s]
        # when it can start, and what its end makes ready
        if kind == "F" or kind == "FC":
            if s > 0:
                after = end_f[k - M] + (comm[s - 1] if owner[s - 1] != r else 0.0)
                if after > ready:
                    ready = after
            finish = ready + duration
            free[r] = finish
            busy[r] += duration
            end_f[k] = readable[k] = finish
        elif kind == "B" or kind == "I":
            ready = max(ready, end_f[k], readable[k])
            if s < last:
                ready = max(ready, end_g[k + M] + (comm[s] if owner[s + 1] != r else 0.0))
            finish = ready + duration
            free[r] = finish
            busy[r] += duration
            end_g[k] = finish
            if kind == "I":
                end_i[k] = finish
        elif kind == "W":
            ready = max(ready, end_i[k], readable[k])
            finish = ready + duration
            free[r] = finish
            busy[r] += duration
        elif kind == "RECOMPUTE":
            ready = max(ready, readable[k])
            finish = ready + duration
            free[r] = finish
            busy[r] += duration
            readable[k] = finish
        elif kind == "EVICT" or kind == "LOAD":
            if kind == "EVICT":
                ready = max(ready, link[r], 0.0)
                finish = away[k] = ready + duration
            else:
                ready = max(ready, link[r], away[k])
                finish = readable[k] = ready + duration
            link[r] = finish
        elif kind == "OFFLOAD_START" or kind == "RELOAD_START":
            if kind == "OFFLOAD_START":
                ready = max(ready, host[r], 0.0)
                finish = away[k] = ready + duration
            else:
                ready = max(ready, host[r], away[k])
                finish = readable[k] = ready + duration
            host[r] = finish
        else:  # OFFLOAD_END, RELOAD_END: the rank waits for its copy
            ready = max(ready, away[k] if kind == "OFFLOAD_END" else readable[k])
            finish = free[r] = ready + duration
        starts[r][i], ends[r][i] = ready, finish
    return starts, ends, issue, busy


def _live_events(rows, starts, ends, issue, S, M, R, act, inp, carry):
    """Per rank, its changes of live bytes in time order: `(key, delta, (rank, index))`.

    `act`, `inp` and `carry` give each stage's residual, kept-input and carry
    sizes. The rank's own changes are ordered as its list runs them; at one
    instant what it takes for a partner comes before them and what it gives
    back after them (the larger count, where times tie). See the module docstring.
    """
    events: list[list] = [[] for _ in range(R)]
    # at a start: (start, 1, i, 0); at an end: (end, 1, i, 1); a partner's (t, 0 or 2, r, i)
    for r, row in enumerate(rows):
        add = events[r].append
        t0s, t1s = starts[r], ends[r]
        for i, a in enumerate(row):
            s, kind = a.stage, a.kind
            if kind == "F":
                add(((t0s[i], 1, i, 0), act[s], (r, i)))
            elif kind == "W":
                add(((t1s[i], 1, i, 1), -act[s] - carry[s], (r, i)))
            elif kind == "I":
                add(((t0s[i], 1, i, 0), carry[s], (r, i)))
            elif kind == "B":
                add(((t1s[i], 1, i, 1), -act[s], (r, i)))
            elif kind == "FC":
                add(((t0s[i], 1, i, 0), inp[s], (r, i)))
            elif kind == "RECOMPUTE":
                add(((t0s[i], 1, i, 0), act[s], (r, i)))
                add(((t1s[i], 1, i, 1), -inp[s], (r, i)))
            elif kind == "EVICT":
                add(((t1s[i], 1, i, 1), -act[s], (r, i)))
                events[a.partner].append(((t0s[i], 0, r, i), act[s], (r, i)))
            elif kind == "LOAD":
                add(((t0s[i], 1, i, 0), act[s], (r, i)))
                events[a.partner].append(((t1s[i], 2, r, i), -act[s], (r, i)))
            elif kind == "OFFLOAD_END":
                add(((t1s[i], 1, i, 1), -act[s], (r, i)))
            elif kind == "RELOAD_START":
                add(((t0s[i], 1, i, 0), act[s], (r, i)))
    first = operator.itemgetter(0)
    for row in events:
        row.sort(key=first)
    return events


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
