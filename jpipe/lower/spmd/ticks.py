"""Planning: from a validated schedule to a lock-step table and buffer slots.

The compiled program runs in lock-step ticks: in each tick every rank runs its
pieces of work, then all ranks meet at the tick's transfers to their
neighbours. A piece is an ``F``, an ``I`` or a ``W``; a full backward ``B``
runs as its ``I`` part and then its ``W`` part, on the same rank, with nothing
recomputed (the split is exact, see `jpipe.stage.pieces`). Each rank keeps its
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

`make_tick_plan` then assigns buffer slots. Every value that must outlive a tick
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

Both layouts are computed first as numbers, the tick of every piece (one
pass over the schedule in dependency order), and the table of `Piece`s only
for the layout chosen. `program_shape` reads the program's figures (ticks,
channels, transfers) from those numbers alone, without the table or the
slots: ``python -m jpipe.show`` prints them for 64 ranks x 1,024
microbatches in a fraction of a second.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import operator
from typing import ClassVar, NamedTuple

import numpy as np

from jpipe.schedule.actions import Schedule
from jpipe.schedule.simulate import Costs, _start_times
from jpipe.schedule.validate import analyze

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


MOVE_KINDS = ("EVICT", "LOAD", "OFFLOAD", "RELOAD")


class Move(NamedTuple):
    """A copy of one ``(stage, microbatch)``'s residuals, at the start of a tick.

    Attributes:
      kind: ``"EVICT"`` (owner to partner) or ``"LOAD"`` (partner to owner),
        which ride a collective between ranks, or ``"OFFLOAD"`` (device to
        host) or ``"RELOAD"`` (host to device), which stay on the rank.
      tick: the tick at whose start it runs, before the tick's pieces: its
        source was made in an earlier tick and its reader may run in this one.
      stage, microbatch: whose residuals.
      src, dst: the ranks that send and receive (the owner for both
        host copies).
      src_key, dst_key: the lifetimes (`TickPlan.lifetimes`, ``"res"`` or
        ``"host"``) it reads and starts.
    """

    kind: str
    tick: int
    stage: int
    microbatch: int
    src: int
    dst: int
    src_key: tuple
    dst_key: tuple


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
class TickPlan:
    """A schedule laid out in lock-step ticks, with buffer slots.

    Attributes:
      schedule: the validated schedule.
      layout: ``"unit"`` or ``"packed"`` (see the module docstring); a
        forward-only plan (`make_forward_tick_plan`) is labelled ``"unit"``: one
        piece per rank per tick, each forward as early as it can run.
      ticks: ``ticks[t][r]`` is the tuple of pieces rank `r` runs in tick `t`,
        in program order, each ``(kind, stage, microbatch)`` with kind ``F``,
        ``I`` or ``W``; at most one of each kind.
      stage_to_rank: the rank of each stage (of a replicated stage, its first).
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
      lifetimes: ``lifetimes[arena][rank]``, for ``"res"`` and ``"carry"``
        (and ``"host"`` for offloaded residuals): the ``(start, end, key)``
        position intervals of each value that rank keeps, for sizing the
        arena in bytes (`pack_lifetimes`). A residual's key is ``(stage,
        microbatch)``; one that memory actions move lives in several
        intervals, the later ones keyed ``(stage, microbatch, j)``, on its
        rank, on a partner or on the host.
      moves: the `Move` of every eviction, load, offload and reload.
      res_key: ``res_key[(kind, stage, microbatch)]``: the residual lifetime
        a piece writes (``F``, ``R``) or reads (``I``, ``W``).
      key_rank: the rank of each ``(stage, microbatch)``, at ``stage * M +
        microbatch`` (`jpipe.Analysis.key_rank`): where a replicated stage
        runs it, so where its input is sent.

    Memory actions: an ``FC`` is a piece of kind ``"FC"`` (the forward,
    keeping nothing but its input, whose io slot lives on until the
    recompute), a ``RECOMPUTE`` one of kind ``"R"`` (the forward again,
    writing the residuals, sending nothing); both use the F columns of the
    table, told apart by ``f_mode`` (`F_MODES`). Evictions, loads and the
    host copies are `moves`. A plan with memory actions is always laid out
    unit, with each copy one tick long.
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
    moves: tuple = ()
    res_key: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)
    key_rank: tuple[int, ...] = ()

    COLUMNS: ClassVar[tuple[str, ...]]  # the table's named columns, set below
    F_MODES: ClassVar[dict]  # column f_mode's values, set below

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

        Columns are `TickPlan.COLUMNS`, then the io slot that each of
        `TickPlan.channels` delivers to on the receiving rank. The table is the one
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
        info = analyze(self.schedule)
        when = _when(self.ticks, info.num_stages, info.num_microbatches)
        return _transfers(self.schedule, when, self.num_ticks, self.key_rank, self.channels)

    def predicted_time(self, costs: Costs | None = None) -> float:
        """Time of the lock-step program on devices that run independently.

        Each tick costs its busiest rank's pieces, summed. A ``B``'s two
        pieces share its cost in the ratio of ``I`` to ``W``.
        """
        return _lockstep_time(self.schedule, self.ticks, costs)


