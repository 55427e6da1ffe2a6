"""Plans without JAX: the tick layouts and the slots, replayed from the table.

`replay` runs the int table the program scans over, phase by phase as the
program does (F, I, W, then the sends), on labels instead of arrays: every
slot read must find exactly the value the piece needs, so two values that are
alive at once can never share a slot, and every transfer lands where its
consumer looks. This checks the colouring and the table independently of the
lowering, for every built-in and for random schedules, in both layouts.
"""

import dataclasses
import json
from pathlib import Path

import numpy as np
import plan_reference
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_compiler_properties import random_schedule

import jpipe
from jpipe.lower.spmd.ticks import plan_lifetimes

LAYOUTS = ("unit", "packed")
BUILTINS = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("eager_1f1b", 1),
    ("zb_h1", 1),
    ("zb_h2", 1),
    ("interleaved_1f1b", 2),
    ("looped_bfs", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]


def replay(plan) -> int:
    """Replays `plan.table()`; returns the number of pieces run. Fails on a wrong read."""
    S = plan.schedule.num_stages
    R = plan.num_ranks
    owner = plan.stage_to_rank
    tab = plan.table()
    col = {name: i for i, name in enumerate(jpipe.TickPlan.COLUMNS)}
    spare = {"io": plan.num_io, "res": plan.num_res, "carry": plan.num_carry, "host": -1}
    state = [{arena: {} for arena in spare} for _ in range(R)]
    ran = 0
    modes = {v: k for k, v in jpipe.TickPlan.F_MODES.items()}

    def write(r, arena, slot, value):
        if slot != spare[arena]:
            state[r][arena][slot] = value

    def read(r, arena, slot, want, where):
        got = state[r][arena].get(slot)
        assert got == want, f"{where}: {arena} slot {slot} holds {got}, expected {want}"

    for t in range(plan.num_ticks):
        # Copies of memory actions first, at the tick's start (all read, then all written).
        landed = []
        for move in (mv for mv in plan.moves if mv.tick == t):
            src = "host" if move.kind == "RELOAD" else "res"
            dst = "host" if move.kind == "OFFLOAD" else "res"
            where = f"tick {t} {move.kind} {move.stage}.{move.microbatch} {move.src}->{move.dst}"
            want = ("res", move.stage, move.microbatch)
            read(move.src, src, plan.slot[(src, move.src_key)], want, where)
            landed.append((move.dst, dst, plan.slot[(dst, move.dst_key)], want))
        for r, arena, slot, value in landed:
            write(r, arena, slot, value)
        outputs = [{} for _ in range(R)]  # rank -> kind -> the piece its output feeds
        for r in range(R):
            row = tab[t, r]
            for kind in ("f", "i", "w"):
                stage = int(row[col[f"{kind}_stage"]])
                if not stage:
                    continue
                s, m = stage - 1, int(row[col[f"{kind}_microbatch"]])
                K = kind.upper()
                mode = modes[int(row[col["f_mode"]])] if K == "F" else K
                where = f"tick {t} rank {r} {mode}{s}.{m}"
                assert owner[s] == r, where
                ran += 1
                if K == "F":
                    if s > 0:  # an FC's input is still there for its recompute
                        read(r, "io", row[col["f_in"]], ("F", s, m), where)
                    if mode == "FC":
                        assert row[col["f_res"]] == spare["res"], where
                    else:
                        write(r, "res", row[col["f_res"]], ("res", s, m))
                    if s + 1 < S and mode != "R":
                        outputs[r]["F"] = ("F", s + 1, m)
                elif K == "I":
                    if s + 1 < S:
                        read(r, "io", row[col["i_in"]], ("I", s, m), where)
                    read(r, "res", row[col["i_res"]], ("res", s, m), where)
                    write(r, "carry", row[col["i_carry"]], ("carry", s, m))
                    if s > 0:
                        outputs[r]["I"] = ("I", s - 1, m)
                else:
                    read(r, "res", row[col["w_res"]], ("res", s, m), where)
                    read(r, "carry", row[col["w_carry"]], ("carry", s, m), where)
        for r in range(R):  # local hand-overs, then arrivals, as the program does
            for kind in ("F", "I"):
                consumer = outputs[r].get(kind)
                if consumer is not None and owner[consumer[1]] == r:
                    write(r, "io", tab[t, r, col[f"{kind.lower()}_local"]], consumer)
        for r in range(R):
            for c, (kind, d) in enumerate(plan.channels):
                sender = (r - d) % R
                sent = [
                    v
                    for k, v in outputs[sender].items()
                    if (kind is None or k == kind) and owner[v[1]] == r
                ]
                slot = tab[t, r, len(jpipe.TickPlan.COLUMNS) + c]
                if slot != spare["io"]:
                    assert len(sent) == 1, (t, r, kind, d, sent)
                    write(r, "io", slot, sent[0])
    return ran


