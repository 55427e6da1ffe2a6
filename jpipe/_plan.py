"""Planning: from a validated schedule to a lock-step table and buffer slots.

The compiled program runs in lock-step ticks: in each tick every rank runs its
pieces of work, then all ranks meet at the tick's transfers to their
neighbours. A piece is an ``F``, an ``I`` or a ``W``; a full backward ``B``
runs as its ``I`` part and then its ``W`` part, on the same rank, with nothing
recomputed (the split is exact, see `jpipe._stage`). Each rank keeps its
list order, so the live activations on every rank are what the simulator
reports. Two layouts of the ticks:

- ``"unit"``: at most one piece per rank per tick. The tick of every piece is
  its start time in `jpipe.simulate` with unit costs (F = I = W = 1, B = 2,
  no latency), so the program follows the simulated timeline and a transfer
  costs one tick. In a transformer stage the three pieces cost about the
  same, so on devices that run independently (GPUs, TPUs) ranks wait little
  for each other, and the ticks are as few as the timeline allows.
- ``"packed"``: each rank runs at most one piece of each kind per tick, in
  the order F, I, W, as many as its list order and its inputs allow (greedy,
  earliest tick first). Fewer ticks, so fewer barriers and less per-tick
  bookkeeping. A transfer still costs a tick while a tick now holds up to
  three pieces, so a schedule whose warm-up is only just deep enough for the
  unit timeline (1F1B) stalls every other tick (90 units of lock-step time
  against 57 for R = 4, M = 16); one with slack (GPipe,
  interleaved 1F1B) keeps its critical path in fewer ticks.
- ``"auto"`` (the default) takes the packed layout where its lock-step time
  with unit costs is no longer than the unit layout's.
  `docs/compiler-measurements.md` has the measurements behind this.

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
from typing import ClassVar, NamedTuple

import numpy as np

from jpipe._schedule import Schedule
from jpipe._simulate import Costs, simulate
from jpipe._validate import analyze

# Phases inside one tick, in program order.
(
    _PH_F_READ,
    _PH_F_WRITE_RES,
    _PH_I_READ,
    _PH_I_WRITE_CARRY,
    _PH_W_READ,
    _PH_SEND,
) = range(6)
_READ_PHASE = {"F": _PH_F_READ, "I": _PH_I_READ, "W": _PH_W_READ}
_NUM_PHASES = 6

KINDS = ("F", "I", "W")  # the program order of the pieces inside a tick
LAYOUTS = ("auto", "unit", "packed")


def _pos(tick: int, phase: int) -> int:
    return _NUM_PHASES * tick + phase


class Piece(NamedTuple):
    """One piece of work in a tick: the kind (``F``, ``I`` or ``W``) of a stage on a microbatch."""

    kind: str
    stage: int
    microbatch: int


class Transfers(NamedTuple):
    """What a plan's transfers between ranks carry, over one step.

    Attributes:
      sent: values (activations and gradients) sent from one rank to another.
      exposed: those whose consumer runs in the very next tick: nothing can
        overlap such a transfer, so its latency adds to the step.
      collectives: the collectives the program runs, one per channel per tick.
      idle: those on which no rank sends: in one SPMD program every rank joins
        every channel's collective every tick, so these move zeros.
    """

    sent: int
    exposed: int
    collectives: int
    idle: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """A schedule laid out in lock-step ticks, with buffer slots.

    Attributes:
      schedule: the validated schedule.
      layout: ``"unit"`` or ``"packed"`` (see the module docstring); a
        forward-only plan (`make_forward_plan`) is labelled ``"unit"``: one
        piece per rank per tick, each forward as early as it can run.
      ticks: ``ticks[t][r]`` is the tuple of pieces rank `r` runs in tick `t`,
        in program order, each ``(kind, stage, microbatch)`` with kind ``F``,
        ``I`` or ``W``; at most one of each kind.
      stage_to_rank: the rank of each stage.
      channels: the transfers between different ranks the program makes every
        tick, one collective each, as ``(kind, shift)`` with shift
        ``(receiver - sender) % R``. Kind is ``"F"`` or ``"I"`` for the output
        of that kind of piece, or None when no rank ever runs both an F and
        an I in one tick (always so in the unit layout): F and I outputs then
        share the collective.
      num_io, num_res, num_carry: slots needed in each arena (worst rank).
      slot: ``slot[("io", piece)]`` is the io slot that the value consumed by
        `piece` waits in; ``slot[("res", key)]`` the residual slot of a
        `(stage, microbatch)`; ``slot[("carry", key)]`` its I-to-W carry slot.
      lifetimes: ``lifetimes[arena][rank]``, for ``"res"`` and ``"carry"``:
        the ``(start, end, key)`` position intervals of each value that rank
        keeps, for sizing the arena in bytes (`pack_lifetimes`).
    """

    schedule: Schedule
    layout: str
    ticks: tuple[tuple[tuple[Piece, ...], ...], ...]
    stage_to_rank: tuple[int, ...]
    channels: tuple[tuple[str | None, int], ...]
    num_io: int
    num_res: int
    num_carry: int
    slot: dict = dataclasses.field(compare=False, hash=False, repr=False)
    lifetimes: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    COLUMNS: ClassVar[tuple[str, ...]]  # the table's named columns, set below

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    @property
    def num_ranks(self) -> int:
        return self.schedule.num_ranks

    def pieces(self):
        """Yields ``(tick, rank, piece)`` for every piece."""
        for t, row in enumerate(self.ticks):
            for r, pieces in enumerate(row):
                for piece in pieces:
                    yield t, r, piece

    def table(self, *, idle: bool = False) -> np.ndarray:
        """The integer table ``[ticks, ranks, columns]`` that the program scans over.

        Columns are `Plan.COLUMNS`, then the io slot that each of
        `Plan.channels` delivers to on the receiving rank. The table is the one
        part of the program that grows with the microbatches, so it comes in
        the narrowest integer type that holds it (int8 up to 128
        microbatches, then int16).

        Args:
          idle: a table that runs no piece in any tick (every stage column
            0), for measuring what the program's control costs alone.
        """
        out = _table(self)
        if idle:
            out = out.copy()
            out[:, :, [COLUMNS.index(c) for c in STAGE_COLUMNS]] = 0
        return out

    def transfers(self) -> Transfers:
        """What the program's transfers between ranks carry (see `Transfers`)."""
        owner = self.stage_to_rank
        S = self.schedule.num_stages
        when = {piece: t for t, _, piece in self.pieces()}
        sent = exposed = 0
        busy = set()  # (tick, channel index) that some rank sends on
        index = {c: i for i, c in enumerate(self.channels)}
        for (kind, s, m), t in when.items():
            nxt = s + 1 if kind == "F" else s - 1
            if kind == "W" or not 0 <= nxt < S or owner[nxt] == owner[s]:
                continue
            sent += 1
            exposed += when[(kind, nxt, m)] == t + 1
            shift = (owner[nxt] - owner[s]) % self.num_ranks
            busy.add((t, index.get((None, shift), index.get((kind, shift)))))
        total = self.num_ticks * len(self.channels)
        return Transfers(sent, exposed, total, total - len(busy))

    def predicted_time(self, costs: Costs | None = None) -> float:
        """Time of the lock-step program on devices that run independently.

        Each tick costs its busiest rank's pieces, summed. A ``B``'s two
        pieces share its cost in the ratio of ``I`` to ``W``.
        """
        return _lockstep_time(self.schedule, self.ticks, costs)


