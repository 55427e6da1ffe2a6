"""The tick layouts and slots as `jpipe.lower.spmd.ticks` first computed them, kept as an oracle.

`tests/test_plan.py` checks that `jpipe.make_tick_plan` gives exactly these
tables, channels, slots and lifetimes. This is the direct reading of the
rules (a dictionary per piece, the packed greedy visiting every rank every
tick), slow at scale (about 3 s for 1F1B on 64 ranks x 1,024 microbatches)
but plain to check by eye; `jpipe.lower.spmd.ticks` now computes the same in one pass
in dependency order (see its `_packed_layout`). Only public names are used.
"""

import heapq

import jpipe

_PH_F_READ, _PH_F_WRITE_RES, _PH_I_READ, _PH_I_WRITE_CARRY, _PH_W_READ, _PH_SEND = range(6)
_READ_PHASE = {"F": _PH_F_READ, "I": _PH_I_READ, "W": _PH_W_READ}
KINDS = ("F", "I", "W")


def _pos(tick, phase):
    return 6 * tick + phase


def _pieces_of(action):
    if action.kind == "B":
        return [("I", action.stage, action.microbatch), ("W", action.stage, action.microbatch)]
    return [(action.kind, action.stage, action.microbatch)]


def _needs(piece, num_stages):
    kind, s, m = piece
    if kind == "F":
        return [("F", s - 1, m)] if s > 0 else []
    if kind == "I":
        return [("F", s, m)] + ([("I", s + 1, m)] if s + 1 < num_stages else [])
    return [("I", s, m)]


def unit_ticks(schedule):
    sim = jpipe.simulate(schedule, jpipe.Costs(F=1, I=1, W=1, B=2, comm=0))
    R = schedule.num_ranks
    placed = {}
    for ev in sim.timeline:
        t = int(round(ev.start))
        for i, piece in enumerate(_pieces_of(ev.action)):
            assert (t + i, ev.rank) not in placed, "two pieces in one tick on one rank"
            placed[(t + i, ev.rank)] = (piece,)
    first = min(t for t, _ in placed)
    last = max(t for t, _ in placed)
    return tuple(tuple(placed.get((t, r), ()) for r in range(R)) for t in range(first, last + 1))


def packed_ticks(schedule, kinds=KINDS):
    owner = schedule.stage_to_rank
    S, R = schedule.num_stages, schedule.num_ranks
    order = {k: i for i, k in enumerate(kinds)}
    lists = [
        [p for a in schedule.actions(r) for p in _pieces_of(a) if p[0] in order] for r in range(R)
    ]
    done = {}
    pc = [0] * R
    remaining = sum(len(x) for x in lists)
    ticks = []
    while remaining:
        t = len(ticks)
        row = []
        for r in range(R):
            taken = []
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
        assert any(row), f"packing made no progress at tick {t}"
        remaining -= sum(len(x) for x in row)
        ticks.append(tuple(row))
    return tuple(ticks)


def lockstep_time(ticks):
    """The lock-step time with unit costs: each piece costs 1, each tick its fullest rank."""
    return float(sum(max(len(pieces) for pieces in row) for row in ticks))


def _colour(intervals):
    free, busy, count, out = [], [], 0, {}
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


def slots(ticks, owner, R):
    """``(slot, (num_io, num_res, num_carry), channels, lifetimes)`` of a tick table."""
    S = len(owner)
    when = {p: t for t, row in enumerate(ticks) for pieces in row for p in pieces}
    shared_channels = all(
        sum(1 for p in pieces if p[0] != "W") <= 1 for row in ticks for pieces in row
    )
    intervals = {arena: [[] for _ in range(R)] for arena in ("io", "res", "carry")}
    channels = set()
    for (kind, s, m), t in when.items():
        if kind == "W":
            continue
        nxt = s + 1 if kind == "F" else s - 1
        if 0 <= nxt < S:
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


def transfers(ticks, owner, channels, R):
    """``(sent, exposed, collectives, idle)``, as `jpipe.TickPlan.transfers`."""
    S = len(owner)
    when = {p: t for t, row in enumerate(ticks) for pieces in row for p in pieces}
    sent = exposed = 0
    busy = set()
    index = {c: i for i, c in enumerate(channels)}
    for (kind, s, m), t in when.items():
        nxt = s + 1 if kind == "F" else s - 1
        if kind == "W" or not 0 <= nxt < S or owner[nxt] == owner[s]:
            continue
        sent += 1
        exposed += when[(kind, nxt, m)] == t + 1
        shift = (owner[nxt] - owner[s]) % R
        busy.add((t, index.get((None, shift), index.get((kind, shift)))))
    total = len(ticks) * len(channels)
    return sent, exposed, total, total - len(busy)


def plan(schedule, layout="auto", forward_only=False):
    """``(layout, ticks, channels, (num_io, num_res, num_carry), slot, lifetimes)``."""
    owner, R = schedule.stage_to_rank, schedule.num_ranks
    if forward_only:
        ticks = packed_ticks(schedule, kinds=("F",))
        slot, counts, channels, lifetimes = slots(ticks, owner, R)
        for piece in (p for row in ticks for pieces in row for p in pieces):
            slot[("res", piece[1:])] = counts[1]
        return "unit", ticks, channels, counts, slot, lifetimes
    if layout == "auto":
        unit, packed = unit_ticks(schedule), packed_ticks(schedule)
        better = lockstep_time(packed) <= lockstep_time(unit)
        layout, ticks = ("packed", packed) if better else ("unit", unit)
    else:
        ticks = packed_ticks(schedule) if layout == "packed" else unit_ticks(schedule)
    slot, counts, channels, lifetimes = slots(ticks, owner, R)
    return layout, ticks, channels, counts, slot, lifetimes