def _transfers(schedule: Schedule, when, num_ticks: int, at, channels) -> Transfers:
    """`TickPlan.transfers` from the tick of every piece (`_Layout.when`), the rank of every
    ``(stage, microbatch)`` (`at`, as `TickPlan.key_rank`) and the channels."""
    info = analyze(schedule)
    S, M, R = info.num_stages, info.num_microbatches, schedule.num_ranks
    index = {c: i for i, c in enumerate(channels)}
    sent = exposed = 0
    busy = set()  # (tick, channel index) that some rank sends on
    for kind, step, base in (("F", 1, 0), ("I", -1, S * M)):
        for s in range(S):
            nxt = s + step
            if not 0 <= nxt < S:
                continue
            mine, theirs = base + s * M, base + nxt * M
            for m in range(M):
                src, dst = at[s * M + m], at[nxt * M + m]
                if src == dst:
                    continue
                shift = (dst - src) % R
                channel = index.get((None, shift), index.get((kind, shift)))
                t = when[mine + m]
                if t < 0:
                    continue
                sent += 1
                exposed += when[theirs + m] == t + 1
                busy.add((t, channel))
    total = num_ticks * len(channels)
    return Transfers(sent, exposed, total, total - len(busy))


def _when(ticks, S: int, M: int) -> list[int]:
    """The tick of every piece of a tick table, indexed as `_Layout.when`."""
    when = [-1] * (len(KINDS) + 1) * S * M
    for t, row in enumerate(ticks):
        for pieces in row:
            for kind, s, m in pieces:
                when[_KIND_INDEX[kind] * S * M + s * M + m] = t
    return when


def _lockstep_time(schedule: Schedule, ticks, costs: Costs | None = None) -> float:
    """`TickPlan.predicted_time` of a tick table (see there)."""
    costs = costs or Costs()
    S = analyze(schedule).num_stages
    cost = costs.table(S)
    if schedule.has_memory_actions:
        memory = costs.memory_table(S)
        cost = {**cost, "FC": memory["FC"], "R": memory["RECOMPUTE"]}
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


_UNIT_COSTS = Costs(F=1, I=1, W=1, B=2, comm=0)
# With memory actions each copy also takes one tick (FC and RECOMPUTE cost F).
_UNIT_MEMORY_COSTS = Costs(F=1, I=1, W=1, B=2, comm=0, evict=1, offload=1)
# Index of each piece kind in `_Layout.when`: an FC is the key's forward; a
# recompute (``R``) has its own.
_KIND_INDEX = {"F": 0, "FC": 0, "I": 1, "W": 2, "R": 3}
_NUM_KINDS = 4
F_MODES = {"F": 0, "FC": 1, "R": 2}
"""Column ``f_mode`` of the table: which forward-kind piece runs (see `TickPlan`)."""
# A memory action's move kind, keyed by the action that begins the copy.
_MOVE_OF = {"EVICT": "EVICT", "LOAD": "LOAD", "OFFLOAD_START": "OFFLOAD", "RELOAD_START": "RELOAD"}


class _Layout(NamedTuple):
    """Where every piece of a schedule runs, as numbers (before any table is built).

    Attributes:
      name: ``"unit"`` or ``"packed"``.
      when: the tick of every piece, at ``k * S * M + s * M + m`` where `k`
        is 0, 1, 2 for F, I, W; -1 where there is no such piece.
      num_ticks: the ticks of the table.
      lockstep: `TickPlan.predicted_time` with unit costs: each tick costs as
        many pieces as its fullest rank runs.
      shared: whether no rank runs both an F and an I in one tick, so that
        F and I outputs can share one collective per shift.
      kinds: the kinds of piece laid out.
      moves: the copies of memory actions, ``(tick, kind, stage,
        microbatch, rank, partner)`` (`Move` without its lifetimes).
    """

    name: str
    when: list
    num_ticks: int
    lockstep: float
    shared: bool
    kinds: tuple[str, ...]
    moves: tuple = ()