def _lockstep_time(schedule: Schedule, ticks, costs: Costs | None = None) -> float:
    """`Plan.predicted_time` of a tick table (see there)."""
    cost = (costs or Costs()).table(schedule.num_stages)
    full_b = {a.key for _, _, a in schedule.all_actions() if a.kind == "B"}
    total = 0.0
    for row in ticks:
        worst = 0.0
        for pieces in row:
            busy = 0.0
            for kind, s, m in pieces:
                c = cost[kind][s]
                if kind != "F" and (s, m) in full_b:
                    i, w = cost["I"][s], cost["W"][s]
                    c = cost["B"][s] * (c / (i + w) if i + w > 0 else 0.5)
                busy += c
            worst = max(worst, busy)
        total += worst
    return total


def _pieces_of(action) -> list[Piece]:
    if action.kind == "B":
        return [
            Piece("I", action.stage, action.microbatch),
            Piece("W", action.stage, action.microbatch),
        ]
    return [Piece(action.kind, action.stage, action.microbatch)]


def _needs(piece: Piece, num_stages: int) -> list[Piece]:
    """The pieces whose outputs `piece` consumes."""
    kind, s, m = piece
    if kind == "F":
        return [Piece("F", s - 1, m)] if s > 0 else []
    if kind == "I":
        return [Piece("F", s, m)] + ([Piece("I", s + 1, m)] if s + 1 < num_stages else [])
    return [Piece("I", s, m)]


