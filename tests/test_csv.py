"""PyTorch's CSV form: round trips, PyTorch's own files, and readable errors."""

from pathlib import Path

import pytest

import jpipe
from jpipe import B, F, I, Overlap, Schedule, W

PYTORCH_SCHEDULES = Path(__file__).parent / "data" / "pytorch-schedules"  # see its README
ZB1P = "zb1p_2rank_2stagep_compute.csv"
DUALPIPEV = "dualpipev_4rank_10mb.csv"


@pytest.fixture
def pytorch_schedules() -> Path:
    return PYTORCH_SCHEDULES


# -- round trips --------------------------------------------------------------------

MIXED = Schedule.of(
    [
        [F(0, 0), F(0, 1), Overlap(F(3, 0), I(3, 0)), W(3, 0), B(0, 0), F(3, 1), B(3, 1), B(0, 1)],
        [F(1, 0), F(2, 0), F(1, 1), I(2, 0), F(2, 1), W(2, 0), B(1, 0), B(2, 1), B(1, 1)],
    ],
    name="mixed",
)


def test_round_trip_through_text_keeps_overlaps_and_split_backwards():
    text = MIXED.to_csv()
    assert text.splitlines()[0] == "0F0,0F1,(3F0;3I0)OVERLAP_F_B,3W0,0B0,3F1,3B1,0B1"
    assert Schedule.from_csv_text(text) == MIXED
    jpipe.validate(MIXED)


def test_round_trip_through_a_file(tmp_path):
    path = tmp_path / "mixed.csv"
    text = MIXED.to_csv(path)
    assert path.read_text() == text
    again = Schedule.from_csv(path)
    assert again == MIXED
    assert again.name == "mixed.csv"


def test_blank_cells_are_skipped_and_do_not_survive_a_round_trip():
    text = "0F0,,0F1,0B0,,0B1\n,1F0,1B0,,1F1,1B1,,\n"
    schedule = Schedule.from_csv_text(text)
    assert schedule == Schedule.of(
        [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]]
    )
    assert schedule.to_csv() == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    assert Schedule.from_csv_text(schedule.to_csv()) == schedule


def test_an_idle_rank_in_the_middle_survives_a_round_trip():
    schedule = Schedule.of([[F(0, 0), B(0, 0)], [], [F(1, 0), B(1, 0)]])
    assert Schedule.from_csv_text(schedule.to_csv()) == schedule


def test_legacy_b_followed_by_w_reads_as_i_also_inside_an_overlap():
    schedule = Schedule.from_csv_text("0F0,0F1,(0F2;0B0)OVERLAP_F_B,0W0,0B1,0W1,0B2\n")
    assert schedule.ranks[0] == (
        F(0, 0),
        F(0, 1),
        Overlap(F(0, 2), I(0, 0)),
        W(0, 0),
        I(0, 1),
        W(0, 1),
        B(0, 2),  # no W(0,2) follows: a full backward
    )


# -- PyTorch's files ------------------------------------------------------------------


def test_zb1p_file_reads_legacy_b_as_i(pytorch_schedules):
    schedule = Schedule.from_csv(pytorch_schedules / ZB1P)
    assert schedule.name == ZB1P
    assert (schedule.num_ranks, schedule.num_stages, schedule.num_microbatches) == (2, 4, 8)
    assert schedule.stage_to_rank == (0, 1, 0, 1)
    # Row 1 is "0F0,0F1,2F0,,2F1,2B0,2W0,...": the blank cell is skipped.
    assert schedule.ranks[0][:7] == (F(0, 0), F(0, 1), F(2, 0), F(2, 1), I(2, 0), W(2, 0), F(0, 2))
    # Row 2 starts with a blank cell: ",1F0,1F1,3F0,3B0,3F1,3B1,3W0,...".
    assert schedule.ranks[1][:7] == (F(1, 0), F(1, 1), F(3, 0), I(3, 0), F(3, 1), I(3, 1), W(3, 0))
    kinds = [a.kind for _, _, a in schedule.all_actions()]
    assert kinds.count("B") == 0
    assert kinds.count("I") == kinds.count("W") == kinds.count("F") == 4 * 8


def test_dualpipev_file_reads_overlapped_cells(pytorch_schedules):
    schedule = Schedule.from_csv(pytorch_schedules / DUALPIPEV)
    assert (schedule.num_ranks, schedule.num_stages, schedule.num_microbatches) == (4, 8, 10)
    assert schedule.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    # Row 1, columns 17..19: "7F3,(0F7;7B3)OVERLAP_F_B,(7F4;0B0)OVERLAP_F_B".
    assert schedule.ranks[0][16:19] == (
        F(7, 3),
        Overlap(F(0, 7), B(7, 3)),
        Overlap(F(7, 4), B(0, 0)),
    )
    # Row 4, column 11: "(4F4;3B0)OVERLAP_F_B".
    assert schedule.ranks[3][10] == Overlap(F(4, 4), B(3, 0))
    overlaps = [c for row in schedule.ranks for c in row if isinstance(c, Overlap)]
    assert len(overlaps) == 41
    assert all(o.forward.kind == "F" and o.backward.kind == "B" for o in overlaps)


@pytest.mark.parametrize(
    "filename, makespan, busy",
    [(ZB1P, 49.0, (48.0, 48.0)), (DUALPIPEV, 63.0, (60.0, 60.0, 60.0, 60.0))],
)
def test_pytorch_files_validate_simulate_and_round_trip(
    pytorch_schedules, filename, makespan, busy
):
    schedule = Schedule.from_csv(pytorch_schedules / filename)
    assert jpipe.validate(schedule) is schedule
    sim = jpipe.simulate(schedule)  # F = I = W = 1, B = 2, no latency
    assert sim.busy == busy
    # Golden value: if the simulator's timing rules change on purpose, update it.
    assert sim.makespan == makespan
    assert Schedule.from_csv_text(schedule.to_csv()) == schedule


# -- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, where, why",
    [
        ("0F0,0X1\n", "row 1 column 2", "cannot read schedule cell '0X1'"),
        ("0F0,0B0\n1F0,,F2\n", "row 2 column 3", "cannot read schedule cell 'F2'"),
        ("0F\n", "row 1 column 1", "cannot read schedule cell '0F'"),
        ("1F0,-1B0\n", "row 1 column 2", "cannot read schedule cell '-1B0'"),
        ("\n\n0F0,(0F1;1B2)OVERLAP\n", "row 3 column 2", "cannot read schedule cell"),
        ("(0F1;1F2)OVERLAP_F_B\n", "row 1 column 1", "Overlap.backward must be a B or I action"),
        ("0F0,(0B1;1F0)OVERLAP_F_B\n", "row 1 column 2", "Overlap.forward must be an F action"),
    ],
)
def test_a_bad_cell_names_its_row_and_column(text, where, why):
    with pytest.raises(ValueError) as info:
        Schedule.from_csv_text(text)
    assert str(info.value).startswith(f"CSV {where}: {why}")


def test_a_bad_cell_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1Q0\n")
    with pytest.raises(
        ValueError, match=r"^bad\.csv row 2 column 2: cannot read schedule cell '1Q0'"
    ):
        Schedule.from_csv(path)