def _unit_layout(schedule: Schedule, sim=None) -> _Layout:
    """Every piece at its start in the unit-cost simulation (a B's W one tick after its I).

    `sim` is a simulation of `schedule` to use instead of simulating again,
    where its costs are the unit ones (F = I = W = 1, B = 2, no latency).
    """
    info = analyze(schedule)
    S, M = info.num_stages, info.num_microbatches
    memory = schedule.has_memory_actions
    costs = _UNIT_MEMORY_COSTS if memory else _UNIT_COSTS
    unit = costs.table(S), costs.comm_table(S)
    if (
        memory
        or sim is None
        or sim.schedule is not schedule
        or (sim.costs.table(S), sim.costs.comm_table(S)) != unit
    ):
        starts = _start_times(schedule, costs)
    else:
        starts = sim.starts
    first = min((round(row[0]) for row in starts if row), default=0)
    when = [-1] * (_NUM_KINDS * S * M)
    used = set()
    moves = []
    for r in range(schedule.num_ranks):
        for a, start in zip(info.rows[r], starts[r]):
            t = round(start) - first
            key = a.stage * M + a.microbatch
            if a.kind == "B":
                when[S * M + key] = t
                when[2 * S * M + key] = t + 1
                used.add(t + 1)
            elif a.kind in _MOVE_OF:
                # A copy one tick long runs at the start of the tick it ends in.
                moves.append((t + 1, _MOVE_OF[a.kind], a.stage, a.microbatch, r, a.partner))
                continue
            elif a.kind in ("OFFLOAD_END", "RELOAD_END"):
                continue  # waits for a copy: nothing runs
            else:
                kind = "R" if a.kind == "RECOMPUTE" else a.kind
                when[_KIND_INDEX[kind] * S * M + key] = t
            used.add(t)
    num_ticks = max(used) + 1 if used else 0
    num_ticks = max([num_ticks] + [m[0] + 1 for m in moves])
    return _Layout("unit", when, num_ticks, float(len(used)), True, KINDS, tuple(sorted(moves)))


def _packed_layout(schedule: Schedule, kinds: tuple[str, ...] = KINDS) -> _Layout:
    """Each rank runs its next pieces in list order, one of each kind per tick.

    In tick t a rank takes its next piece if the piece's kind comes later in
    `kinds` than the kind of the piece it took before in the same tick, and
    everything the piece consumes is ready: made on another rank in an
    earlier tick, or on this rank earlier (in this tick, by program order).
    A valid schedule always makes progress, so this ends.

    That greedy is a longest path, computed in one pass in the schedule's
    dependency order: what a piece consumes on its own rank comes earlier in
    the rank's list (validation refuses the rest as a deadlock), so only its
    one input from another rank, if any, and the piece before it on its rank
    bound its tick. It runs in the tick of the piece before if its kind
    comes later and its input is in by then, else in the first later tick
    where its input is in.
    """
    info = analyze(schedule)
    at = info.key_rank
    S, M, R = info.num_stages, info.num_microbatches, schedule.num_ranks
    SM = S * M
    order = {k: i for i, k in enumerate(kinds)}
    when = [-1] * (_NUM_KINDS * SM)
    last_tick = [-1] * R  # tick and kind order of each rank's last piece
    last_kind = [len(kinds)] * R
    in_tick = [0] * R  # pieces the rank runs in its last tick
    fullest: list[int] = []  # per tick, the most pieces one rank runs in it
    shared = True
    rows = info.rows
    for r, i in info.order:
        a = rows[r][i]
        s, m = a.stage, a.microbatch
        for kind in ("I", "W") if a.kind == "B" else (a.kind,):
            k = order.get(kind)
            if k is None:
                continue
            ready = 0  # the first tick its input from another rank is in
            if kind == "F":
                if s > 0 and at[(s - 1) * M + m] != r:
                    ready = when[(s - 1) * M + m] + 1
            elif kind == "I":
                if s + 1 < S and at[(s + 1) * M + m] != r:
                    ready = when[SM + (s + 1) * M + m] + 1
            t = last_tick[r]
            if k <= last_kind[r] or ready > t:
                t = max(t + 1, ready)
                in_tick[r] = 0
            elif kind == "I":
                shared = False  # after an F of this rank, in its tick
            when[_KIND_INDEX[kind] * SM + s * M + m] = t
            last_tick[r], last_kind[r] = t, k
            in_tick[r] += 1
            while len(fullest) <= t:
                fullest.append(0)
            if in_tick[r] > fullest[t]:
                fullest[t] = in_tick[r]
    if 0 in fullest:
        raise AssertionError(f"packing made no progress at tick {fullest.index(0)}")
    return _Layout("packed", when, len(fullest), float(sum(fullest)), shared, kinds)