def _unit_ticks(schedule: Schedule):
    """Places every piece at its start in the unit-cost simulation."""
    sim = simulate(schedule, Costs(F=1, I=1, W=1, B=2, comm=0))
    R = schedule.num_ranks
    placed = {}
    for ev in sim.timeline:
        t = int(round(ev.start))
        for i, piece in enumerate(_pieces_of(ev.action)):
            if (t + i, ev.rank) in placed:
                raise AssertionError("two pieces in one tick on one rank")
            placed[(t + i, ev.rank)] = (piece,)
    first = min(t for t, _ in placed)
    last = max(t for t, _ in placed)
    return tuple(tuple(placed.get((t, r), ()) for r in range(R)) for t in range(first, last + 1))


def _packed_ticks(schedule: Schedule, kinds: tuple[str, ...] = KINDS):
    """Each rank runs its next pieces in list order, one of each kind per tick.

    In tick t a rank takes its next piece if the piece's kind comes later in
    `kinds` than the kind of the piece it took before in the same tick, and
    everything the piece consumes is ready: made on another rank in an
    earlier tick, or on this rank earlier (in this tick, by program order).
    A valid schedule always makes progress, so this ends.
    """
    info = analyze(schedule)
    owner = info.stage_to_rank
    S, R = info.num_stages, schedule.num_ranks
    order = {k: i for i, k in enumerate(kinds)}
    lists = [
        [p for a in schedule.actions(r) for p in _pieces_of(a) if p[0] in order] for r in range(R)
    ]
    done: dict = {}
    pc = [0] * R
    remaining = sum(len(x) for x in lists)
    ticks = []
    while remaining:
        t = len(ticks)
        row = []
        for r in range(R):
            taken: list[Piece] = []
            while pc[r] < len(lists[r]):
                piece = lists[r][pc[r]]
                if taken and order[piece[0]] <= order[taken[-1][0]]:
                    break
                ready = all(
                    d in done and (done[d] < t or owner[d[1]] == r) for d in _needs(piece, S)
                )
                if not ready:
                    break
                taken.append(piece)
                done[piece] = t
                pc[r] += 1
            row.append(tuple(taken))
        if not any(row):
            raise AssertionError(f"packing made no progress at tick {t}")
        remaining -= sum(len(x) for x in row)
        ticks.append(tuple(row))
    return tuple(ticks)


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