def check_plan(schedule, layout):
    plan = jpipe.make_tick_plan(schedule, layout)
    assert plan.layout == layout
    # the search's shortcut to the lifetimes (no table, no slots) finds the same, in order
    assert plan_lifetimes(schedule, layout) == plan.lifetimes
    pieces = sum(
        2 if a.kind == "B" else 1
        for _, _, a in schedule.all_actions()
        if a.kind in ("F", "B", "I", "W", "FC", "RECOMPUTE")
    )
    assert replay(plan) == pieces
    order = {"F": 0, "FC": 0, "R": 0, "I": 1, "W": 2}
    piece_kind = {"B": ("I", "W"), "RECOMPUTE": ("R",)}
    for r in range(schedule.num_ranks):
        listed = [
            (k, a.stage, a.microbatch)
            for a in schedule.actions(r)
            for k in piece_kind.get(a.kind, (a.kind,))
            if k in order
        ]
        ran = [p for row in plan.ticks for p in row[r]]
        assert ran == listed, f"rank {r} does not keep its list order"
        for t, row in enumerate(plan.ticks):
            kinds = [order[p[0]] for p in row[r]]
            assert kinds == sorted(set(kinds)), f"tick {t} rank {r}: {row[r]}"
            if layout == "unit":
                assert len(row[r]) <= 1
    if schedule.has_memory_actions:
        return plan
    # The residual slots are the schedule's promise: its simulated peak.
    assert plan.num_res == max(jpipe.simulate(schedule).peak_activations)
    return plan


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,chunks", BUILTINS)
def test_builtin_plans_replay(name, chunks, layout):
    checked = 0
    for ranks, microbatches in [(2, 1), (2, 5), (4, 4), (4, 9), (8, 16)]:
        try:
            schedule = jpipe.get_schedule(name, ranks, microbatches, chunks)
        except (jpipe.ScheduleError, ValueError):
            continue  # this schedule needs more microbatches
        check_plan(schedule, layout)
        checked += 1
    assert checked >= 3, name


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**31),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(1, 6),
    st.sampled_from(LAYOUTS),
)
def test_random_plans_replay(seed, ranks, stages, microbatches, layout):
    schedule = random_schedule(seed, ranks, max(ranks, stages), microbatches)
    check_plan(schedule, layout)


MEMORY_BUILTINS = [
    ("1f1b_recompute", {"k": 1}),
    ("1f1b_recompute", {"k": 2}),
    ("1f1b_bpipe", {}),
    ("zb_h1_offload", {}),
]


@pytest.mark.parametrize("name,options", MEMORY_BUILTINS)
def test_memory_action_plans_replay(name, options):
    # Every copy finds its value where the plan put it, a recompute finds
    # its FC's input still in its io slot, and every reader its residuals.
    for ranks, microbatches in [(2, 4), (4, 8), (8, 16)]:
        schedule = jpipe.get_schedule(name, ranks, microbatches, **options)
        plan = check_plan(schedule, "unit")
        copies = {"EVICT": "EVICT", "LOAD": "LOAD", "OFFLOAD_START": "OFFLOAD"}
        copies["RELOAD_START"] = "RELOAD"
        began = [a for _, _, a in schedule.all_actions() if a.kind in copies]
        assert sorted((copies[a.kind], a.stage, a.microbatch) for a in began) == sorted(
            (mv.kind, mv.stage, mv.microbatch) for mv in plan.moves
        )
        assert jpipe.make_tick_plan(schedule).layout == "unit"  # auto


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    ranks=st.integers(1, 4),
    stages=st.integers(1, 6),
    microbatches=st.integers(1, 5),
)
def test_random_memory_plans_replay(seed, ranks, stages, microbatches):
    schedule = random_schedule(seed, ranks, max(ranks, stages), microbatches, memory=True)
    check_plan(schedule, "unit")


def test_memory_actions_are_laid_out_unit_only():
    schedule = jpipe.get_schedule("1f1b_bpipe", 4, 8)
    with pytest.raises(ValueError, match="memory actions .EVICT, LOAD., which the compiler lays"):
        jpipe.make_tick_plan(schedule, "packed")
    forward = jpipe.make_tick_plan(schedule, forward_only=True)  # FC as F, nothing kept
    assert forward.moves == () and forward == jpipe.make_tick_plan(
        schedule.without_memory_actions(), forward_only=True
    )


def test_forward_plan_replays_and_keeps_nothing():
    schedule = jpipe.get_schedule("zbv", 4, 8, 2)
    plan = jpipe.make_tick_plan(schedule, forward_only=True)
    assert replay(plan) == sum(a.kind == "F" for _, _, a in schedule.all_actions())
    assert plan.num_res == 0
    assert all(len(pieces) <= 1 for row in plan.ticks for pieces in row)
    assert {p[0] for _, _, p in plan.pieces()} == {"F"}


