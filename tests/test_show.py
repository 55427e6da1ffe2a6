"""`python -m jpipe.show` and the charts behind it."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import jpipe
from jpipe import B, F, I, Schedule, W
from jpipe.show import chrome_trace, draw_gantt, main, text_chart

PYTORCH_SCHEDULES = Path(__file__).parent / "data" / "pytorch-schedules"


def _gpipe(num_ranks, num_microbatches):
    """GPipe built here, so the pinned charts do not move with schedules/."""
    M = num_microbatches
    rows = [[F(r, m) for m in range(M)] + [B(r, m) for m in range(M)] for r in range(num_ranks)]
    return Schedule.of(rows, name="gpipe")


# A user's own schedule file: GPipe over V stages per rank placed in a loop
# (rank r holds stages r, r + R, ...), dealt in one global dependency order.
USER_FILE = """
from jpipe import B, F

def looped_gpipe(num_ranks, num_microbatches, num_chunks=1):
    S = num_ranks * num_chunks
    rows = [[] for _ in range(num_ranks)]
    for m in range(num_microbatches):
        for s in range(S):
            rows[s % num_ranks].append(F(s, m))
    for m in range(num_microbatches):
        for s in reversed(range(S)):
            rows[s % num_ranks].append(B(s, m))
    return rows

def stuck(num_ranks, num_microbatches):
    return [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]]
