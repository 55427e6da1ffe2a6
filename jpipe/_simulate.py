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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from jpipe._schedule import Action, Schedule
from jpipe._validate import analyze

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
    """

    F: PerStage = 1
    I: PerStage = 1
    W: PerStage = 1
    B: PerStage | None = None
    comm: PerStage = 0

    def __post_init__(self):
        _check_values(self, ("F", "I", "W", "B", "comm"), "cost", allow_none=True)

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Reads ``"F=1,I=1,W=1,B=2,comm=0"``; every key is optional."""
        return cls(**_parse_items(text, ("F", "I", "W", "B", "comm"), "cost", "a number"))

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
    """

    activation: PerStage = 0
    carry: PerStage = 0
    params: PerStage = 0

    def __post_init__(self):
        _check_values(self, ("activation", "carry", "params"), "size")

    @classmethod
    def parse(cls, text: str) -> Sizes:
        """Reads ``"activation=1e6,carry=5e5,params=4e8"``; every key is optional."""
        keys = ("activation", "carry", "params")
        return cls(**_parse_items(text, keys, "size", "a number of bytes"))

    def table(self, num_stages: int) -> dict[str, tuple[float, ...]]:
        """Per-stage sizes, `{name: (bytes of stage 0, ...)}`."""
        return {
            name: _per_stage("size", name, getattr(self, name), num_stages)
            for name in ("activation", "carry", "params")
        }


def peak_bytes(schedule: Schedule, sizes: Sizes, num_stages: int) -> tuple[float, ...]:
    """Each rank's peak bytes: its stages' parameters plus its most live activations and carries."""
    size = sizes.table(num_stages)
    peaks = []
    for r in range(schedule.num_ranks):
        live = peak = 0.0
        for a in schedule.actions(r):
            s = a.stage
            if a.kind == "F":
                live += size["activation"][s]
            elif a.kind == "B":
                live -= size["activation"][s]
            elif a.kind == "I":
                live += size["carry"][s]
            else:  # W: the residuals and the carry both go
                live -= size["carry"][s] + size["activation"][s]
            peak = max(peak, live)
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

    @functools.cached_property
    def timeline(self) -> tuple[Event, ...]:
        """Every plain action with its start and end, rank by rank in list order."""
        return tuple(
            Event(r, a, self.starts[r][i], self.ends[r][i])
            for r in range(self.schedule.num_ranks)
            for i, a in enumerate(self.schedule.actions(r))
        )

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
            **({} if self.peak_bytes is None else {"peak_bytes": list(self.peak_bytes)}),
        }


def simulate(
    schedule: Schedule, costs: Costs | None = None, sizes: Sizes | None = None
) -> Simulation:
    """Runs `schedule` (validated first) as timed events with `costs`.

    With `sizes`, the result also has each rank's `peak_bytes` (see the module
    docstring); without, it is `None`.
    """
    costs = costs or Costs()
    info = analyze(schedule)
    S, M = info.num_stages, info.num_microbatches
    cost = costs.table(S)
    comm = costs.comm_table(S)
    owner = info.stage_to_rank
    rows = [schedule.actions(r) for r in range(schedule.num_ranks)]

    end_f = [0.0] * (S * M)
    end_g = [0.0] * (S * M)  # end of the B or I of (s, m)
    end_i = [0.0] * (S * M)
    free = [0.0] * len(rows)
    busy = [0.0] * len(rows)
    starts = [[0.0] * len(row) for row in rows]
    ends = [[0.0] * len(row) for row in rows]
    first_start = None
    for r, i in info.order:
        a = rows[r][i]
        s, m, kind = a.stage, a.microbatch, a.kind
        k = s * M + m
        ready = free[r]
        if kind == "F":
            if s > 0:
                ready = max(ready, end_f[k - M] + (comm[s - 1] if owner[s - 1] != r else 0.0))
        elif kind == "W":
            ready = max(ready, end_i[k])
        else:
            ready = max(ready, end_f[k])
            if s < S - 1:
                ready = max(ready, end_g[k + M] + (comm[s] if owner[s + 1] != r else 0.0))
        duration = cost[kind][s]
        finish = ready + duration
        starts[r][i], ends[r][i] = ready, finish
        free[r] = finish
        busy[r] += duration
        if first_start is None or ready < first_start:
            first_start = ready
        if kind == "F":
            end_f[k] = finish
        elif kind == "W":
            pass
        else:
            end_g[k] = finish
            if kind == "I":
                end_i[k] = finish
    makespan = max(free) - (first_start or 0.0)
    total = len(rows) * makespan
    bubble = 1.0 - sum(busy) / total if total > 0 else 0.0
    return Simulation(
        schedule=schedule,
        costs=costs,
        makespan=makespan,
        busy=tuple(busy),
        bubble_fraction=bubble,
        peak_activations=info.peak_live,
        starts=tuple(map(tuple, starts)),
        ends=tuple(map(tuple, ends)),
        sizes=sizes,
        peak_bytes=None if sizes is None else peak_bytes(schedule, sizes, S),
    )