def check_layout(layout: str) -> None:
    """Refuses a tick layout that is not one of `LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown tick layout {layout!r}: use one of {', '.join(LAYOUTS)}")


def _choose_layout(schedule: Schedule, layout: str, sim=None) -> _Layout:
    """The `_Layout` that `make_tick_plan` lays `schedule` out in (see there)."""
    check_layout(layout)
    if schedule.has_memory_actions:
        if layout == "packed":
            kinds = sorted({a.kind for _, _, a in schedule.all_actions() if a.is_memory})
            raise ValueError(
                f"the schedule has memory actions ({', '.join(kinds)}), which the compiler lays "
                "out in the unit layout only (each copy one tick long); use tick_layout='unit' "
                "or 'auto'"
            )
        return _unit_layout(schedule, sim)
    if layout == "unit":
        return _unit_layout(schedule, sim)
    packed = _packed_layout(schedule)
    if layout == "packed":
        return packed
    unit = _unit_layout(schedule, sim)
    return packed if packed.lockstep <= unit.lockstep else unit


def _ticks(schedule: Schedule, layout: _Layout):
    """The tick table of `layout`: ``ticks[t][r]``, each rank's pieces in program order."""
    info = analyze(schedule)
    S, M, R = info.num_stages, info.num_microbatches, schedule.num_ranks
    SM = S * M
    when, T = layout.when, layout.num_ticks
    new = tuple.__new__  # Piece(kind, s, m) without its Python-level __new__: 2x faster
    cells = [()] * (T * R)  # cells[t * R + r]: the pieces of rank r in tick t
    for r in range(R):
        for a in info.rows[r]:
            s, m = a.stage, a.microbatch
            if a.kind == "B":
                kinds = ("I", "W")
            elif a.is_memory:
                kinds = {"FC": ("FC",), "RECOMPUTE": ("R",)}.get(a.kind, ())
            else:
                kinds = (a.kind,)
            for kind in kinds:
                if ("F" if kind in ("FC", "R") else kind) in layout.kinds:
                    i = when[_KIND_INDEX[kind] * SM + s * M + m] * R + r
                    cells[i] = (*cells[i], new(Piece, (kind, s, m)))
    if layout.name == "unit" and any(len(p) > 1 for p in cells):
        raise AssertionError("two pieces in one tick on one rank")
    return tuple(tuple(cells[t * R : (t + 1) * R]) for t in range(T))


def _channels(schedule: Schedule, layout: _Layout) -> tuple[tuple[str | None, int], ...]:
    """`TickPlan.channels`: a collective per kind of output and shift that some piece sends on."""
    info = analyze(schedule)
    at, R, M = info.key_rank, schedule.num_ranks, info.num_microbatches
    channels = set()
    for kind, step in (("F", 1), ("I", -1)):
        if kind not in layout.kinds:
            continue
        for s in range(info.num_stages):
            if not 0 <= s + step < info.num_stages:
                continue
            for m in range(M):
                src, dst = at[s * M + m], at[(s + step) * M + m]
                if src != dst:
                    channels.add((None if layout.shared else kind, (dst - src) % R))
    return tuple(sorted(channels, key=lambda c: (c[0] or "", c[1])))


def program_shape(schedule: Schedule, layout: str = "auto", sim=None) -> dict:
    """The shape of the program `make_tick_plan` lays out, without building its table.

    ``{"tick_layout", "ticks", "channels", **TickPlan.transfers()}``, what
    ``python -m jpipe.show`` prints; `sim`, a unit-cost simulation of
    `schedule` where one is at hand, saves simulating it again. With memory
    actions it also counts the copies (``moves``: evictions and loads, which
    ride collectives between ranks, and offloads and reloads).
    """
    chosen = _choose_layout(schedule, layout, sim)
    at = analyze(schedule).key_rank
    channels = _channels(schedule, chosen)
    shape = {
        "tick_layout": chosen.name,
        "ticks": chosen.num_ticks,
        "channels": len(channels),
        **_transfers(schedule, chosen.when, chosen.num_ticks, at, channels)._asdict(),
    }
    if schedule.has_memory_actions:
        shape["moves"] = len(chosen.moves)
    return shape


