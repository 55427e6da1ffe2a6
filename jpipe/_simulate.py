"""Simulation: run a schedule as timed events and report time and memory.

Each rank runs its list in order; an action starts when its rank is free and
the actions it depends on have finished, plus the communication latency when a
dependency ran on another rank (none on the same rank). This is the earliest
start every action can have given the per-rank order, so the makespan is what
a machine that overlaps perfectly would reach.

Costs are per kind and per stage (one value for all stages or one per stage,
so mixed devices can be modelled). ``B`` defaults to ``I + W``.

Reported: makespan (first start to last end on any rank), busy time per rank,
``bubble_fraction = 1 - total busy / (ranks * makespan)``, peak live
activations per rank (a `(stage, microbatch)` is live from its ``F`` until its
``B`` or ``W`` has run), and the timeline of every action.
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
    comm: Number = 0

    def __post_init__(self):
        for name in ("F", "I", "W", "B"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
                value = getattr(self, name)
            values = value if isinstance(value, tuple) else (value,)
            for v in values:
                if v is not None and (
                    not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                ):
                    raise ValueError(f"cost {name} must be a finite non-negative number, got {v!r}")
        if not isinstance(self.comm, (int, float)) or not math.isfinite(self.comm) or self.comm < 0:
            raise ValueError(f"cost comm must be a finite non-negative number, got {self.comm!r}")

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Reads ``"F=1,I=1,W=1,B=2,comm=0"``; every key is optional."""
        kwargs = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in ("F", "I", "W", "B", "comm"):
                raise ValueError(
                    f"cannot read cost {item!r}: expected KEY=VALUE with KEY one of "
                    "F, I, W, B, comm"
                )
            try:
                kwargs[key] = float(value)
            except ValueError:
                raise ValueError(f"cost {key} must be a number, got {value!r}") from None
        return cls(**kwargs)

    def table(self, num_stages: int) -> dict[str, tuple[float, ...]]:
        """Per-stage costs, `{kind: (cost of stage 0, cost of stage 1, ...)}`."""

        def per_stage(name, value):
            if isinstance(value, tuple):
                if len(value) != num_stages:
                    raise ValueError(
                        f"cost {name} has {len(value)} values but the schedule has "
                        f"{num_stages} stages"
                    )
                return tuple(float(v) for v in value)
            return (float(value),) * num_stages

        f = per_stage("F", self.F)
        i = per_stage("I", self.I)
        w = per_stage("W", self.W)
        b = tuple(x + y for x, y in zip(i, w)) if self.B is None else per_stage("B", self.B)
        return {"F": f, "I": i, "W": w, "B": b}


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
        }


def simulate(schedule: Schedule, costs: Costs | None = None) -> Simulation:
    """Runs `schedule` (validated first) as timed events with `costs`."""
    costs = costs or Costs()
    info = analyze(schedule)
    S, M = info.num_stages, info.num_microbatches
    cost = costs.table(S)
    comm = float(costs.comm)
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
                ready = max(ready, end_f[k - M] + (comm if owner[s - 1] != r else 0.0))
        elif kind == "W":
            ready = max(ready, end_i[k])
        else:
            ready = max(ready, end_f[k])
            if s < S - 1:
                ready = max(ready, end_g[k + M] + (comm if owner[s + 1] != r else 0.0))
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
    )
