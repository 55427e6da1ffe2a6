"""`jpipe.validate`: broken schedules are rejected with a message a person can act on.

The messages are pinned word for word: they are the validator's user
interface. If you reword one on purpose, update the expectation here.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jpipe
from jpipe import B, F, I, Overlap, Schedule, ScheduleError, W


def _gpipe(num_ranks, num_microbatches):
    return Schedule.of(
        [F(r, m) for m in range(num_microbatches)] + [B(r, m) for m in range(num_microbatches)]
        for r in range(num_ranks)
    )


# (id, schedule, keyword arguments for validate, the exact message)
BROKEN = [
    (
        "missing_forward",
        Schedule.of([[F(0, 0), B(0, 0), B(0, 1)], [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]]),
        {},
        "rank 0 (which holds stage 0): F(0,1) is missing",
    ),
    (
        "missing_backward",
        Schedule.of([[F(0, 0), F(0, 1), B(0, 0)], [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]]),
        {},
        "rank 0 (which holds stage 0): the backward of (0,1) is missing: "
        "add B(0,1) or I(0,1) and W(0,1)",
    ),
    (
        "duplicated_action",
        Schedule.of([[F(0, 0), F(0, 0), B(0, 0)]]),
        {},
        "rank 0, position 1 (F(0,0)): duplicate; F(0,0) already appears at rank 0, position 0",
    ),
    (
        # Positions count cells as written: an Overlap cell is one position.
        "duplicated_inside_overlap",
        Schedule.of([[F(0, 0), Overlap(F(0, 1), B(0, 0)), F(0, 1), B(0, 1)]]),
        {},
        "rank 0, position 2 (F(0,1)): duplicate; F(0,1) already appears at rank 0, position 1",
    ),
    (
        # A stage may be on two ranks (replicas), a microbatch of it on one.
        "backward_away_from_its_forward",
        Schedule.of([[F(0, 0), F(0, 1), B(0, 1)], [B(0, 0)]]),
        {},
        "rank 1, position 0 (B(0,0)): its forward, F(0,0), runs on rank 0 (position 0); "
        "every action of (0,0) runs on the rank that runs its forward and holds its "
        "residuals. A stage may run on several ranks (replicas, as in Chimera: each rank "
        "keeps a copy of its parameters, their gradients summed over the copies), but one "
        "microbatch of it runs on one of them",
    ),
    (
        "w_before_i_on_same_rank",
        Schedule.of([[F(0, 0), W(0, 0), I(0, 0)]]),
        {},
        "rank 0, position 1 (W(0,0)): comes before I(0,0) at position 2, which it needs",
    ),
    (
        "b_before_its_f",
        Schedule.of([[B(0, 0), F(0, 0)]]),
        {},
        "rank 0, position 0 (B(0,0)): comes before F(0,0) at position 1, which it needs",
    ),
    (
        "i_without_w",
        Schedule.of([[F(0, 0), I(0, 0)]]),
        {},
        "rank 0 (which holds stage 0): I(0,0) has no matching W(0,0)",
    ),
    (
        "w_without_i",
        Schedule.of([[F(0, 0), B(0, 0), F(0, 1), W(0, 1)]]),
        {},
        "rank 0 (which holds stage 0): W(0,1) has no matching I(0,1)",
    ),
    (
        "both_b_and_i",
        Schedule.of([[F(0, 0), I(0, 0), B(0, 0), W(0, 0)]]),
        {},
        "rank 0 (which holds stage 0): (0,0) has both a B and an I/W backward; "
        "use one or the other",
    ),
    (
        "negative_index",
        Schedule.of([[F(0, 0), B(0, 0), F(0, -1)]]),
        {},
        "rank 0, position 2 (F(0,-1)): stage and microbatch must be >= 0",
    ),
    (
        "stage_out_of_range",
        _gpipe(2, 1),
        {"num_stages": 1},
        "rank 1, position 0 (F(1,0)): stage 1 is out of range; the model has 1 stage (0..0)",
    ),
    (
        "microbatch_out_of_range",
        _gpipe(1, 2),
        {"num_microbatches": 1},
        "rank 0, position 1 (F(0,1)): microbatch 1 is out of range; there is 1 microbatch (0..0)",
    ),
    (
        "stage_missing_entirely",
        Schedule.of([[F(0, 0), B(0, 0)], [F(2, 0), B(2, 0)]]),
        {},
        "stage 1 appears on no rank; stages 0..2 must all be scheduled "
        "(the highest stage is at rank 1, position 0 (F(2,0)))",
    ),
    (
        "microbatch_missing_entirely",
        Schedule.of([[F(0, 0), B(0, 0), F(0, 2), B(0, 2)]]),
        {},
        "microbatch 1 is missing: no rank has an action for it "
        "(microbatches 0..2 must all be scheduled; the highest is at "
        "rank 0, position 2 (F(0,2)))",
    ),
    (
        "deadlock_2_ranks",
        # Rank 0 runs microbatch 0 to the end before starting 1; rank 1 wants 1 first.
        Schedule.of([[F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 1), B(1, 1), F(1, 0), B(1, 0)]]),
        {},
        "deadlock: no rank can make progress.\n"
        "  rank 0, position 1 (B(0,0)) waits for B(1,0) on rank 1, "
        "which is itself stuck at position 0 (F(1,1))\n"
        "  rank 1, position 0 (F(1,1)) waits for F(0,1) on rank 0, "
        "which is itself stuck at position 1 (B(0,0))",
    ),
    (
        "deadlock_4_ranks",
        # Rank 0 finishes microbatch 0 before forwarding 1, rank 1 forwards 1
        # before its backward of 0: a cycle through ranks 0 and 1 that also
        # starves ranks 2 and 3.
        Schedule.of(
            [[F(0, 0), B(0, 0), F(0, 1), B(0, 1)]]
            + [[F(r, 0), F(r, 1), B(r, 0), B(r, 1)] for r in (1, 2)]
            + [[F(3, 1), B(3, 1), F(3, 0), B(3, 0)]]
        ),
        {},
        "deadlock: no rank can make progress.\n"
        "  rank 0, position 1 (B(0,0)) waits for B(1,0) on rank 1, "
        "which is itself stuck at position 1 (F(1,1))\n"
        "  rank 1, position 1 (F(1,1)) waits for F(0,1) on rank 0, "
        "which is itself stuck at position 1 (B(0,0))\n"
        "  rank 2, position 1 (F(2,1)) waits for F(1,1) on rank 1, "
        "which is itself stuck at position 1 (F(1,1))\n"
        "  rank 3, position 0 (F(3,1)) waits for F(2,1) on rank 2, "
        "which is itself stuck at position 1 (F(2,1))",
    ),
    (
        "live_activation_budget",
        _gpipe(2, 3),
        {"max_live": 2},
        "rank 0, position 2 (F(0,2)): 3 live activations exceed the budget of 2 on rank 0",
    ),
    (
        "live_activation_budget_per_rank",
        _gpipe(2, 3),
        {"max_live": [3, 1]},
        "rank 1, position 1 (F(1,1)): 2 live activations exceed the budget of 1 on rank 1",
    ),
    (
        "empty_schedule",
        Schedule.of([[], []]),
        {},
        "the schedule has no actions",
    ),
]


@pytest.mark.parametrize(
    "schedule, kwargs, message", [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN]
)
def test_broken_schedule_is_rejected_with_its_message(schedule, kwargs, message):
    with pytest.raises(ScheduleError) as info:
        jpipe.validate(schedule, **kwargs)
    assert str(info.value) == message


def test_deadlock_message_names_every_stuck_rank():
    schedule = BROKEN[[c[0] for c in BROKEN].index("deadlock_4_ranks")][1]
    with pytest.raises(ScheduleError) as info:
        jpipe.validate(schedule)
    lines = str(info.value).splitlines()[1:]
    assert [line.split(",")[0].strip() for line in lines] == [f"rank {r}" for r in range(4)]
    assert all(" waits for " in line for line in lines)


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


def test_a_valid_schedule_is_returned_unchanged():
    schedule = Schedule.of([[F(0, 0), I(0, 0), W(0, 0)]], name="one")
    assert jpipe.validate(schedule, num_stages=1, num_microbatches=1, max_live=1) is schedule


# -- properties ---------------------------------------------------------------------
#
# A random valid schedule: random sizes, each rank holds at least one stage and
# the rest go anywhere, each backward is B or I+W at random, and the actions
# are dealt to their ranks in one random order that respects every dependency,
# so no rank can wait on another forever. Some F followed directly by a B or I
# on the same rank are fused into an Overlap cell.


def _ready(action, done, num_stages):
    s, m = action.stage, action.microbatch
    backward_done = lambda stage: B(stage, m) in done or I(stage, m) in done  # noqa: E731
    if action.kind == "F":
        return s == 0 or F(s - 1, m) in done
    if action.kind == "W":
        return I(s, m) in done
    return F(s, m) in done and (s == num_stages - 1 or backward_done(s + 1))


def _random_schedule(rng: random.Random, R: int, S: int, M: int, replicas=False) -> Schedule:
    """Every (stage, microbatch) in a random order that can run; each stage on one rank,
    or (`replicas`) each microbatch on one of two placements, so stages have copies."""
    owner = list(range(R)) + [rng.randrange(R) for _ in range(S - R)]
    rng.shuffle(owner)
    other = owner[:]
    rng.shuffle(other)
    placement = [other if replicas and rng.random() < 0.5 else owner for _ in range(M)]
    todo = []
    for s in range(S):
        for m in range(M):
            todo.append(F(s, m))
            todo.extend([B(s, m)] if rng.random() < 0.5 else [I(s, m), W(s, m)])
    done, rows = set(), [[] for _ in range(R)]
    while todo:
        ready = [a for a in todo if _ready(a, done, S)]
        a = rng.choice(ready)
        todo.remove(a)
        done.add(a)
        rows[placement[a.microbatch][a.stage]].append(a)
    for row in rows:
        i = 0
        while i + 1 < len(row):
            if row[i].kind == "F" and row[i + 1].kind in "BI" and rng.random() < 0.3:
                row[i : i + 2] = [Overlap(row[i], row[i + 1])]
            i += 1
    return Schedule.of(rows, name="random")


@st.composite
def valid_schedules(draw):
    R = draw(st.integers(1, 4))
    S = draw(st.integers(R, 2 * R))
    M = draw(st.integers(1, 4))
    rng = draw(st.randoms(use_true_random=False))
    return _random_schedule(rng, R, S, M, replicas=draw(st.booleans()))


def _runs_to_the_end(schedule: Schedule) -> bool:
    """A slow, obviously correct reference: run whatever can run until stuck."""
    rows = [list(schedule.actions(r)) for r in range(schedule.num_ranks)]
    done, S = set(), schedule.num_stages
    progress = True
    while progress:
        progress = False
        for row in rows:
            while row and _ready(row[0], done, S):
                done.add(row.pop(0))
                progress = True
    return not any(rows)


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(valid_schedules())
def test_random_valid_schedules_validate_and_simulate(schedule):
    assert jpipe.validate(schedule) is schedule
    sim = jpipe.simulate(schedule, jpipe.Costs(F=1, I=2, W=1, comm=0.5))
    actions = [a for _, _, a in schedule.all_actions()]
    cost = {"F": 1, "I": 2, "W": 1, "B": 3}
    assert sum(sim.busy) == pytest.approx(sum(cost[a.kind] for a in actions))
    assert sim.makespan >= max(sim.busy) - 1e-9
    assert 0 <= sim.bubble_fraction < 1
    # Each microbatch is sent between the ranks it runs on: a forward starts no earlier
    # than the one before it ends, plus the transfer where they are on two ranks.
    info = jpipe.schedule.validate.analyze(schedule)
    M = info.num_microbatches
    rank = {(s, m): info.key_rank[s * M + m] for s in range(info.num_stages) for m in range(M)}
    ends = {(e.action.kind, e.action.stage, e.action.microbatch): e for e in sim.timeline}
    for e in sim.timeline:
        a = e.action
        assert rank[a.stage, a.microbatch] == e.rank
        if a.kind == "F" and a.stage > 0:
            hop = 0.5 if rank[a.stage - 1, a.microbatch] != e.rank else 0.0
            assert e.start >= ends["F", a.stage - 1, a.microbatch].end + hop - 1e-9
    # each rank holds the parameters of every stage it runs, copies included
    held = jpipe.simulate(schedule, sizes=jpipe.Sizes(params=1)).peak_bytes
    assert held == tuple(
        float(len({a.stage for a in schedule.actions(r)})) for r in range(schedule.num_ranks)
    )


def _cells(schedule):
    return [list(row) for row in schedule.ranks]


@FAST
@given(valid_schedules(), st.randoms(use_true_random=False))
def test_dropping_an_action_is_rejected(schedule, rng):
    r, pos, action = rng.choice(list(schedule.all_actions()))
    rows = _cells(schedule)
    step = rows[r][pos]
    rest = [part for part in step.parts if part != action]
    rows[r][pos : pos + 1] = rest  # an Overlap loses one half, a plain action goes
    with pytest.raises(ScheduleError):
        jpipe.validate(Schedule.of(rows))


@FAST
@given(valid_schedules(), st.randoms(use_true_random=False))
def test_duplicating_an_action_is_rejected(schedule, rng):
    _, _, action = rng.choice(list(schedule.all_actions()))
    rows = _cells(schedule)
    target = rng.randrange(len(rows))
    rows[target].insert(rng.randint(0, len(rows[target])), action)
    with pytest.raises(ScheduleError, match="duplicate|on two ranks"):
        jpipe.validate(Schedule.of(rows))


@FAST
@given(valid_schedules(), st.randoms(use_true_random=False))
def test_swapping_two_actions_on_a_rank_is_rejected_exactly_when_it_cannot_run(schedule, rng):
    rows = _cells(schedule)
    r = rng.choice([r for r, row in enumerate(rows) if len(row) >= 2] or [None])
    if r is None:
        return
    i, j = rng.sample(range(len(rows[r])), 2)
    rows[r][i], rows[r][j] = rows[r][j], rows[r][i]
    swapped = Schedule.of(rows)
    if _runs_to_the_end(swapped):
        assert jpipe.validate(swapped) is swapped
    else:
        with pytest.raises(ScheduleError, match="deadlock|comes before"):
            jpipe.validate(swapped)


def _users_chimera(R=4, M=4):
    """Chimera as a user writes it (issue 39): even microbatches go down (stage s on
    rank s), odd ones up (stage s on rank R-1-s), so each stage is on two ranks; each
    rank runs its forwards, then its backwards."""
    rows = [[] for _ in range(R)]
    for m in range(M):
        for s in range(R):
            rows[s if m % 2 == 0 else R - 1 - s].append(F(s, m))
    for m in range(M):
        for s in reversed(range(R)):
            rows[s if m % 2 == 0 else R - 1 - s].append(B(s, m))
    return Schedule.of(rows)


def test_a_users_chimera_validates_with_each_stage_on_two_ranks():
    chimera = _users_chimera()
    assert jpipe.validate(chimera) is chimera
    assert chimera.replicated
    assert chimera.stage_ranks == ((0, 3), (1, 2), (1, 2), (0, 3))
    assert chimera.stages_of(0) == (0, 3) and chimera.stages_of(2) == (1, 2)
    info = jpipe.schedule.validate.analyze(chimera)
    M = info.num_microbatches
    # each (stage, microbatch) on the rank its direction puts it
    assert [info.key_rank[s * M + m] for s in range(4) for m in (0, 1)] == [0, 3, 1, 2, 2, 1, 3, 0]
    # The simulator holds each copy of the parameters on its rank, and a transfer
    # follows each microbatch's own ranks: with comm = 1, microbatch 1's forward
    # reaches stage 3 (rank 0) three hops after it left rank 3.
    sim = jpipe.simulate(chimera, jpipe.Costs(comm=1), jpipe.Sizes(params=10, activation=1))
    assert sim.peak_bytes == (24.0, 24.0, 24.0, 24.0)
    start = {(e.action.kind, e.action.stage, e.action.microbatch): e.start for e in sim.timeline}
    assert start[("F", 3, 1)] - start[("F", 0, 1)] == 3 * (1 + 1)
    # A replicated stage's gradients are summed once its last backward anywhere has run.
    sim = jpipe.simulate(chimera, jpipe.Costs(sync=5))
    last_b = {s: max(e.end for e in sim.timeline if e.action.stage == s) for s in range(4)}
    assert [(x.stage, x.ranks, x.start, x.end) for x in sim.syncs] == [
        (s, chimera.stage_ranks[s], last_b[s], last_b[s] + 5) for s in range(4)
    ]
    assert sim.makespan == max(x.end for x in sim.syncs)


@pytest.mark.parametrize("layout", ["spmd", "mpmd"])
def test_the_byte_models_count_each_ranks_copies(layout):
    # Every rank of Chimera holds two stages' parameters (and their gradients),
    # where 1F1B's ranks hold one.
    from jpipe.search.engine import StageFigures, device_bytes

    fig = StageFigures(num_stages=4, sizes=jpipe.Sizes(params=10, activation=1))
    chimera, one = jpipe.get_schedule("chimera", 4, 8), jpipe.get_schedule("1f1b", 4, 8)
    held = device_bytes(jpipe.simulate(chimera), fig, layout, packed_everywhere=False)
    single = device_bytes(jpipe.simulate(one), fig, layout, packed_everywhere=False)
    assert held.params == tuple(2 * p for p in single.params)


def test_a_missing_key_of_a_replicated_stage_names_every_rank_of_the_stage():
    rows = [["0F0", "0F2", "1F1", "1B1", "0B0", "0B2"], ["0F1", "1F0", "1F3", "1B3", "1B0"]]
    rows[1] += ["0B1"]
    rows.append(["0F3", "0B3"])
    with pytest.raises(ScheduleError) as info:
        jpipe.validate(Schedule.of(rows))
    assert str(info.value) == "ranks 0 and 1 (which hold stage 1): F(1,2) is missing"


def test_costs_may_be_given_per_rank():
    """One `Costs` per rank times each rank's actions with its own: the same Costs on
    every rank is the one Costs; a slower rank 0 runs its copies slower there only."""
    chimera = _users_chimera()
    one = jpipe.Costs(F=1, B=2, sync=3)
    assert jpipe.simulate(chimera, [one] * 4).ends == jpipe.simulate(chimera, one).ends
    slow = jpipe.Costs(F=2, B=4, sync=3)
    sim = jpipe.simulate(chimera, [slow, one, one, one])
    for e in sim.timeline:
        want = {"F": 1, "B": 2}[e.action.kind] * (2 if e.rank == 0 else 1)
        assert e.end - e.start == want, e
    assert sim.makespan > jpipe.simulate(chimera, one).makespan
    with pytest.raises(ValueError, match="one Costs for each of the schedule's 4 ranks, got 3"):
        jpipe.simulate(chimera, [one] * 3)
    with pytest.raises(ValueError, match="rank 2's costs give comm=1 but rank 0's 0"):
        jpipe.simulate(chimera, [one, one, jpipe.Costs(F=1, B=2, sync=3, comm=1), one])
