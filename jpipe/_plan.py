"""Planning: from a validated schedule to a lock-step table and buffer slots.

The compiled program runs in lock-step ticks: in each tick every rank runs at
most one piece of work, then all ranks meet at the tick's transfers to their
neighbours. A piece is an ``F``, an ``I`` or a ``W``; a full backward ``B`` runs
as its ``I`` part in one tick and its ``W`` part in the next, on the same rank,
with nothing recomputed (the split is exact, see `jpipe._stage`).

Why ticks of one piece: in a transformer stage a forward, an input-gradient
and a weight-gradient pass cost about the same (one pass over the weights
each), so ranks that run different pieces in the same tick wait little for
each other, and a transfer costs one tick, as in the event simulation. The
tick of every piece is exactly its start time in `jpipe.simulate` with unit
costs (F = I = W = 1, B = 2, no latency): the compiled program follows the
simulated timeline, and each rank keeps its list order, so the live
activations on every rank are what the simulator reports.

`make_plan` then assigns buffer slots. Every value that must outlive a tick
lives in a slot of one of three arenas:

- ``io``: an activation or a gradient that arrived from a neighbour (or was
  handed over on the same rank), from the end of the tick it was sent until
  the tick that consumes it. Nothing is overwritten before it is read.
- ``res``: what a forward keeps for its backward, from the ``F`` until the
  ``W`` part of its backward. The number of these slots is the schedule's peak
  of live activations.
- ``carry``: what an ``I`` part keeps for its ``W`` part.

A value's lifetime is an interval of (tick, phase) positions; assigning slots
is colouring intervals on a line, which the greedy sweep does optimally.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from jpipe._schedule import Schedule
from jpipe._simulate import Costs, simulate
from jpipe._validate import analyze

# Phases inside one tick, in program order.
_PH_READ, _PH_WRITE_RES, _PH_WRITE_CARRY, _PH_SEND = range(4)


def _pos(tick: int, phase: int) -> int:
    return 4 * tick + phase


@dataclasses.dataclass(frozen=True)
class Plan:
    """A schedule laid out in lock-step ticks, with buffer slots.

    Attributes:
      schedule: the validated schedule.
      ticks: ``ticks[t][r]`` is the piece rank `r` runs in tick `t`, as
        ``(kind, stage, microbatch)`` with kind ``F``, ``I`` or ``W``, or None.
      stage_to_rank: the rank of each stage.
      shifts: the distinct ``(receiver - sender) % R`` of all transfers between
        different ranks, activations and gradients alike; the program runs one
        collective per shift per tick (a rank sends at most one value a tick).
      num_io, num_res, num_carry: slots needed in each arena (worst rank).
      slot: ``slot[("io", piece)]`` is the io slot that the value consumed by
        `piece` waits in; ``slot[("res", key)]`` the residual slot of a
        `(stage, microbatch)`; ``slot[("carry", key)]`` its I-to-W carry slot.
    """

    schedule: Schedule
    ticks: tuple[tuple[tuple[str, int, int] | None, ...], ...]
    stage_to_rank: tuple[int, ...]
    shifts: tuple[int, ...]
    num_io: int
    num_res: int
    num_carry: int
    slot: dict = dataclasses.field(compare=False, hash=False, repr=False)

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    @property
    def num_ranks(self) -> int:
        return self.schedule.num_ranks

    def predicted_time(self, costs: Costs | None = None) -> float:
        """Time of the lock-step program: each tick costs its busiest rank's piece.

        A ``B``'s two pieces share its cost in the ratio of ``I`` to ``W``.
        """
        cost = (costs or Costs()).table(self.schedule.num_stages)
        full_b = {a.key for _, _, a in self.schedule.all_actions() if a.kind == "B"}
        total = 0.0
        for row in self.ticks:
            worst = 0.0
            for piece in row:
                if piece is None:
                    continue
                kind, s, m = piece
                c = cost[kind][s]
                if kind != "F" and (s, m) in full_b:
                    i, w = cost["I"][s], cost["W"][s]
                    c = cost["B"][s] * (c / (i + w) if i + w > 0 else 0.5)
                worst = max(worst, c)
            total += worst
        return total


def _ticks(schedule: Schedule):
    """Places every piece at its start in the unit-cost simulation."""
    sim = simulate(schedule, Costs(F=1, I=1, W=1, B=2, comm=0))
    R = schedule.num_ranks
    placed = {}
    for ev in sim.timeline:
        a = ev.action
        t = int(round(ev.start))
        if a.kind == "B":
            pieces = [(t, ("I", a.stage, a.microbatch)), (t + 1, ("W", a.stage, a.microbatch))]
        else:
            pieces = [(t, (a.kind, a.stage, a.microbatch))]
        for tick, piece in pieces:
            if (tick, ev.rank) in placed:
                raise AssertionError("two pieces in one tick on one rank")
            placed[(tick, ev.rank)] = piece
    first = min(t for t, _ in placed)
    last = max(t for t, _ in placed)
    ticks = tuple(tuple(placed.get((t, r)) for r in range(R)) for t in range(first, last + 1))
    return ticks, sim


def _colour(intervals):
    """Assigns slots to `(start, end, key)` intervals; returns (count, {key: slot})."""
    free: list[int] = []
    busy: list[tuple[int, int]] = []  # (end, slot)
    count = 0
    out = {}
    for start, end, key in sorted(intervals, key=lambda iv: (iv[0], iv[1])):
        while busy and busy[0][0] < start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            s = heapq.heappop(free)
        else:
            s = count
            count += 1
        out[key] = s
        heapq.heappush(busy, (end, s))
    return count, out


def _slots(ticks, owner, R: int) -> tuple[dict, tuple[int, int, int], tuple[int, ...]]:
    """Colours every value's lifetime: ``(slot, (num_io, num_res, num_carry), shifts)``.

    Works for any tick table: a forward's residuals live until its ``W``
    piece when there is one (a forward-only plan keeps none).
    """
    S = len(owner)
    when = {piece: t for t, row in enumerate(ticks) for piece in row if piece is not None}
    intervals = {arena: [[] for _ in range(R)] for arena in ("io", "res", "carry")}
    shifts = set()
    for (kind, s, m), t in when.items():
        if kind == "W":
            continue
        nxt = s + 1 if kind == "F" else s - 1
        if 0 <= nxt < S:  # the output goes to the next stage's piece of the same kind
            consumer = (kind, nxt, m)
            dst = owner[nxt]
            intervals["io"][dst].append(
                (_pos(t, _PH_SEND), _pos(when[consumer], _PH_READ), consumer)
            )
            if dst != owner[s]:
                shifts.add((dst - owner[s]) % R)
        end = when.get(("W", s, m))
        if end is not None:
            arena, phase = ("res", _PH_WRITE_RES) if kind == "F" else ("carry", _PH_WRITE_CARRY)
            intervals[arena][owner[s]].append((_pos(t, phase), _pos(end, _PH_READ), (s, m)))
    slot, counts = {}, []
    for arena, per_rank in intervals.items():
        most = 0
        for ivs in per_rank:
            n, assign = _colour(ivs)
            most = max(most, n)
            slot.update({(arena, k): v for k, v in assign.items()})
        counts.append(most)
    return slot, tuple(counts), tuple(sorted(shifts))


def make_plan(schedule: Schedule) -> Plan:
    """Lays `schedule` out in ticks and assigns its buffer slots."""
    ticks, sim = _ticks(schedule)
    owner = sim.schedule.stage_to_rank
    slot, (num_io, num_res, num_carry), shifts = _slots(ticks, owner, schedule.num_ranks)
    return Plan(schedule, ticks, tuple(owner), shifts, num_io, num_res, num_carry, slot)


def make_forward_plan(schedule: Schedule) -> Plan:
    """A plan that runs only the forwards of `schedule` (to compute a loss).

    Each rank runs its ``F`` actions in the schedule's order, one per tick, as
    soon as the forward it depends on has run; nothing is kept for a backward
    (every residual write goes to the spare slot).
    """
    info = analyze(schedule)
    owner = info.stage_to_rank
    R = schedule.num_ranks
    rows = [[a for a in schedule.actions(r) if a.kind == "F"] for r in range(R)]
    done_at: dict[tuple[int, int], int] = {}
    pc = [0] * R
    ticks = []
    while any(pc[r] < len(rows[r]) for r in range(R)):
        t = len(ticks)
        row = []
        for r in range(R):
            piece = None
            if pc[r] < len(rows[r]):
                a = rows[r][pc[r]]
                dep = done_at.get((a.stage - 1, a.microbatch))
                if a.stage == 0 or (dep is not None and dep < t):
                    piece = ("F", a.stage, a.microbatch)
            row.append(piece)
        for r, piece in enumerate(row):
            if piece is not None:
                done_at[piece[1:]] = t
                pc[r] += 1
        ticks.append(tuple(row))
    slot, (num_io, num_res, num_carry), shifts = _slots(ticks, owner, R)
    for piece in {p for row in ticks for p in row if p is not None}:
        slot[("res", piece[1:])] = num_res  # the spare slot: nothing is kept
    return Plan(schedule, tuple(ticks), tuple(owner), shifts, num_io, num_res, num_carry, slot)


# Columns of the per-tick table that drives the program.
COLUMNS = (
    "branch",  # 0: idle; 1 + s: F of stage s; 1 + S + s: I of s; 1 + 2S + s: W of s
    "microbatch",
    "io_in",  # io slot read: the F's input activation or the I's output gradient
    "res",  # res slot: written by F, read by I and W
    "carry",  # carry slot: written by I, read by W
    "local",  # io slot for an output whose consumer is on this rank
)


def table(plan: Plan) -> np.ndarray:
    """The int32 table ``[ticks, ranks, columns]`` that the program scans over.

    Columns are `COLUMNS`, then one arrival io slot per shift (`Plan.shifts`).
    The spare slot of each arena (index `num_*`) takes
    writes that nobody reads and feeds reads whose value is not used.
    """
    S = plan.schedule.num_stages
    R = plan.num_ranks
    owner = plan.stage_to_rank
    ncol = len(COLUMNS) + len(plan.shifts)
    out = np.zeros((plan.num_ticks, R, ncol), np.int32)
    col = {name: i for i, name in enumerate(COLUMNS)}
    scol = {d: len(COLUMNS) + i for i, d in enumerate(plan.shifts)}
    out[:, :, col["io_in"]] = plan.num_io
    out[:, :, col["res"]] = plan.num_res
    out[:, :, col["carry"]] = plan.num_carry
    out[:, :, col["local"]] = plan.num_io
    for c in scol.values():
        out[:, :, c] = plan.num_io
    slot = plan.slot
    offset = {"F": 1, "I": 1 + S, "W": 1 + 2 * S}
    for t, row in enumerate(plan.ticks):
        for r, piece in enumerate(row):
            if piece is None:
                continue
            kind, s, m = piece
            out[t, r, col["branch"]] = offset[kind] + s
            out[t, r, col["microbatch"]] = m
            out[t, r, col["res"]] = slot[("res", (s, m))]
            if kind == "F" and s > 0 or kind == "I" and s + 1 < S:
                out[t, r, col["io_in"]] = slot[("io", piece)]
            if kind in ("I", "W"):
                out[t, r, col["carry"]] = slot[("carry", (s, m))]
            nxt = s + 1 if kind == "F" else s - 1
            if kind != "W" and 0 <= nxt < S:
                consumer = (kind, nxt, m)
                dst = owner[nxt]
                if dst == r:
                    out[t, r, col["local"]] = slot[("io", consumer)]
                else:
                    out[t, dst, scol[(dst - r) % R]] = slot[("io", consumer)]
    return out
