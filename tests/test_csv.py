"""PyTorch's CSV form: round trips, PyTorch's own files, and readable errors."""

from pathlib import Path

import pytest

import jpipe
from jpipe import B, F, I, Overlap, Schedule, W

PYTORCH_SCHEDULES = Path(__file__).parent / "data" / "pytorch-schedules"  # see its README
ZB1P = "zb1p_2rank_2stagep_compute.csv"
ZB1P_COMMS = "zb1p_2rank_2stagep_comms.csv"
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


# -- PyTorch's runtime form: transfers, FSDP and gradient cells ----------------------

DROPPED = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")


def _compute_cells_only(text: str) -> str:
    """The CSV with every cell that is not compute blanked out."""
    rows = [row.split(",") for row in text.splitlines()]
    keep = [[c if not any(k in c for k in DROPPED) else "" for c in row] for row in rows]
    return "\n".join(",".join(row) for row in keep) + "\n"


def test_pytorch_comms_file_reads_as_its_compute_cells(pytorch_schedules):
    text = (pytorch_schedules / ZB1P_COMMS).read_text()
    assert "0SEND_F0,2RECV_F0" in text and "3SEND_B0,1RECV_B0" in text
    schedule = Schedule.from_csv(pytorch_schedules / ZB1P_COMMS)
    assert schedule == Schedule.from_csv_text(_compute_cells_only(text), name=ZB1P_COMMS)
    assert schedule.stage_to_rank == (0, 1, 0, 1)
    assert schedule.ranks[0][:5] == (F(0, 0), F(0, 1), F(2, 0), F(2, 1), B(2, 0))
    sim = jpipe.simulate(schedule)
    assert (sim.makespan, sim.busy) == (49.0, (48.0, 48.0))  # golden, as the files above


def _runtime_form(schedule: Schedule) -> str:
    """`schedule` in PyTorch's runtime form, every kind of cell it writes included.

    Near where PyTorch's lowering (``_add_unshard_reshard``,
    ``_add_send_recv``, ``_add_reduce_grad``) puts them, simplified: jpipe
    drops them all, so only which rank holds them matters. A stage's ``UNSHARD``
    before its first compute cell and ``RESHARD`` after its last, a receive
    before each cell that needs one from another rank and a send after each
    cell whose output goes to another rank, ``REDUCE_GRAD`` after a stage's
    last backward; inside an ``OVERLAP_F_B`` the transfers of its parts.
    """
    owner, M = schedule.stage_to_rank, schedule.num_microbatches
    S = schedule.num_stages

    def comms(a):
        before, after = [], []
        if a.kind == "F" and a.stage > 0 and owner[a.stage - 1] != owner[a.stage]:
            before.append(f"{a.stage}RECV_F{a.microbatch}")
        if a.kind == "F" and a.stage + 1 < S and owner[a.stage + 1] != owner[a.stage]:
            after.append(f"{a.stage}SEND_F{a.microbatch}")
        if a.kind in "BI" and a.stage + 1 < S and owner[a.stage + 1] != owner[a.stage]:
            before.append(f"{a.stage}RECV_B{a.microbatch}")
        if a.kind in "BI" and a.stage > 0 and owner[a.stage - 1] != owner[a.stage]:
            after.append(f"{a.stage}SEND_B{a.microbatch}")
        return before, after

    lines = []
    for row in schedule.ranks:
        first = {}
        last = {}
        for i, step in enumerate(row):
            for a in step.parts:
                first.setdefault(a.stage, i)
                last[a.stage] = i
        done = dict.fromkeys(first, 0)
        cells = []
        for i, step in enumerate(row):
            cells += [f"{s}UNSHARD" for s, at in first.items() if at == i]
            if isinstance(step, Overlap):
                (b1, a1), (b2, a2) = comms(step.forward), comms(step.backward)
                cells.append(
                    f"({';'.join(b1 + b2 + [str(step.forward), str(step.backward)] + a1 + a2)})"
                    "OVERLAP_F_B"
                )
            else:
                before, after = comms(step)
                cells += before + [str(step)] + after
            for a in step.parts:
                done[a.stage] += a.kind in "BW"
                if done[a.stage] == M:
                    cells.append(f"{a.stage}REDUCE_GRAD")
            cells += [f"{s}RESHARD" for s, at in last.items() if at == i]
        lines.append(",".join(cells))
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "name, ranks, microbatches",
    [
        ("gpipe", 4, 6),
        ("1f1b", 4, 8),
        ("interleaved_1f1b", 2, 4),
        ("zb_h1", 4, 8),
        ("zbv", 2, 4),
        ("dualpipev", 4, 10),
    ],
)
def test_runtime_form_reads_as_its_compute_cells(name, ranks, microbatches):
    schedule = jpipe.get_schedule(name, ranks, microbatches)
    text = _runtime_form(schedule)
    for kind in DROPPED:
        assert kind in text
    again = Schedule.from_csv_text(text, name=name)
    assert again == schedule
    assert jpipe.simulate(again).makespan == jpipe.simulate(schedule).makespan


def test_pytorch_dualpipev_file_with_transfers_inside_its_overlaps(pytorch_schedules):
    schedule = Schedule.from_csv(pytorch_schedules / DUALPIPEV)
    text = _runtime_form(schedule)
    assert any("SEND" in c and "OVERLAP_F_B" in c for c in text.replace("\n", ",").split(","))
    assert Schedule.from_csv_text(text) == schedule