def test_auto_takes_packed_only_where_it_is_no_slower():
    # GPipe and interleaved 1F1B keep their critical path in fewer packed
    # ticks; 1F1B's warm-up is too shallow to keep packed ticks full.
    for name, chunks, want in [
        ("gpipe", 1, "packed"),
        ("interleaved_1f1b", 2, "packed"),
        ("1f1b", 1, "unit"),
    ]:
        schedule = jpipe.get_schedule(name, 4, 16, chunks)
        unit, packed = (
            jpipe.make_tick_plan(schedule, "unit"),
            jpipe.make_tick_plan(schedule, "packed"),
        )
        auto = jpipe.make_tick_plan(schedule)
        assert auto.layout == want, name
        assert auto.predicted_time() == min(unit.predicted_time(), packed.predicted_time())
        if want == "packed":
            assert packed.num_ticks < unit.num_ticks
    assert jpipe.make_tick_plan(jpipe.get_schedule("1f1b", 4, 16), "packed").predicted_time() > 57


def test_unknown_layout_is_refused():
    with pytest.raises(
        ValueError, match="unknown tick layout 'fast': use one of auto, unit, packed"
    ):
        jpipe.make_tick_plan(jpipe.get_schedule("1f1b", 2, 2), "fast")


def test_replay_catches_values_that_share_a_slot():
    # The replay is the check above: squeezing 1F1B's residuals into one slot
    # must make some backward read another microbatch's residuals.
    plan = jpipe.make_tick_plan(jpipe.get_schedule("1f1b", 4, 8), "unit")
    assert plan.num_res > 1
    squeezed = dict(plan.slot)
    squeezed.update({key: 0 for key in plan.slot if key[0] == "res"})
    broken = dataclasses.replace(plan, slot=squeezed)
    with pytest.raises(AssertionError, match="res slot 0 holds"):
        replay(broken)


def test_the_table_is_as_narrow_as_it_can_be():
    # It is the one part of the program that grows with M.
    assert jpipe.make_tick_plan(jpipe.get_schedule("1f1b", 2, 128)).table().dtype == np.int8
    assert jpipe.make_tick_plan(jpipe.get_schedule("1f1b", 2, 129)).table().dtype == np.int16


# -- the plan equals the first implementation's ---------------------------------------

PYTORCH_FILES = ("zb1p_2rank_2stagep_compute.csv", "dualpipev_4rank_10mb.csv")


def _reference_cases():
    for name, chunks in [*BUILTINS, ("interleaved_1f1b", 3), ("looped_bfs", 3)]:
        for ranks, microbatches in [(1, 1), (1, 3), (2, 2), (2, 5), (3, 7), (4, 8), (4, 13)]:
            try:
                yield jpipe.get_schedule(name, ranks, microbatches, chunks)
            except (jpipe.ScheduleError, ValueError):
                continue  # this schedule needs other sizes
    for filename in PYTORCH_FILES:
        yield jpipe.Schedule.from_csv(
            Path(__file__).parent / "data" / "pytorch-schedules" / filename
        )
    for seed in range(120):  # ranks may hold no stage, or several in any order
        yield random_schedule(seed, 1 + seed % 4, 1 + seed % 6, 1 + seed % 5)


def test_plans_equal_the_first_implementations():
    """`make_tick_plan` now lays ticks out in one pass; the tables and slots are unchanged."""
    checked = 0
    for schedule in _reference_cases():
        for layout in ("auto", "unit", "packed", "forward"):
            if layout == "forward":
                plan = jpipe.make_tick_plan(schedule, forward_only=True)
                want = plan_reference.plan(schedule, forward_only=True)
            else:
                plan = jpipe.make_tick_plan(schedule, layout)
                want = plan_reference.plan(schedule, layout)
            got = (
                plan.layout,
                plan.ticks,
                plan.channels,
                (plan.num_io, plan.num_res, plan.num_carry),
                plan.slot,
                plan.lifetimes,
            )
            assert got == want, (schedule.name, schedule.num_ranks, layout)
            assert all(type(p).__name__ == "Piece" for _, _, p in plan.pieces())
            owner, R = schedule.stage_to_rank, schedule.num_ranks
            assert tuple(plan.transfers()) == plan_reference.transfers(
                plan.ticks, owner, plan.channels, R
            )
            checked += 1
    assert checked > 500


def test_show_prints_the_figures_of_make_tick_plan(capsys):
    from jpipe.show import main

    for name, chunks, cost in [
        ("1f1b", None, ""),
        ("gpipe", None, "F=1,B=3,comm=0.5"),
        ("zbv", 2, ""),
        ("interleaved_1f1b", 3, "F=2,I=1,W=1"),
    ]:
        argv = [name, "-r", "4", "-m", "12", "--json", "--cost", cost]
        assert main([*argv, *(["--chunks", str(chunks)] if chunks else [])]) == 0
        shown = json.loads(capsys.readouterr().out)["program"]
        plan = jpipe.make_tick_plan(jpipe.get_schedule(name, 4, 12, chunks))
        assert shown == {
            "tick_layout": plan.layout,
            "ticks": plan.num_ticks,
            "channels": len(plan.channels),
            **plan.transfers()._asdict(),
        }
