"""Memory actions in the schedule (issue 23, the pure-Python half).

FC (a forward that keeps only its input) and RECOMPUTE, EVICT/LOAD to a
partner rank, OFFLOAD/RELOAD start and end: the language and its CSV cells,
the validator's rules, the simulator's time and bytes, the charts and
``show``, the built-ins written with them, and both lowerings running them
exactly.
"""

import dataclasses
import json
import re

import jax
import pytest

import jpipe
from jpipe import (
    EVICT,
    FC,
    LOAD,
    OFFLOAD_END,
    OFFLOAD_START,
    RECOMPUTE,
    RELOAD_END,
    RELOAD_START,
    B,
    Costs,
    F,
    I,
    Schedule,
    ScheduleError,
    Sizes,
    W,
)
from jpipe.show import main

NEW_BUILTINS = ("1f1b_bpipe", "1f1b_recompute", "zb_h1_offload")
PLAIN_OF = {"1f1b_bpipe": "1f1b", "1f1b_recompute": "1f1b", "zb_h1_offload": "zb_h1"}
SHAPES = [(1, 1), (1, 3), (2, 1), (2, 4), (3, 5), (4, 2), (4, 8), (5, 10), (8, 4), (8, 16)]


# -- the language -------------------------------------------------------------------


def test_cells_constructors_and_reprs():
    cases = [
        (FC(2, 0), "2FC0", "FC(2,0)"),
        (RECOMPUTE(2, 0), "2RECOMPUTE0", "RECOMPUTE(2,0)"),
        (EVICT(2, 0, 5), "2EVICT0@5", "EVICT(2,0,5)"),
        (LOAD(2, 0, 5), "2LOAD0@5", "LOAD(2,0,5)"),
        (OFFLOAD_START(2, 0), "2OFFLOAD_START0", "OFFLOAD_START(2,0)"),
        (OFFLOAD_END(2, 0), "2OFFLOAD_END0", "OFFLOAD_END(2,0)"),
        (RELOAD_START(2, 0), "2RELOAD_START0", "RELOAD_START(2,0)"),
        (RELOAD_END(2, 0), "2RELOAD_END0", "RELOAD_END(2,0)"),
    ]
    for action, cell, text in cases:
        assert str(action) == cell and repr(action) == text
        assert jpipe.schedule.actions.parse_action(cell) == action
        assert action.is_memory and action.key == (2, 0)
        assert hash(action) == hash(jpipe.schedule.actions.parse_action(cell))
    assert not F(0, 0).is_memory and F(0, 0).partner is None
    assert EVICT(0, 1, 2) != EVICT(0, 1, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        FC(0, 0).kind = "F"
    with pytest.raises(TypeError, match="partner rank"):
        jpipe.Action("EVICT", 0, 1)
    with pytest.raises(ValueError, match="only EVICT and LOAD name a partner"):
        jpipe.Action("F", 0, 1, 2)


def test_csv_round_trip_with_memory_actions():
    schedule = Schedule.of(
        [
            ["0FC0", "0F1", "0EVICT1@1", "0OFFLOAD_START0"],  # an FC keeps no residuals to move
            ["1F0"],
        ]
    )
    assert Schedule.from_csv_text(schedule.to_csv()) == schedule
    builtin = jpipe.get_schedule("1f1b_bpipe", 4, 8)
    assert Schedule.from_csv_text(builtin.to_csv()) == builtin
    offload = jpipe.get_schedule("zb_h1_offload", 4, 8)
    assert Schedule.from_csv_text(offload.to_csv()) == offload


@pytest.mark.parametrize(
    "cell, why",
    [
        ("0EVICT0", "EVICT needs @PARTNER"),
        ("0LOAD3", "LOAD needs @PARTNER"),
        ("0F0@1", "F takes no @PARTNER"),
        ("0RECOMPUTE0@1", "RECOMPUTE takes no @PARTNER"),
        ("0OFFLOAD0", "cannot read schedule cell '0OFFLOAD0'"),
        ("0SEND_X0", "cannot read schedule cell '0SEND_X0'"),
        ("0FX0", "cannot read schedule cell '0FX0'"),
    ],
)
def test_unknown_or_malformed_cells_are_refused_by_name(cell, why):
    with pytest.raises(ValueError) as info:
        Schedule.from_csv_text(f"0F0,{cell}\n")
    assert str(info.value).startswith("CSV row 1 column 2: "), str(info.value)
    assert why in str(info.value) and repr(cell) in str(info.value)


def test_without_memory_actions_is_the_compute_skeleton():
    for name in NEW_BUILTINS:
        schedule = jpipe.get_schedule(name, 4, 8)
        assert schedule.has_memory_actions
        assert schedule.without_memory_actions() == jpipe.get_schedule(PLAIN_OF[name], 4, 8)
    plain = jpipe.get_schedule("1f1b", 4, 8)
    assert not plain.has_memory_actions and plain.without_memory_actions() is plain


# -- the validator ------------------------------------------------------------------

DOWN = ["1F0", "1B0", "1F1", "1B1"]  # rank 1 of a 2-rank, 2-microbatch 1F1B


def refused(rank0, rank1=DOWN, **kw):
    with pytest.raises(ScheduleError) as info:
        jpipe.validate(Schedule.of([rank0, rank1]), **kw)
    return str(info.value)


def test_well_placed_memory_actions_validate():
    for row in (
        ["0F0", "0EVICT0@1", "0F1", "0LOAD0@1", "0B0", "0B1"],
        ["0FC0", "0F1", "0RECOMPUTE0", "0B0", "0B1"],
        ["0F0", "0OFFLOAD_START0", "0F1", "0OFFLOAD_END0", "0RELOAD_START0", "0RELOAD_END0"]
        + ["0B0", "0B1"],
        # between I and W (W reads the residuals too)
        ["0F0", "0F1", "0I0", "0EVICT0@1", "0I1", "0W1", "0LOAD0@1", "0W0"],
    ):
        jpipe.validate(Schedule.of([row, DOWN]))


def test_a_load_before_its_evict_is_refused():
    message = refused(["0F0", "0LOAD0@1", "0EVICT0@1", "0F1", "0B0", "0B1"])
    assert message == (
        "rank 0, position 1 (LOAD(0,0,1)): comes before EVICT(0,0,1) at position 2, which it needs"
    )
    message = refused(["0F0", "0F1", "0LOAD0@1", "0B0", "0B1"])
    assert message == (
        "rank 0, position 2 (LOAD(0,0,1)): needs an EVICT of (0,0) before it, and rank 0 has none"
    )


def test_a_read_while_evicted_or_offloaded_is_refused():
    message = refused(["0F0", "0EVICT0@1", "0F1", "0B0", "0LOAD0@1", "0B1"])
    assert message.startswith(
        "rank 0, position 3 (B(0,0)): reads the residuals of (0,0) while they are evicted to "
        "rank 1 by EVICT(0,0,1) at position 1; LOAD must come before it"
    )
    row = ["0F0", "0OFFLOAD_START0", "0F1", "0OFFLOAD_END0", "0B0"]
    message = refused(row + ["0RELOAD_START0", "0RELOAD_END0", "0B1"])
    assert message == (
        "rank 0, position 4 (B(0,0)): reads the residuals of (0,0) while they are offloaded to "
        "the host by OFFLOAD_END(0,0) at position 3; RELOAD_START and RELOAD_END must come "
        "before it"
    )
    # still on their way back: the reader waits for the RELOAD_END
    row = ["0F0", "0OFFLOAD_START0", "0F1", "0OFFLOAD_END0", "0RELOAD_START0", "0B0"]
    assert "while they are still coming back from the host" in refused(row + ["0B1"])
    # offloading has begun: the device copy goes at the end, so nothing reads it meanwhile
    row = ["0F0", "0OFFLOAD_START0", "0F1", "0I0", "0OFFLOAD_END0", "0W0", "0B1"]
    assert refused(row).startswith(
        "rank 0, position 3 (I(0,0)): reads the residuals of (0,0) while they are being "
        "offloaded to the host by OFFLOAD_START(0,0) at position 1"
    )


def test_a_missing_or_misplaced_recompute_is_refused():
    assert refused(["0FC0", "0F1", "0B0", "0B1"]) == (
        "rank 0, position 2 (B(0,0)): reads the residuals of (0,0) while they are not made: "
        "FC(0,0) at position 0 kept only its input; a RECOMPUTE must come before it "
        "(missing recompute)"
    )
    assert refused(["0RECOMPUTE0", "0FC0", "0F1", "0B0", "0B1"]) == (
        "rank 0, position 0 (RECOMPUTE(0,0)): comes before FC(0,0) at position 1, which it needs"
    )
    assert refused(["0F0", "0F1", "0RECOMPUTE0", "0B0", "0B1"]) == (
        "rank 0, position 2 (RECOMPUTE(0,0)): nothing to recompute: F(0,0) at position 0 kept "
        "its residuals (an FC drops them)"
    )
    assert refused(["0FC0", "0F1", "0B1", "0B0", "0RECOMPUTE0"]).startswith(
        "rank 0, position 3 (B(0,0)): reads the residuals of (0,0) while they are not made"
    )


def test_other_misplaced_memory_actions_name_rank_position_and_action():
    row = ["0F0", "0EVICT0@1", "0F1", "0LOAD0@2", "0B0", "0B1"]
    assert refused(row, ["1F0", "1B0", "1F1", "1B1"]).startswith(
        "rank 0, position 3 (LOAD(0,0,2)): partner rank 2 must be another rank of the schedule"
    )
    assert refused(["0F0", "0EVICT0@0", "0F1", "0LOAD0@0", "0B0", "0B1"]).startswith(
        "rank 0, position 1 (EVICT(0,0,0)): partner rank 0 must be another rank"
    )
    three = Schedule.of([["0F0", "0EVICT0@1", "0LOAD0@2", "0B0"], ["1F0", "1B0"], ["2F0", "2B0"]])
    with pytest.raises(ScheduleError, match=r"^rank 0, position 2 \(LOAD\(0,0,2\)\): loads from "):
        jpipe.validate(three)
    assert refused(["0F0", "0F1", "0B0", "0EVICT0@1", "0B1"]) == (
        "rank 0, position 3 (EVICT(0,0,1)): moves the residuals of (0,0) while they are freed "
        "by B(0,0) at position 2"
    )
    row = ["0F0", "0OFFLOAD_START0", "0RELOAD_START0", "0OFFLOAD_END0", "0RELOAD_END0"]
    assert refused(row + ["0F1", "0B0", "0B1"]) == (
        "rank 0, position 2 (RELOAD_START(0,0)): comes before OFFLOAD_END(0,0) at position 3, "
        "which it needs"
    )
    assert refused(["0FC0", "0EVICT0@1", "0F1", "0B0", "0B1"]).startswith(
        "rank 0, position 1 (EVICT(0,0,1)): moves the residuals of (0,0) while they are not "
        "made: FC(0,0) at position 0 kept only its input"
    )
    assert refused(["0F0", "0FC0", "0F1", "0B0", "0B1"]) == (
        "rank 0, position 1 (FC(0,0)): a second forward of (0,0); F(0,0) already appears at "
        "rank 0, position 0"
    )
    assert refused(["0F0", "0EVICT0@1", "0EVICT0@1", "0F1", "0B0", "0B1"]).startswith(
        "rank 0, position 2 (EVICT(0,0,1)): duplicate"
    )
    # a memory action on another rank than its microbatch's forward
    assert refused(["0F0", "0F1", "0B0", "0B1"], DOWN + ["0OFFLOAD_START0"]).startswith(
        "rank 1, position 4 (OFFLOAD_START(0,0)): its forward, F(0,0), runs on rank 0 "
        "(position 0); every action of (0,0) runs on the rank that runs its forward"
    )
    assert refused(["0F0", "0F1", "0B0", "0B1"], DOWN + ["0FC0"]).startswith(
        "rank 1, position 4 (FC(0,0)): a second forward of (0,0)"
    )


def test_the_partners_holding_is_counted():
    # Rank 0 evicts microbatch 0 to rank 1 while rank 1 holds its own microbatch 0.
    schedule = Schedule.of([["0F0", "0EVICT0@1", "0F1", "0LOAD0@1", "0B0", "0B1"], DOWN])
    info = jpipe.schedule.validate.analyze(schedule)
    assert info.peak_live == (2, 2)  # rank 1: its own (1,0) and rank 0's (0,0)
    assert jpipe.simulate(schedule).peak_activations == (2, 2)
    jpipe.validate(schedule, max_live=2)
    with pytest.raises(ScheduleError) as e:
        jpipe.validate(schedule, max_live=[2, 1])
    assert str(e.value).startswith("rank 1, position 0 (F(1,0)): 2 live activations (1 of them ")
    assert "held for another rank" in str(e.value) and "exceed the budget of 1 on rank 1" in str(
        e.value
    )
    # Without the eviction rank 1 holds one at a time.
    assert jpipe.schedule.validate.analyze(schedule.without_memory_actions()).peak_live == (2, 1)


def test_the_deadlock_walk_treats_fc_as_a_forward():
    assert refused(["0F0", "0F1", "0B0", "0B1"], ["1B0", "1FC0", "1RECOMPUTE0", "1F1", "1B1"]) == (
        "rank 1, position 0 (B(1,0)): comes before FC(1,0) at position 1, which it needs"
    )
    rank0 = ["0FC0", "0RECOMPUTE0", "0B0", "0FC1", "0RECOMPUTE1", "0B1"]
    rank1 = ["1FC1", "1RECOMPUTE1", "1B1", "1F0", "1B0"]
    message = refused(rank0, rank1)
    assert message.startswith("deadlock: no rank can make progress.")
    assert (
        "rank 1, position 0 (FC(1,1)) waits for FC(0,1) on rank 0, which is itself stuck at "
        "position 2 (B(0,0))"
    ) in message


# -- the simulator: time ------------------------------------------------------------


def one_rank(*cells):
    return Schedule.of([list(cells)])


def test_recompute_costs_a_forward():
    plain = one_rank("0F0", "0B0")
    rebuilt = one_rank("0FC0", "0RECOMPUTE0", "0B0")
    costs = Costs(F=1.5, B=2)
    assert jpipe.simulate(plain, costs).makespan == 3.5
    sim = jpipe.simulate(rebuilt, costs)
    assert sim.makespan == 5.0 and sim.busy == (5.0,)
    assert jpipe.simulate(rebuilt, Costs(F=1.5, B=2, recompute=0.5)).makespan == 4.0


def test_transfers_run_beside_the_compute_and_the_reader_waits():
    # EVICT after F0, LOAD before F1: the load hides behind F1 when it is short enough.
    schedule = one_rank("0F0", "0EVICT0@0", "0F1", "0B1", "0B0")
    with pytest.raises(ScheduleError, match="partner rank 0 must be another rank"):
        jpipe.validate(schedule)
    rows = [["0F0", "0EVICT0@1", "0F1", "0LOAD0@1", "0F2", "0B2", "0B1", "0B0"], ["1F9"]]
    rows = [["0F0", "0EVICT0@1", "0F1", "0LOAD0@1", "0F2", "0B2", "0B1", "0B0"]]
    rows.append([])
    two = Schedule.of(rows)
    base = jpipe.simulate(two.without_memory_actions()).makespan
    assert base == 9.0
    assert jpipe.simulate(two, Costs(evict=0.5, load=1)).makespan == base  # hidden
    # A load of 4 lands at 2 + 4 = 6; the rank reached B0 at 7: still hidden.
    assert jpipe.simulate(two, Costs(evict=0.5, load=4)).makespan == base
    # A load of 6 lands at 8, one unit after B0 could start.
    assert jpipe.simulate(two, Costs(evict=0.5, load=6)).makespan == base + 1
    # The load waits for the eviction to land: evict 3 ends at 4, the load of 4 at 8.
    sim = jpipe.simulate(two, Costs(evict=3, load=4))
    assert sim.makespan == base + 1
    loads = [e for e in sim.timeline if e.action.kind == "LOAD"]
    assert (loads[0].start, loads[0].end) == (4.0, 8.0)
    assert sim.busy == (9.0, 0.0)  # transfers are not compute


def test_an_offload_end_waits_for_its_copy():
    cells = ["0F0", "0OFFLOAD_START0", "0F1", "0OFFLOAD_END0", "0F2"]
    cells += ["0RELOAD_START0", "0B2", "0B1", "0RELOAD_END0", "0B0"]
    schedule = one_rank(*cells)
    base = jpipe.simulate(schedule.without_memory_actions()).makespan
    assert jpipe.simulate(schedule).makespan == base
    assert jpipe.simulate(schedule, Costs(offload=1)).makespan == base  # hidden behind F1, B2 B1
    # An offload of 3 ends at 4; the rank reaches OFFLOAD_END at 2 and waits 2.
    sim = jpipe.simulate(schedule, Costs(offload=3, reload=1))
    assert sim.makespan == base + 2
    # A reload begun at 3 (after F2) hides behind B2 and B1 if it lands by 7.
    assert jpipe.simulate(schedule, Costs(offload=1, reload=4)).makespan == base
    assert jpipe.simulate(schedule, Costs(offload=1, reload=6)).makespan == base + 2


# -- the simulator: bytes -----------------------------------------------------------


def test_bytes_follow_the_residuals_and_the_partner_holds_them():
    rows = [["0F0", "0EVICT0@1", "0F1", "0B1", "0LOAD0@1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]]
    schedule = Schedule.of(rows)
    sizes = Sizes(activation=[10, 100], params=[1000, 2000])
    sim = jpipe.simulate(schedule, sizes=sizes)
    # Free transfers: rank 0 never holds both; rank 1 holds (0,0)'s 10 bytes while it
    # runs its own first microbatch.
    assert sim.peak_bytes == (1010.0, 2110.0)
    # Loaded before B1, (0,0) is back while (0,1) is still held.
    early = Schedule.of([["0F0", "0EVICT0@1", "0F1", "0LOAD0@1", "0B1", "0B0"], rows[1]])
    assert jpipe.simulate(early, sizes=sizes).peak_bytes == (1020.0, 2110.0)
    assert sim.peak_bytes_without == (1020.0, 2100.0)
    assert sim.summary()["peak_bytes_without_memory_actions"] == [1020.0, 2100.0]
    # A slow eviction keeps them on rank 0 until it lands (both count while in flight).
    slow = jpipe.simulate(schedule, Costs(evict=2), sizes)
    assert slow.peak_bytes == (1020.0, 2110.0)


def test_an_fc_holds_its_input_until_the_recompute_ends():
    schedule = one_rank("0FC0", "0F1", "0B1", "0RECOMPUTE0", "0B0")
    sim = jpipe.simulate(schedule, sizes=Sizes(activation=10, input=3))
    assert sim.peak_bytes == (13.0,)  # F1's residuals and FC0's input
    assert sim.peak_bytes_without == (20.0,)
    # during the recompute the input and the rebuilt residuals are both live
    assert jpipe.simulate(schedule, sizes=Sizes(activation=10, input=11)).peak_bytes == (21.0,)
    # the I-to-W carry stays while the residuals are away
    split = one_rank("0F0", "0I0", "0OFFLOAD_START0", "0F1", "0OFFLOAD_END0", "0I1", "0W1")
    split = Schedule.of([list(split.ranks[0]) + [RELOAD_START(0, 0), RELOAD_END(0, 0), W(0, 0)]])
    sim = jpipe.simulate(split, sizes=Sizes(activation=10, carry=1))
    # (0,0)'s residuals are freed at OFFLOAD_END, before I1's carry is made: at most
    # both residuals and I0's carry (21), where without the offload I1's carry joins them.
    assert sim.peak_bytes == (21.0,)
    assert sim.peak_bytes_without == (22.0,)
    events = [(e.action.kind, e.start) for e in sim.timeline if e.action.is_memory]
    assert events[:2] == [("OFFLOAD_START", 2.0), ("OFFLOAD_END", 3.0)]


def test_plain_schedules_are_unchanged():
    for name, p, m in (("1f1b", 4, 8), ("zb_h1", 3, 6), ("gpipe", 2, 3)):
        schedule = jpipe.get_schedule(name, p, m)
        sizes = Sizes(activation=7, carry=3, params=100)
        sim = jpipe.simulate(schedule, sizes=sizes)
        assert sim.peak_bytes == sim.peak_bytes_without
        assert sim.peak_bytes == jpipe.schedule.simulate.peak_bytes(
            schedule, sizes, schedule.num_stages
        )


# -- the built-ins ------------------------------------------------------------------


def build(name, p, m, **options):
    return jpipe.get_schedule(name, p, m, **options)


def test_the_new_builtins_are_registered():
    registered = jpipe.registered_schedules()
    for name in NEW_BUILTINS:
        assert registered[name].strip()


@pytest.mark.parametrize("name", NEW_BUILTINS)
@pytest.mark.parametrize("p,m", SHAPES)
def test_new_builtins_validate_and_keep_their_compute(name, p, m):
    schedule = build(name, p, m)
    jpipe.validate(schedule, num_stages=p, num_microbatches=m)
    assert schedule.without_memory_actions() == build(PLAIN_OF[name], p, m)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("p,m", SHAPES)
def test_1f1b_recompute_holds_at_most_k_microbatches(p, m, k):
    schedule = build("1f1b_recompute", p, m, k=k)
    act, inp, params = 10.0, 1.0, 1000.0
    residuals = jpipe.simulate(schedule, sizes=Sizes(activation=act)).peak_bytes
    assert residuals == tuple(min(k, p - r, m) * act for r in range(p))
    with_inputs = jpipe.simulate(schedule, sizes=Sizes(activation=act, input=inp, params=params))
    for r in range(p):
        n = min(p - r, m)
        assert with_inputs.peak_bytes[r] <= params + min(k, n) * act + n * inp
    assert max(jpipe.simulate(schedule).peak_activations) <= k


def test_1f1b_recompute_k2_against_1f1b():
    # R = 8, M = 16: 1F1B's rank r holds 8 - r microbatches, k = 2 holds at most 2
    sizes = Sizes(activation=1)
    plain = jpipe.simulate(build("1f1b", 8, 16), sizes=sizes)
    rebuilt = jpipe.simulate(build("1f1b_recompute", 8, 16, k=2), sizes=sizes)
    assert plain.peak_bytes == (8, 7, 6, 5, 4, 3, 2, 1)
    assert rebuilt.peak_bytes == (2, 2, 2, 2, 2, 2, 2, 1)
    assert rebuilt.makespan > plain.makespan  # each FC costs one more forward
    with pytest.raises(ValueError, match="k >= 1"):
        build("1f1b_recompute", 4, 8, k=0)


@pytest.mark.parametrize("costs", [Costs(), Costs(evict=0.5, load=0.5)])
def test_1f1b_bpipe_balances_each_pair(costs):
    sizes = Sizes(activation=1)
    for p, m in ((4, 8), (6, 12), (8, 16), (8, 32)):
        plain = jpipe.simulate(build("1f1b", p, m), costs, sizes).peak_bytes
        paired = jpipe.simulate(build("1f1b_bpipe", p, m), costs, sizes).peak_bytes
        for r in range(p // 2):  # the early ranks hold no more than in 1F1B, rank 0 less
            assert paired[r] <= plain[r]
        assert paired[0] < plain[0]
        assert max(paired) < max(plain)
        assert max(paired) <= -(-(p + 1) // 2) + 1
    sim = jpipe.simulate(build("1f1b_bpipe", 8, 16), costs, sizes)
    assert sim.peak_bytes == (5, 5, 5, 5, 4, 5, 5, 5)  # 1F1B: 8 .. 1
    # no transfer hides worse than the action before the backward
    assert sim.makespan == jpipe.simulate(build("1f1b", 8, 16), costs).makespan


def test_zb_h1_offload_below_zb_h1():
    sizes = Sizes(activation=1)
    for p, m in ((4, 8), (8, 16), (5, 10)):
        plain = jpipe.simulate(build("zb_h1", p, m), sizes=sizes).peak_bytes
        offloaded = jpipe.simulate(build("zb_h1_offload", p, m), sizes=sizes).peak_bytes
        assert all(a <= b for a, b in zip(offloaded, plain, strict=True))
        assert max(offloaded) < max(plain)
    assert jpipe.simulate(build("zb_h1_offload", 8, 16), sizes=sizes).peak_bytes == (
        3, 3, 4, 5, 6, 4, 3, 3,
    )  # fmt: skip
    # copies that fit behind one action cost no time
    hidden = Costs(offload=0.5, reload=0.5)
    assert (
        jpipe.simulate(build("zb_h1_offload", 8, 16), hidden).makespan
        == jpipe.simulate(build("zb_h1", 8, 16)).makespan
    )
    with pytest.raises(ValueError, match="min_gap >= 3"):
        build("zb_h1_offload", 4, 8, min_gap=2)


COST_CASES = [Costs(), Costs(evict=0.5, offload=0.5), Costs(F=1, I=2, W=0.5, evict=2, offload=3)]


@pytest.mark.parametrize("name", NEW_BUILTINS)
@pytest.mark.parametrize("costs", COST_CASES)
def test_memory_actions_never_raise_the_peak(name, costs):
    """Property: a built-in's simulated peak with its memory actions is at most its plain one's.

    Per rank where no rank holds for another; over the ranks (the SPMD
    program's extent) where a partner does. Inputs are part of the residuals
    (input <= activation), as they are for a stage. 1f1b_bpipe balances
    microbatch counts, not bytes: with stages of different residual sizes a
    partner can end above 1F1B's busiest rank, so it is held to stages of one
    size.
    """
    for p, m in SHAPES:
        for sizes in (
            Sizes(activation=1),
            Sizes(activation=10, input=2, carry=3, params=50),
            Sizes(activation=[5 * (s + 1) for s in range(p)], input=1, carry=1),
        ):
            if name == "1f1b_bpipe" and isinstance(sizes.activation, tuple):
                continue
            sim = jpipe.simulate(build(name, p, m), costs, sizes)
            plain = jpipe.simulate(build(PLAIN_OF[name], p, m), costs, sizes)
            assert sim.peak_bytes_without == plain.peak_bytes
            assert max(sim.peak_bytes) <= max(plain.peak_bytes)
            if name != "1f1b_bpipe":
                assert all(a <= b for a, b in zip(sim.peak_bytes, plain.peak_bytes, strict=True))


# -- the SPMD compiler's plan -------------------------------------------------------


@pytest.mark.parametrize("name", NEW_BUILTINS)
def test_the_compiler_plans_memory_actions(name):
    # The tick plan lays every memory action out (unit ticks, each copy one
    # tick long), keeps its residual slots within the simulated peaks where
    # copies take a tick, and refuses the packed layout by name.
    from jpipe.lower.spmd.ticks import make_forward_tick_plan, make_tick_plan, program_shape

    schedule = build(name, 4, 8)
    plan = make_tick_plan(schedule)
    assert plan.layout == "unit"
    began = {"EVICT", "LOAD", "OFFLOAD_START", "RELOAD_START"}
    assert len(plan.moves) == sum(a.kind in began for _, _, a in schedule.all_actions())
    timed = jpipe.simulate(schedule, Costs(evict=1, offload=1))
    assert plan.num_res <= max(timed.peak_activations)
    assert program_shape(schedule)["moves"] == len(plan.moves)
    assert make_forward_tick_plan(schedule) == make_forward_tick_plan(
        schedule.without_memory_actions()
    )
    kinds = ", ".join(sorted({a.kind for _, _, a in schedule.all_actions() if a.is_memory}))
    with pytest.raises(ValueError, match=re.escape(f"memory actions ({kinds})")):
        make_tick_plan(schedule, "packed")


# -- show and the charts -------------------------------------------------------------


def test_show_json_reports_peaks_with_and_without(capsys):
    argv = ["1f1b_recompute", "-r", "4", "-m", "8", "-o", "k=2", "--json"]
    assert main(argv + ["--bytes", "activation=10,input=1,params=100"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["peak_bytes_without_memory_actions"] == [140.0, 130.0, 120.0, 110.0]
    assert max(summary["peak_bytes"]) <= 100 + 2 * 10 + 4 * 1
    assert summary["program"]["moves"] == 0 and summary["program"]["ticks"] > 0
    assert summary["costs"]["evict"] == 0
    assert main(["1f1b", "-r", "2", "-m", "2", "--bytes", "activation=1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["peak_bytes"] == summary["peak_bytes_without_memory_actions"]
    assert summary["program"]["ticks"] > 0


def test_show_text_draws_the_new_glyphs(capsys, tmp_path):
    argv = ["1f1b_bpipe", "-r", "4", "-m", "6", "--cost", "evict=0.5", "--bytes", "activation=1"]
    svg, trace = tmp_path / "b.svg", tmp_path / "b.json"
    assert main(argv + ["--svg", str(svg), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "\nr0 mem" in out and "E1" in out and "L1" in out
    assert "E evict to the partner" in out
    assert "without memory actions" in out
    assert "; 6 copies of residuals (memory actions)" in out  # 3 evictions, 3 loads
    assert "<svg" in svg.read_text()
    events = json.loads(trace.read_text())["traceEvents"]
    moves = [e for e in events if e["ph"] == "X" and e["args"]["kind"] in ("EVICT", "LOAD")]
    assert moves and all(e["tid"] == 4 for e in moves) and moves[0]["args"]["partner"] == 3
    assert main(["1f1b_recompute", "-r", "4", "-m", "6"]) == 0
    out = capsys.readouterr().out
    assert " f1 " in out.split("\n")[3] and "R1" in out  # FC as f, RECOMPUTE as R
    assert main(["zb_h1_offload", "-r", "4", "-m", "8", "--cost", "offload=0.5"]) == 0
    out = capsys.readouterr().out
    assert "H0" in out and "D0" in out
    assert main(["zb_h1_offload", "-r", "4", "-m", "8"]) == 0  # free copies: a glyph each
    assert "r0 mem" in capsys.readouterr().out


def test_costs_and_sizes_parse_the_new_keys():
    costs = Costs.parse("F=1,evict=0.5,load=0.25,offload=2,reload=3,recompute=0.5")
    table = costs.memory_table(2)
    assert table["EVICT"] == (0.5, 0.5) and table["LOAD"] == (0.25, 0.25)
    assert table["OFFLOAD_START"] == (2, 2) and table["RELOAD_START"] == (3, 3)
    assert table["RECOMPUTE"] == (0.5, 0.5) and table["FC"] == (1, 1)
    assert Costs(evict=2).memory_table(1)["LOAD"] == (2.0,)
    assert Sizes.parse("activation=4,input=1").input == 1.0
    with pytest.raises(ValueError, match="cost evict must be a finite non-negative"):
        Costs(evict=-1)


def test_i_and_b_are_still_the_backward_kinds():
    # Overlap cells keep their rules: a forward is F, a backward B or I.
    with pytest.raises(ValueError, match="Overlap.forward must be an F action"):
        jpipe.Overlap(FC(0, 0), B(1, 0))
    assert I(0, 0).kind == "I"


# -- both lowerings run them ---------------------------------------------------------

# Each built-in with memory actions at sizes where it has them, on a data axis
# of 2 and on a tensor axis of 2 (stages writing their own psum over it).
LOWERED = [
    ("1f1b_recompute", 2, 4, {"k": 1}, {"FC", "RECOMPUTE"}),
    ("1f1b_bpipe", 4, 8, {}, {"EVICT", "LOAD"}),
    ("zb_h1_offload", 2, 4, {}, {"OFFLOAD_START", "OFFLOAD_END", "RELOAD_START", "RELOAD_END"}),
]


@pytest.mark.slow
@pytest.mark.parametrize("lowering", ["spmd", "mpmd"])
@pytest.mark.parametrize("name,p,m,options,kinds", LOWERED)
@pytest.mark.parametrize("axes", [{"data": 2}, {"tensor": 2}])
def test_memory_actions_run_exactly(name, p, m, options, kinds, axes, lowering):
    from jpipe import testing

    schedule = build(name, p, m, **options)
    assert {a.kind for _, _, a in schedule.all_actions() if a.is_memory} == kinds
    model = f"tensor:{testing.TENSOR_BLOCKS[0]}" if "tensor" in axes else None
    result = testing.check_schedule(schedule, model=model, lowering=lowering, **axes)
    assert result.passed, result


@pytest.mark.slow
@pytest.mark.parametrize("lowering", ["spmd", "mpmd"])
def test_a_hand_written_schedule_with_every_action_is_exact(lowering):
    # Two ranks, two microbatches: microbatch 0's stage-0 residuals go to the
    # host and back, its stage-1 forward keeps only its input, and microbatch
    # 1's stage-0 residuals wait on rank 1 (EVICT/LOAD), all in one step.
    from jpipe import testing

    schedule = Schedule.of(
        [
            "0F0 0OFFLOAD_START0 0F1 0EVICT1@1 0OFFLOAD_END0 0RELOAD_START0 0RELOAD_END0 "
            "0B0 0LOAD1@1 0B1".split(),
            "1FC0 1F1 1RECOMPUTE0 1B0 1I1 1W1".split(),
        ]
    )
    jpipe.validate(schedule)
    for data in (1, 2):
        result = testing.check_schedule(schedule, data=data, lowering=lowering)
        assert result.passed, result


def _computations_in_branches(hlo: str) -> dict:
    """An optimized HLO's computations: (whether a conditional's branch reaches it, text)."""
    bodies, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$", line)
        if head:
            name = head.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    called = {
        n: set(re.findall(r"%([\w.\-]+)", "\n".join(lines))) & bodies.keys()
        for n, lines in bodies.items()
    }
    todo = [
        c
        for lines in bodies.values()
        for line in lines
        if " conditional(" in line
        for c in set(re.findall(r"%([\w.\-]+)", line)) & bodies.keys()
    ]
    inside = set()
    while todo:
        c = todo.pop()
        if c not in inside:
            inside.add(c)
            todo += called[c]
    return {n: (n in inside, "\n".join(lines)) for n, lines in bodies.items()}


@pytest.mark.slow
def test_the_spmd_program_copies_residuals_without_branching_collectives():
    # Evictions and loads ride collectives that every device runs every
    # tick, outside any conditional (one that only some ranks take would
    # deadlock): BPipe's pairs (r, 3 - r) make one lane per stage class that evicts.
    from jpipe import testing

    schedule = build("1f1b_bpipe", 4, 8)
    stages, params, make_batch = testing.small_model(4)
    pipe = jpipe.Pipeline(stages, schedule, jpipe.make_mesh(4, 1, jax.devices()[:4]))
    packed = pipe.pack(params)
    batch = make_batch(16)
    hlo = pipe.compile(packed, batch).as_text()
    lanes = pipe.program(batch).lanes
    classes = pipe.program(batch).classes
    evicting = {classes[a.stage] for _, _, a in schedule.all_actions() if a.kind == "EVICT"}
    assert sorted(lane.stage_class for lane in lanes) == sorted(evicting)
    for lane in lanes:
        assert set(lane.perm) <= {(r, 3 - r) for r in range(4)}
    computations = _computations_in_branches(hlo)
    permutes = [n for n, (_, text) in computations.items() if "collective-permute" in text]
    assert permutes, "no collective-permute in the program"
    in_branch = [n for n in permutes if computations[n][0]]
    assert not in_branch, in_branch
    # Two channels for activations and gradients, one per lane: all in the tick's body.
    body = "\n".join(computations[n][1] for n in permutes)
    assert body.count("collective-permute(") + body.count("collective-permute-start(") >= 2 + len(
        lanes
    )


@pytest.mark.slow
def test_the_trainer_runs_memory_actions_under_spmd(tmp_path):
    # With dropout: a recompute draws the forward's own masks (they come from
    # the row keys in the batch), so the losses after updates match 1F1B's.
    import numpy as np
    from test_train import RTOL, tiny_config

    from jpipe import train as trainer

    def run(schedule):
        config = tiny_config(steps=3, eval_every=3, schedule=schedule, **{"model.dropout": 0.1})
        return trainer.train(config, str(tmp_path / schedule.replace(":", "_")), progress=False)

    plain = run("1f1b")
    for name in ("1f1b_recompute:k=1", "1f1b_bpipe"):
        other = run(name)
        np.testing.assert_allclose(
            [other.losses[s] for s in (1, 2, 3)], [plain.losses[s] for s in (1, 2, 3)], rtol=RTOL
        )