"""


@pytest.fixture
def user_file(tmp_path) -> Path:
    path = tmp_path / "my_schedules.py"
    path.write_text(USER_FILE)
    return path


@pytest.fixture
def csv_file(tmp_path) -> Path:
    path = tmp_path / "split.csv"
    path.write_text("0F0,0F1,0I0,,0W0,0I1,0W1\n,1F0,1I0,1F1,1I1,1W0,1W1\n")
    return path


# -- the command line ---------------------------------------------------------------


def test_registered_name_prints_the_chart_and_figures(capsys):
    assert main(["gpipe", "--ranks", "4", "--microbatches", "4"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("gpipe: 4 ranks, 4 stages, 4 microbatches; makespan 21, bubble 42.9%")
    for r in range(4):
        assert f"\nr{r} s{r}  " in out
    assert "makespan         21\n" in out
    assert "bubble fraction  0.4286\n" in out
    #      rank  stages  busy  idle  peak live
    assert "\n   0  0               12         9          4\n" in out


def test_csv_file_takes_its_sizes_from_the_file(capsys, csv_file):
    assert main([str(csv_file)]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("split.csv: 2 ranks, 2 stages, 2 microbatches; makespan 7,")
    assert "I0" in out and "W1" in out


def test_csv_file_with_other_sizes_asked_for_is_an_error(capsys, csv_file):
    assert main([str(csv_file), "--ranks", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"error: {csv_file} has 2 ranks, but 3 were asked for\n"


def test_file_function_with_chunks(capsys, user_file):
    spec = f"{user_file}:looped_gpipe"
    assert main([spec, "--ranks", "2", "--microbatches", "3", "--chunks", "2"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith(f"{spec}: 2 ranks, 4 stages, 3 microbatches;")
    assert "\nr0 s0,2  " in out and "\nr1 s1,3  " in out
    assert "F2s3" in out  # a rank with several stages labels the stage


def test_json_prints_one_object_and_nothing_else(capsys):
    assert main(["gpipe", "-r", "3", "-m", "5", "--json", "--cost", "F=1,B=3,comm=0.5"]) == 0
    out, _ = capsys.readouterr()
    summary = json.loads(out)  # fails if anything else is on stdout
    assert summary["makespan"] == pytest.approx(
        jpipe.simulate(jpipe.get_schedule("gpipe", 3, 5), jpipe.Costs(F=1, B=3, comm=0.5)).makespan
    )
    assert 0 < summary["bubble_fraction"] < 1
    assert summary["peak_activations"] == [5, 5, 5]
    assert summary["busy"] == [20.0, 20.0, 20.0]
    assert summary["costs"]["comm"] == 0.5


def test_files_are_written(capsys, tmp_path):
    svg, png = tmp_path / "g.svg", tmp_path / "g.png"
    trace, csv = tmp_path / "g.json", tmp_path / "g.csv"
    argv = ["gpipe", "-r", "4", "-m", "6", "--cost", "F=1,B=2.5", "--json"]
    argv += ["--svg", str(svg), "--png", str(png), "--trace", str(trace), "--csv", str(csv)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert all(f"wrote {p}" in err for p in (svg, png, trace, csv))

    assert "<svg" in svg.read_text()
    from PIL import Image

    with Image.open(png) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 800

    events = json.loads(trace.read_text())["traceEvents"]
    actions = [e for e in events if e["ph"] == "X"]
    assert len(actions) == 4 * 6 * 2
    assert sum(e["dur"] for e in actions) == pytest.approx(sum(summary["busy"]) * 1000)
    assert {e["pid"] for e in actions} == {0, 1, 2, 3}

    assert Schedule.from_csv(csv) == jpipe.get_schedule("gpipe", 4, 6)


def test_pytorch_file_with_overlaps(capsys, tmp_path):
    path = PYTORCH_SCHEDULES / "dualpipev_4rank_10mb.csv"
    assert main([str(path), "--png", str(tmp_path / "d.png")]) == 0
    out, _ = capsys.readouterr()
    assert "not to scale" in out and "\nr0 s0,7  " in out


def test_invalid_schedule_exits_with_the_validators_message(capsys, user_file):
    assert main([f"{user_file}:stuck", "-r", "2", "-m", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: deadlock: no rank can make progress.\n")
    assert "rank 0, position 1 (B(0,0)) waits for B(1,0) on rank 1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nope", "-r", "2", "-m", "2"], "error: unknown schedule 'nope'"),
        (["gpipe", "-r", "2", "-m", "2", "--cost", "X=1"], "error: cannot read cost 'X=1'"),
        (
            ["gpipe", "-r", "2", "-m", "2", "--chunks", "2"],
            "error: schedule 'gpipe' takes no chunks",
        ),
        (["gpipe"], "error: schedule 'gpipe' is a function: give the number of ranks"),
        (["missing.csv"], "error: schedule file 'missing.csv' does not exist"),
        (
            ["gpipe", "-r", "2", "-m", "2", "--svg", "g.pdf"],
            "error: --svg needs a file name ending",
        ),
    ],
)
def test_bad_arguments_exit_2_with_one_error_line(capsys, argv, message):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(message) and err.count("\n") == 1


def test_a_bad_csv_cell_is_reported_with_its_place(capsys, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1Q0\n")
    assert main([str(path)]) == 2
    assert capsys.readouterr().err.startswith("error: bad.csv row 2 column 2: cannot read")


def test_argparse_errors_return_2(capsys):
    assert main(["gpipe", "--ranks", "0"]) == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "jpipe.show", "gpipe", "--ranks", "2", "--microbatches", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("gpipe: 2 ranks, 2 stages, 3 microbatches;")
    assert "\nr1 s1  " in result.stdout


def test_a_reader_that_stops_early_gets_no_traceback():
    # `jpipe.show ... | head`: the reader has gone before the first write, so
    # the write fails as it does for `head` after its lines. The command ends
    # quietly with the shell's SIGPIPE status, as `yes | head` would.
    proc = subprocess.Popen(
        [sys.executable, "-m", "jpipe.show", "1f1b", "-r", "4", "-m", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


def test_a_folder_named_jpipe_in_the_working_directory_is_named(tmp_path):
    # A clone named `jpipe`, run from its parent: Python may take the folder
    # for the package (an editable install's hook comes after the current
    # directory), and then only a refusal that names the folder helps. An
    # install that the folder does not hide runs as usual.
    (tmp_path / "jpipe").mkdir()
    (tmp_path / "jpipe" / "README.md").write_text("a clone\n")
    result = subprocess.run(
        [sys.executable, "-m", "jpipe.show", "gpipe", "-r", "2", "-m", "2"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    if result.returncode == 0:  # this install is not hidden by the folder
        assert result.stdout.startswith("gpipe: 2 ranks")
    else:
        assert result.returncode == 2, result.stderr
        folder = tmp_path / "jpipe"
        assert result.stderr == (
            f"error: 'jpipe' was imported from the folder {folder}, which is not the jpipe "
            "package (it has no __init__.py): a folder named jpipe in the directory you run "
            "from (a clone of the repository?) hides the installed package. Run from inside "
            "the clone or from another directory, or rename the folder\n"
        )


def test_peak_live_says_what_it_counts(capsys):
    # One stage a rank: microbatches of the rank's layers.
    sim = jpipe.simulate(jpipe.get_schedule("1f1b", 4, 8))
    assert sim.peak_activations_text() == "peak live activations per rank [4, 3, 2, 1] microbatches"
    # Four stages a rank: (stage, microbatch) pairs, a quarter of the rank's
    # layers each, so 18 pairs are 4.5 microbatches of its layers.
    sim = jpipe.simulate(jpipe.get_schedule("interleaved_1f1b", 4, 16, 4))
    peaks = list(sim.peak_activations)
    whole = ", ".join(f"{p / 4:g}" for p in peaks)
    assert sim.peak_activations_text() == (
        f"peak live activations per rank {peaks} (stage, microbatch) pairs; with 4 stages a "
        f"rank, [{whole}] microbatches of a rank's layers (if its stages are of one size)"
    )
    assert max(peaks) > 8  # the old wording called these microbatches
    # `show` prints it under its table where ranks hold several stages, not otherwise.
    assert main(["zbv", "-r", "2", "-m", "4"]) == 0
    out = capsys.readouterr().out
    assert "\npeak live activations per rank [" in out and "with 2 stages a rank" in out
    assert main(["1f1b", "-r", "2", "-m", "4"]) == 0
    assert "peak live activations per rank" not in capsys.readouterr().out


# -- the charts -----------------------------------------------------------------------


def test_text_chart_to_scale():
    # Pins the chart's look; if you change the format on purpose, paste the new one.
    sim = jpipe.simulate(_gpipe(2, 3))
    assert text_chart(sim) == textwrap.dedent(
        """\
        gpipe: 2 ranks, 2 stages, 3 microbatches; makespan 12, bubble 25.0%
        time to scale, 3 columns per unit
        time   0              5              10
        r0 s0  F0 F1 F2 .........B0--- B1--- B2---
        r1 s1  ...F0 F1 F2 B0--- B1--- B2--- ......
        F forward, B backward, I input grad, W weight grad; '-' running, '.' idle"""
    )


def test_text_chart_in_order_shows_running_and_idle():
    # Too narrow to draw to scale: one column per start time, wrapped in blocks.
    sim = jpipe.simulate(_gpipe(2, 3), jpipe.Costs(F=1, B=2, comm=0.5))
    assert text_chart(sim, width=30) == textwrap.dedent(
        """\
        gpipe: 2 ranks, 2 stages, 3 microbatches; makespan 13, bubble 30.8%
        actions by start time, not to scale (to scale it would exceed 30 columns)
        start  0  1     2
        r0 s0  F0 F1 -  F2 -  .  .
        r1 s1  .  .  F0 -  F1 F2 B0

        start     7     9  11
        r0 s0  .  B0 -  B1 B2
        r1 s1  B1 -  B2 -  .
        F forward, B backward, I input grad, W weight grad; '-' running, '.' idle"""
    )


def test_text_chart_falls_back_to_order_when_too_wide():
    sim = jpipe.simulate(_gpipe(4, 16))
    chart = text_chart(sim, width=120)
    lines = chart.splitlines()
    assert "not to scale" in lines[1]
    assert max(len(line) for line in lines[1:]) <= 120
    for r in range(4):
        cells = " ".join(line for line in lines if line.startswith(f"r{r} ")).split()
        labels = [c for c in cells if c[0] in "FB" and c[1:].isdigit()]
        assert labels == [f"F{m}" for m in range(16)] + [f"B{m}" for m in range(16)]
    # Rank 3 waits three steps for its first forward.
    assert next(line for line in lines if line.startswith("r3 ")).split()[2:6] == [
        ".",
        ".",
        ".",
        "F0",
    ]


def test_text_chart_gives_actions_that_take_no_time_their_own_column():
    schedule = Schedule.of([[F(0, 0), I(0, 0), W(0, 0)], [F(1, 0), I(1, 0), W(1, 0)]])
    sim = jpipe.simulate(schedule, jpipe.Costs(F=1, I=3, W=0))
    lines = text_chart(sim).splitlines()
    assert "not to scale" in lines[1]  # W has no width on a time axis
    assert lines[2].split() == ["start", "0", "1", "2", "5", "8"]
    assert lines[3].split() == ["r0", "s0", "F0", ".", ".", "I0", "W0"]
    assert lines[4].split() == ["r1", "s1", ".", "F0", "I0", "W0", "."]


def test_chrome_trace_events():
    schedule = Schedule.of([[F(0, 0), F(2, 0), B(2, 0), B(0, 0)], [F(1, 0), B(1, 0)]], name="v")
    sim = jpipe.simulate(schedule, jpipe.Costs(F=1, B=2, comm=0.5))
    trace = chrome_trace(sim, us_per_unit=10)
    actions = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    first = actions[0]
    assert first == {
        "name": "F s0 m0",
        "cat": "forward",
        "ph": "X",
        "pid": 0,
        "tid": 0,
        "ts": 0.0,
        "dur": 10.0,
        "args": {"kind": "F", "stage": 0, "microbatch": 0, "overlapped": False},
    }
    by_name = {e["name"]: e for e in actions}
    assert by_name["F s1 m0"]["ts"] == 15.0  # 1 unit of F(0,0), then 0.5 of latency
    assert by_name["F s1 m0"]["pid"] == 1
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0 (stages 0, 2)", "rank 1 (stages 1)"}
    assert trace["otherData"]["makespan"] == sim.makespan


def test_draw_gantt_rejects_other_formats(tmp_path):
    sim = jpipe.simulate(Schedule.of([[F(0, 0), B(0, 0)]]))
    with pytest.raises(ValueError, match=r"use \.svg or \.png"):
        draw_gantt(sim, tmp_path / "chart.pdf")


def test_the_api_names_work_as_flags(capsys):
    # num_ranks / num_microbatches, as in jpipe.get_schedule, are accepted too.
    assert main(["1f1b", "--num_ranks", "2", "--num_microbatches", "3", "--json"]) == 0
    out, _ = capsys.readouterr()
    assert json.loads(out)["ranks"] == 2


def test_the_charts_show_a_replicated_stages_gradient_sum(tmp_path):
    """Chimera: each stage's gradients summed over its two copies, on the transfers
    thread of both ranks in the trace, and as a bar of its own in the Gantt chart."""
    sim = jpipe.simulate(jpipe.get_schedule("chimera", 4, 8), jpipe.Costs(sync=2))
    sums = [e for e in chrome_trace(sim)["traceEvents"] if e.get("cat") == "gradient sum"]
    assert sorted((e["pid"], e["args"]["stage"]) for e in sums) == [
        (0, 0), (0, 3), (1, 1), (1, 2), (2, 1), (2, 2), (3, 0), (3, 3)
    ]  # fmt: skip
    for e in sums:
        x = sim.syncs[[y.stage for y in sim.syncs].index(e["args"]["stage"])]
        assert e["dur"] == 2 * 1000 and e["ts"] == x.start * 1000 and e["tid"] == 4 + e["pid"]
    draw_gantt(sim, tmp_path / "chimera.svg")
    assert "gradient sum" in (tmp_path / "chimera.svg").read_text()