def _colour(intervals, arena: str, slot: dict) -> int:
    """Puts the slot of each `(start, end, key)` in ``slot[(arena, key)]``; returns the count.

    In order of start (then end), each value takes the lowest slot free of
    values that ended before it starts: optimal for intervals on a line.
    """
    free: list[int] = []
    busy: list[tuple[int, int]] = []  # (end, slot)
    count = 0
    push, pop = heapq.heappush, heapq.heappop
    for start, end, key in sorted(intervals, key=operator.itemgetter(0, 1)):
        while busy and busy[0][0] < start:
            push(free, pop(busy)[1])
        if free:
            s = pop(free)
        else:
            s = count
            count += 1
        slot[(arena, key)] = s
        push(busy, (end, s))
    return count


def _slots(ticks, when, at, S: int, R: int, M: int):
    """Colours every value's lifetime: ``(slot, counts, lifetimes)``.

    `when` is the tick of every piece (`_Layout.when`), `at` the rank of every
    ``(stage, microbatch)`` (`TickPlan.key_rank`) and `counts` is
    ``(num_io, num_res, num_carry)``.

    Works for any tick table: a forward's residuals live until its ``W``
    piece when there is one (a forward-only plan keeps none).
    """
    SM = S * M
    io = [[] for _ in range(R)]
    res = [[] for _ in range(R)]
    carry = [[] for _ in range(R)]
    # In the order of the table (the lifetimes keep it): a value lives from
    # the position (tick, phase) it is made at to the one it is read at,
    # `_pos` written out (it is called twice a piece).
    P = _NUM_PHASES
    for t, row in enumerate(ticks):
        for pieces in row:
            for kind, s, m in pieces:
                if kind == "W":
                    continue
                if kind == "F":
                    nxt = s + 1
                    if nxt < S:  # the output goes to the next stage's F
                        dst = at[nxt * M + m]
                        end = P * when[nxt * M + m] + _PH_F_READ
                        io[dst].append((P * t + _PH_SEND, end, ("F", nxt, m)))
                    w = when[2 * SM + s * M + m]
                    if w >= 0:
                        res[at[s * M + m]].append(
                            (P * t + _PH_F_WRITE_RES, P * w + _PH_W_READ, (s, m))
                        )
                else:
                    nxt = s - 1
                    if nxt >= 0:  # the input gradient goes to the previous stage's I
                        dst = at[nxt * M + m]
                        end = P * when[SM + nxt * M + m] + _PH_I_READ
                        io[dst].append((P * t + _PH_SEND, end, ("I", nxt, m)))
                    w = when[2 * SM + s * M + m]
                    if w >= 0:
                        carry[at[s * M + m]].append(
                            (P * t + _PH_I_WRITE_CARRY, P * w + _PH_W_READ, (s, m))
                        )
    intervals = {"io": io, "res": res, "carry": carry}
    slot, counts = {}, []
    for arena, per_rank in intervals.items():
        counts.append(max((_colour(ivs, arena, slot) for ivs in per_rank), default=0))
    lifetimes = {a: tuple(tuple(ivs) for ivs in intervals[a]) for a in ("res", "carry")}
    return slot, tuple(counts), lifetimes