def _pytorch_1f1b(R: int, M: int) -> str:
    """The compute-only CSV that PyTorch's ``Schedule1F1B`` writes (``_dump_csv``).

    Its ``_get_pipeline_order`` as read in PyTorch's source, written anew: rank r
    waits r steps, runs R - 1 - r forwards, waits 2 (R - 1 - r) steps, then
    one forward and one backward until the forwards are done, then the
    backwards with a step between them, and ``REDUCE_GRAD`` after the last.
    A rank with no warm-up forward (the last, and every rank when M is small)
    counts its steady forwards from 1, so it runs F 1..M: a stray index M.
    """
    lines = []
    for r in range(R):
        cells = [""] * r
        warmup = R - 1 - r
        forward = 0
        for m in range(warmup):
            cells.append(f"{r}F{m}")
            forward = m
        cells += [""] * (2 * warmup)
        backward = 0
        for _ in range(M - warmup):
            forward += 1
            cells += [f"{r}F{forward}", f"{r}B{backward}"]
            backward += 1
        while backward < M:
            cells += ["", f"{r}B{backward}"]
            backward += 1
        cells.append(f"{r}REDUCE_GRAD")
        lines.append(",".join(cells))
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "R, M, stray",
    [
        (
            4,
            8,
            "rank 3, position 14 (F(3,8)): stray microbatch 8: only stage 3 has it, "
            "stages 0, 1, 2 do not; the number of microbatches, 9, is read from the highest index",
        ),
        (
            2,
            3,
            "rank 1, position 4 (F(1,3)): stray microbatch 3: only stage 1 has it, "
            "stage 0 does not",
        ),
        (
            4,
            2,
            "rank 0, position 2 (F(0,2)): stray microbatch 2: only stages 0, 3 have it, "
            "stages 1, 2 do not",
        ),
        (8, 16, "rank 7, position 30 (F(7,16)): stray microbatch 16: only stage 7 has it"),
    ],
)
def test_pytorch_1f1b_orders_are_refused_naming_the_stray_action(R, M, stray):
    schedule = Schedule.from_csv_text(_pytorch_1f1b(R, M))  # REDUCE_GRAD is read and dropped
    with pytest.raises(jpipe.ScheduleError) as info:
        jpipe.validate(schedule)
    assert str(info.value).startswith(stray)


def test_a_stage_missing_its_last_microbatch_is_still_named_by_what_is_missing():
    # Most stages have microbatch 2, one lacks it: that one is named, not the others.
    text = "0F0,0F1,0F2,0B0,0B1,0B2\n1F0,1F1,1F2,1B0,1B1,1B2\n2F0,2F1,2B0,2B1\n"
    with pytest.raises(jpipe.ScheduleError, match=r"^rank 2 \(which holds stage 2\): F\(2,2\)"):
        jpipe.validate(Schedule.from_csv_text(text))


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "0F0,1SEND_F0,0B0\n1F0,1B0\n",
            "CSV row 1 column 2: '1SEND_F0' names stage 1, which this rank does not compute "
            "(its stages: 0)",
        ),
        (
            "0UNSHARD,0RESHARD\n1F0,1B0\n",
            "CSV row 1 column 1: '0UNSHARD' names stage 0, which "
            "this rank does not compute (its stages: none)",
        ),
        (
            "0F0,0F1,(0F2;0B0;1SEND_B0)OVERLAP_F_B,0B1,0B2\n",
            "CSV row 1 column 3: '1SEND_B0' names stage 1, which this rank does not compute",
        ),
        ("0F0,0SEND_X0,0B0\n", "CSV row 1 column 2: cannot read schedule cell '0SEND_X0'"),
        ("0F0,0REDUCE,0B0\n", "CSV row 1 column 2: cannot read schedule cell '0REDUCE'"),
    ],
)
def test_dropped_cells_must_name_a_stage_of_their_rank(text, message):
    with pytest.raises(ValueError) as info:
        Schedule.from_csv_text(text)
    assert str(info.value).startswith(message), str(info.value)


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


def test_a_csv_for_pytorch_refuses_what_only_jpipe_reads():
    """jpipe's CSV is a superset of PyTorch's: stages on several ranks and memory actions
    are written and read back by jpipe, and refused by name for PyTorch's runtime."""
    chimera = jpipe.get_schedule("chimera", 4, 8)
    assert jpipe.Schedule.from_csv_text(chimera.to_csv()) == chimera
    with pytest.raises(ValueError) as info:
        chimera.to_csv(pytorch=True)
    assert str(info.value) == (
        "PyTorch's pipelining cannot run this schedule as written: stage 0 is on ranks 0 "
        "and 3; PyTorch places a stage on one rank (and 3 more)"
    )
    recompute = jpipe.get_schedule("1f1b_recompute", 4, 8)
    assert recompute.pytorch_gaps()[0].startswith(
        "rank 0, position 1 (FC(0,1)) is a memory action, jpipe's own cell 0FC1"
    )
    with pytest.raises(ValueError, match="is a memory action"):
        recompute.to_csv(pytorch=True)
    # what PyTorch runs, overlapped cells included, is written as before
    dualpipev = jpipe.get_schedule("dualpipev", 2, 8)
    assert dualpipev.pytorch_gaps() == []
    assert dualpipev.to_csv(pytorch=True) == dualpipev.to_csv()