def _slots(ticks, owner, R: int):
    """Colours every value's lifetime: ``(slot, counts, channels, lifetimes)``.

    `counts` is ``(num_io, num_res, num_carry)``.

    Works for any tick table: a forward's residuals live until its ``W``
    piece when there is one (a forward-only plan keeps none).
    """
    S = len(owner)
    when = {p: t for t, row in enumerate(ticks) for pieces in row for p in pieces}
    # Where no rank sends more than one value a tick, F and I outputs can
    # share one collective per shift.
    shared_channels = all(
        sum(1 for p in pieces if p[0] != "W") <= 1 for row in ticks for pieces in row
    )
    intervals = {arena: [[] for _ in range(R)] for arena in ("io", "res", "carry")}
    channels = set()
    for (kind, s, m), t in when.items():
        if kind == "W":
            continue
        nxt = s + 1 if kind == "F" else s - 1
        if 0 <= nxt < S:  # the output goes to the next stage's piece of the same kind
            consumer = (kind, nxt, m)
            dst = owner[nxt]
            intervals["io"][dst].append(
                (_pos(t, _PH_SEND), _pos(when[consumer], _READ_PHASE[kind]), consumer)
            )
            if dst != owner[s]:
                channels.add((None if shared_channels else kind, (dst - owner[s]) % R))
        end = when.get(("W", s, m))
        if end is not None:
            arena, phase = ("res", _PH_F_WRITE_RES) if kind == "F" else ("carry", _PH_I_WRITE_CARRY)
            intervals[arena][owner[s]].append((_pos(t, phase), _pos(end, _PH_W_READ), (s, m)))
    slot, counts = {}, []
    for arena, per_rank in intervals.items():
        most = 0
        for ivs in per_rank:
            n, assign = _colour(ivs)
            most = max(most, n)
            slot.update({(arena, k): v for k, v in assign.items()})
        counts.append(most)
    order = sorted(channels, key=lambda c: (c[0] or "", c[1]))
    lifetimes = {a: tuple(tuple(ivs) for ivs in intervals[a]) for a in ("res", "carry")}
    return slot, tuple(counts), tuple(order), lifetimes


def pack_lifetimes(lifetimes, size_of) -> tuple[int, dict]:
    """Places values that live over intervals in one buffer: ``(extent, {key: offset})``.

    `lifetimes` are ``(start, end, key)`` intervals (as in `Plan.lifetimes`)
    and ``size_of(key)`` each value's size. First fit, in order of start: a
    value takes the lowest offset where it overlaps no value still live.
    Where all values have one size (a rank that holds one stage) this is the
    interval colouring of the slots, so the extent is the peak of live
    values times their size, which no placement can beat; with several sizes
    it is at least the peak of live bytes, and first fit stays close to it.
    """
    live: list[tuple[int, int, int]] = []  # (offset, size, end)
    extent, out = 0, {}
    for start, end, key in sorted(lifetimes, key=lambda iv: (iv[0], iv[1])):
        live = [v for v in live if v[2] >= start]
        size = size_of(key)
        offset = 0
        for off, n, _ in sorted(live):
            if off - offset >= size:
                break
            offset = max(offset, off + n)
        out[key] = offset
        if size:
            live.append((offset, size, end))
            extent = max(extent, offset + size)
    return extent, out


def make_plan(schedule: Schedule, layout: str = "auto", *, forward_only: bool = False) -> Plan:
    """Lays `schedule` out in ticks and assigns its buffer slots.

    `layout` is ``"unit"``, ``"packed"`` or ``"auto"``: the packed layout
    where its lock-step time with unit costs (`Plan.predicted_time`) is no
    longer than the unit layout's (it then has the same critical path in
    fewer ticks: GPipe, interleaved 1F1B), else the unit layout (1F1B, whose
    bounded warm-up cannot keep packed ticks full).

    With `forward_only`, the plan runs only the schedule's forwards, to
    compute a loss (`make_forward_plan`; `layout` is ignored).
    """
    if forward_only:
        return make_forward_plan(schedule)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown tick layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    owner = analyze(schedule).stage_to_rank
    R = schedule.num_ranks
    if layout == "auto":  # compare the tick tables; assign slots for the chosen one only
        unit, packed = _unit_ticks(schedule), _packed_ticks(schedule)
        better = _lockstep_time(schedule, packed) <= _lockstep_time(schedule, unit)
        layout, ticks = ("packed", packed) if better else ("unit", unit)
    else:
        ticks = _packed_ticks(schedule) if layout == "packed" else _unit_ticks(schedule)
    slot, (num_io, num_res, num_carry), channels, lifetimes = _slots(ticks, owner, R)
    return Plan(
        schedule, layout, ticks, tuple(owner), channels, num_io, num_res, num_carry, slot, lifetimes
    )