def _memory_slots(schedule: Schedule, layout: _Layout, ticks):
    """`_slots` for a schedule with memory actions: ``(slot, counts, lifetimes, moves, res_key)``.

    The io values are as in `_slots`, except that the input of an ``FC``
    lives on until its recompute reads it. A residual lives from its ``F``
    (or its recompute, ``R``) in intervals split at each `Move`, which ends
    one (position: the start of the move's tick, before any piece reads) and
    begins the next on the rank, the partner or the host that then holds
    it; the last ends at its ``W``. `res_key` names the interval each piece
    writes or reads.
    """
    info = analyze(schedule)
    at, R = info.key_rank, schedule.num_ranks
    S, M = info.num_stages, info.num_microbatches
    SM = S * M
    when = layout.when
    P = _NUM_PHASES
    io = [[] for _ in range(R)]
    carry = [[] for _ in range(R)]
    fc = set()
    for t, row in enumerate(ticks):
        for pieces in row:
            for kind, s, m in pieces:
                if kind == "FC":
                    fc.add((s, m))
                if kind in ("F", "FC") and s + 1 < S:
                    # To the next stage's forward; an FC keeps it until its recompute.
                    nxt = s + 1
                    read = when[3 * SM + nxt * M + m]
                    if read < 0:
                        read = when[nxt * M + m]
                    io[at[nxt * M + m]].append(
                        (P * t + _PH_SEND, P * read + _PH_F_READ, ("F", nxt, m))
                    )
                elif kind == "I":
                    if s > 0:
                        end = P * when[SM + (s - 1) * M + m] + _PH_I_READ
                        io[at[(s - 1) * M + m]].append((P * t + _PH_SEND, end, ("I", s - 1, m)))
                    w = when[2 * SM + s * M + m]
                    carry[at[s * M + m]].append(
                        (P * t + _PH_I_WRITE_CARRY, P * w + _PH_W_READ, (s, m))
                    )
    res, host, moves, res_key = _residual_intervals(layout, fc, at, R, S, M)
    intervals = {"io": io, "res": res, "carry": carry, "host": host}
    slot, counts = {}, []
    for arena, per_rank in intervals.items():
        n = max((_colour(ivs, arena, slot) for ivs in per_rank), default=0)
        if arena != "host":
            counts.append(n)
    lifetimes = {a: tuple(tuple(ivs) for ivs in intervals[a]) for a in ("res", "carry", "host")}
    return slot, tuple(counts), lifetimes, tuple(sorted(moves, key=lambda mv: mv.tick)), res_key


def _residual_intervals(layout: _Layout, fc, at, R: int, S: int, M: int):
    """`_memory_slots`' residuals: ``(res, host, moves, res_key)``, the intervals on each
    rank and on its host (in the order of their keys), each `Move` and each piece's key.

    `fc` holds the ``(stage, microbatch)`` pairs whose forward is an ``FC``; `at` the
    rank of each (`TickPlan.key_rank`).
    """
    SM = S * M
    when = layout.when
    P = _NUM_PHASES
    res = [[] for _ in range(R)]
    host = [[] for _ in range(R)]
    by_key: dict = {}
    for tick, kind, s, m, r, partner in layout.moves:
        by_key.setdefault((s, m), []).append((tick, kind, r, partner))
    moves, res_key = [], {}
    for s in range(S):
        for m in range(M):
            r = at[s * M + m]
            made = "R" if (s, m) in fc else "F"
            start = P * when[_KIND_INDEX[made] * SM + s * M + m] + _PH_F_WRITE_RES
            key, where, arena = (s, m), r, res
            res_key[(made, s, m)] = key
            spans = []  # (start, end, key) of the intervals on the rank itself
            for j, (tick, kind, _, partner) in enumerate(sorted(by_key.get((s, m), ())), 1):
                arena[where].append((start, P * tick, key))
                if where == r and arena is res:
                    spans.append((start, P * tick, key))
                new_key = (s, m, j)
                # EVICT to the partner, OFFLOAD to the host, LOAD and RELOAD back home
                to = partner if kind == "EVICT" else r
                new_arena = host if kind == "OFFLOAD" else res
                moves.append(Move(kind, tick, s, m, where, to, key, new_key))
                start, key, where, arena = P * tick, new_key, to, new_arena
            end = P * when[2 * SM + s * M + m] + _PH_W_READ
            res[where].append((start, end, key))
            spans.append((start, end, key))
            res_key[("W", s, m)] = key
            i = P * when[SM + s * M + m] + _PH_I_READ
            res_key[("I", s, m)] = next(k for a, b, k in spans if a <= i <= b)
    return res, host, moves, res_key


def plan_lifetimes(schedule: Schedule, layout: str = "auto") -> dict:
    """`make_tick_plan(schedule, layout).lifetimes` alone: the same intervals in the same
    order, without the tick table and the slots (what `jpipe.search_schedule` sizes the
    SPMD program's buffers from, for every schedule it tries).

    Each rank runs at most one piece of a kind in a tick, so the order of the table
    (`_slots`, `_memory_slots`) is, on each rank, the order of the pieces' ticks. Those
    of the ``"auto"`` layout are worked out once and kept on the schedule, which is
    immutable (as `jpipe.validate`'s analysis is).
    """
    if layout == "auto":
        kept = schedule.__dict__.get("_lifetimes")
        if kept is None:
            kept = _plan_lifetimes(schedule, layout)
            object.__setattr__(schedule, "_lifetimes", kept)  # frozen, but not a field
        return dict(kept)
    return _plan_lifetimes(schedule, layout)