def make_forward_plan(schedule: Schedule) -> Plan:
    """A plan that runs only the forwards of `schedule` (to compute a loss).

    Each rank runs its ``F`` actions in the schedule's order, one per tick, as
    soon as the forward it depends on has run; nothing is kept for a backward
    (every residual write goes to the spare slot).
    """
    owner = analyze(schedule).stage_to_rank
    R = schedule.num_ranks
    ticks = _packed_ticks(schedule, kinds=("F",))
    slot, (num_io, num_res, num_carry), channels, lifetimes = _slots(ticks, owner, R)
    for piece in (p for row in ticks for pieces in row for p in pieces):
        slot[("res", piece[1:])] = num_res  # the spare slot: nothing is kept
    return Plan(
        schedule, "unit", ticks, tuple(owner), channels, num_io, num_res, num_carry, slot, lifetimes
    )


# Columns of the per-tick table that drives the program: for each kind of
# piece, which stage runs it (0: none; 1 + s: stage s), its microbatch and its
# slots. The spare slot of each arena (index `num_*`) takes writes that nobody
# reads and feeds reads whose value is not used.
COLUMNS = (
    "f_stage",
    "f_microbatch",
    "f_in",  # io slot of the input activation
    "f_res",  # res slot written
    "f_local",  # io slot for the output when its consumer is on this rank
    "i_stage",
    "i_microbatch",
    "i_in",  # io slot of the output gradient
    "i_res",  # res slot read
    "i_carry",  # carry slot written
    "i_local",
    "w_stage",
    "w_microbatch",
    "w_res",
    "w_carry",
)
STAGE_COLUMNS = ("f_stage", "i_stage", "w_stage")
Plan.COLUMNS = COLUMNS


def _table(plan: Plan) -> np.ndarray:
    """`Plan.table`: the integer table the program scans over."""
    S = plan.schedule.num_stages
    R = plan.num_ranks
    owner = plan.stage_to_rank
    ncol = len(COLUMNS) + len(plan.channels)
    out = np.zeros((plan.num_ticks, R, ncol), np.int32)
    col = {name: i for i, name in enumerate(COLUMNS)}
    chan = {c: len(COLUMNS) + i for i, c in enumerate(plan.channels)}
    spare = {"in": plan.num_io, "local": plan.num_io, "res": plan.num_res, "carry": plan.num_carry}
    for name, i in col.items():
        kind_col = name.split("_", 1)[1]
        if kind_col in spare:
            out[:, :, i] = spare[kind_col]
    for c in chan.values():
        out[:, :, c] = plan.num_io
    slot = plan.slot
    for t, r, piece in plan.pieces():
        kind, s, m = piece
        k = kind.lower()
        out[t, r, col[f"{k}_stage"]] = 1 + s
        out[t, r, col[f"{k}_microbatch"]] = m
        out[t, r, col[f"{k}_res"]] = slot[("res", (s, m))]
        if kind == "F" and s > 0 or kind == "I" and s + 1 < S:
            out[t, r, col[f"{k}_in"]] = slot[("io", piece)]
        if kind in ("I", "W"):
            out[t, r, col[f"{k}_carry"]] = slot[("carry", (s, m))]
        nxt = s + 1 if kind == "F" else s - 1
        if kind != "W" and 0 <= nxt < S:
            consumer = (kind, nxt, m)
            dst = owner[nxt]
            if dst == r:
                out[t, r, col[f"{k}_local"]] = slot[("io", consumer)]
            else:
                shared = (None, (dst - r) % R)
                c = chan[shared] if shared in chan else chan[(kind, (dst - r) % R)]
                out[t, dst, c] = slot[("io", consumer)]
    for narrow in (np.int8, np.int16):
        if out.size == 0 or out.max() <= np.iinfo(narrow).max:
            return out.astype(narrow)
    return out