def _plan_lifetimes(schedule: Schedule, layout: str) -> dict:
    chosen = _choose_layout(schedule, layout)
    info = analyze(schedule)
    at, R = info.key_rank, schedule.num_ranks
    S, M = info.num_stages, info.num_microbatches
    SM = S * M
    when = chosen.when
    P = _NUM_PHASES
    memory = schedule.has_memory_actions
    carry = [[] for _ in range(R)]
    if memory:
        fc = {a.key for row in info.rows for a in row if a.kind == "FC"}
        res, host, _, _ = _residual_intervals(chosen, fc, at, R, S, M)
    else:
        res = [[] for _ in range(R)]
    for s in range(S):
        for m in range(M):
            k = s * M + m
            r = at[k]
            w = when[2 * SM + k]
            i = when[SM + k]
            if i >= 0 and (memory or w >= 0):
                carry[r].append((P * i + _PH_I_WRITE_CARRY, P * w + _PH_W_READ, (s, m)))
            f = when[k]
            if not memory and f >= 0 and w >= 0:
                res[r].append((P * f + _PH_F_WRITE_RES, P * w + _PH_W_READ, (s, m)))
    for ivs in carry if memory else carry + res:
        ivs.sort(key=operator.itemgetter(0))  # one start per rank and kind of piece
    arenas = ("res", "carry", "host") if memory else ("res", "carry")
    intervals = {"res": res, "carry": carry, "host": host if memory else None}
    return {a: tuple(tuple(ivs) for ivs in intervals[a]) for a in arenas}


def pack_lifetimes(lifetimes, size_of) -> tuple[int, dict]:
    """Places values that live over intervals in one buffer: ``(extent, {key: offset})``.

    `lifetimes` are ``(start, end, key)`` intervals (as in `TickPlan.lifetimes`)
    and ``size_of(key)`` each value's size. First fit, in order of start: a
    value takes the lowest offset where it overlaps no value still live.
    Where all values have one size (a rank that holds one stage) this is the
    interval colouring of the slots, so the extent is the peak of live
    values times their size, which no placement can beat. With several sizes
    (two stages a rank, residuals beside carries, a head's beside a block's)
    first fit in order of start can leave holes that a large value does not
    fit: then the largest values are also placed first (each at the lowest
    offset free of every value placed before it that it meets in time), and
    the smaller extent of the two is kept. Either is at least the peak of
    live bytes.
    """
    lifetimes = list(lifetimes)
    extent, out = _first_fit_by_start(lifetimes, size_of)
    if len({size_of(key) for _, _, key in lifetimes}) > 1:
        largest = sorted(lifetimes, key=lambda iv: (-size_of(iv[2]), iv[0], iv[1]))
        other = _first_fit(largest, size_of)
        if other[0] < extent:
            return other
    return extent, out


def _first_fit_by_start(lifetimes, size_of) -> tuple[int, dict]:
    """`pack_lifetimes`' sweep: in order of start, the lowest offset free of the values live."""
    live: list[tuple[int, int, int]] = []  # (offset, size, end), kept in order
    extent, out = 0, {}
    for start, end, key in sorted(lifetimes, key=lambda iv: (iv[0], iv[1])):
        live = [v for v in live if v[2] >= start]
        size = size_of(key)
        offset = 0
        for off, n, _ in live:
            if off - offset >= size:
                break
            offset = max(offset, off + n)
        out[key] = offset
        if size:
            bisect.insort(live, (offset, size, end))
            extent = max(extent, offset + size)
    return extent, out


def _first_fit(order, size_of) -> tuple[int, dict]:
    """Each value in `order` at the lowest offset free of those placed before it that it meets."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, offset + size, start, end), in order
    extent, out = 0, {}
    for start, end, key in order:
        size = size_of(key)
        offset = 0
        for lo, hi, a, b in placed:  # by offset: those it meets in time, lowest first
            if a <= end and start <= b:
                if lo - offset >= size:
                    break
                offset = max(offset, hi)
        out[key] = offset
        if size:
            bisect.insort(placed, (offset, offset + size, start, end))
            extent = max(extent, offset + size)
    return extent, out


def make_tick_plan(
    schedule: Schedule, layout: str = "auto", *, forward_only: bool = False
) -> TickPlan:
    """Lays `schedule` out in ticks and assigns its buffer slots.

    `layout` is ``"unit"``, ``"packed"`` or ``"auto"``: the packed layout
    where its lock-step time with unit costs (`TickPlan.predicted_time`) is no
    longer than the unit layout's (it then has the same critical path in
    fewer ticks: GPipe, interleaved 1F1B), else the unit layout (1F1B, whose
    bounded warm-up cannot keep packed ticks full).

    With `forward_only`, the plan runs only the schedule's forwards, to
    compute a loss (`make_forward_tick_plan`; `layout` is ignored).

    Memory actions (`TickPlan` says how they run) are laid out unit; asking
    for the packed layout then is refused.
    """
    if forward_only:
        return make_forward_tick_plan(schedule)
    check_layout(layout)
    info = analyze(schedule)
    chosen = _choose_layout(schedule, layout)  # slots for the chosen layout only
    return _plan_of(schedule, chosen, info)


def make_forward_tick_plan(schedule: Schedule) -> TickPlan:
    """A plan that runs only the forwards of `schedule` (to compute a loss).

    Each rank runs its ``F`` actions in the schedule's order, one per tick, as
    soon as the forward it depends on has run; nothing is kept for a backward
    (every residual write goes to the spare slot). Memory actions keep
    nothing either: an ``FC`` runs as an ``F``, the rest are dropped.
    """
    schedule = schedule.without_memory_actions()
    info = analyze(schedule)
    # One piece of one kind per tick: labelled unit (see `TickPlan.layout`).
    layout = _packed_layout(schedule, kinds=("F",))._replace(name="unit")
    plan = _plan_of(schedule, layout, info)
    for piece in (p for row in plan.ticks for pieces in row for p in pieces):
        plan.slot[("res", piece[1:])] = plan.num_res  # the spare slot: nothing is kept
    return plan


def _plan_of(schedule: Schedule, layout: _Layout, info) -> TickPlan:
    """The `TickPlan` of a `_Layout`: its table and its slots."""
    R, S, M = schedule.num_ranks, info.num_stages, info.num_microbatches
    ticks = _ticks(schedule, layout)
    moves, res_key = (), {}
    if schedule.has_memory_actions:
        slot, (num_io, num_res, num_carry), lifetimes, moves, res_key = _memory_slots(
            schedule, layout, ticks
        )
    else:
        slot, (num_io, num_res, num_carry), lifetimes = _slots(
            ticks, layout.when, info.key_rank, S, R, M
        )
    channels = _channels(schedule, layout)
    return TickPlan(
        schedule,
        layout.name,
        ticks,
        tuple(info.stage_to_rank),
        channels,
        num_io,
        num_res,
        num_carry,
        slot,
        lifetimes,
        moves,
        res_key,
        tuple(info.key_rank),
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
    "f_mode",  # which forward-kind piece: F_MODES (F, FC keeping only its input, recompute)
)
STAGE_COLUMNS = ("f_stage", "i_stage", "w_stage")
TickPlan.COLUMNS = COLUMNS
TickPlan.F_MODES = F_MODES


def _table(plan: TickPlan) -> np.ndarray:
    """`TickPlan.table`: the integer table the program scans over."""
    S = plan.schedule.num_stages
    R = plan.num_ranks
    at, M = plan.key_rank, plan.schedule.num_microbatches
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
        mode = F_MODES.get(kind)
        if mode is not None:  # F, FC and R use the F columns
            out[t, r, col["f_mode"]] = mode
            kind = "F"
        k = kind.lower()
        out[t, r, col[f"{k}_stage"]] = 1 + s
        out[t, r, col[f"{k}_microbatch"]] = m
        if mode != F_MODES["FC"]:  # an FC keeps no residuals
            key = plan.res_key.get((piece[0], s, m), (s, m))
            out[t, r, col[f"{k}_res"]] = slot[("res", key)]
        if kind == "F" and s > 0 or kind == "I" and s + 1 < S:
            out[t, r, col[f"{k}_in"]] = slot[("io", (kind, s, m))]
        if kind in ("I", "W"):
            out[t, r, col[f"{k}_carry"]] = slot[("carry", (s, m))]
        nxt = s + 1 if kind == "F" else s - 1
        if mode == F_MODES["R"]:
            continue  # a recompute sends nothing
        if kind != "W" and 0 <= nxt < S:
            consumer = (kind, nxt, m)
            dst = at[nxt * M + m]
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
