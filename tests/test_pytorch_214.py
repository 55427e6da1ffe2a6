"""The CSVs that PyTorch 2.14.1's schedule classes write, read as PyTorch wrote them.

The files are in tests/data/pytorch-schedules-2.14/ (see its README; its
generate.py, run by hand with PyTorch installed, wrote them and its
manifest.json). Each is checked against what is known without jpipe's reader:
the manifest's shape, and a makespan computed here from the file's own text by
a small earliest-start simulation of its compute cells.
"""

import json
import re
from pathlib import Path

import pytest

import jpipe
from jpipe import Costs, Schedule

HERE = Path(__file__).parent / "data" / "pytorch-schedules-2.14"
MANIFEST = json.loads((HERE / "manifest.json").read_text())
FILES = MANIFEST["files"]
VALID = sorted(f for f, v in FILES.items() if not v.get("pytorch_invalid"))
INVALID = sorted(f for f, v in FILES.items() if v.get("pytorch_invalid"))
COMMS = sorted(f for f, v in FILES.items() if v["form"] == "compute_comms")
NOT_COMPUTE = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")

_COMPUTE = re.compile(r"^(\d+)([FBIW])(\d+)$")
_OVERLAP = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_OTHER = re.compile(rf"^(\d+)({'|'.join(NOT_COMPUTE)})(\d*)$")


def _compute_rows(text: str) -> list[list[tuple[str, int, int]]]:
    """Each rank's compute cells as ``(kind, stage, microbatch)``, overlaps split in order.

    Read from the raw text (no jpipe): PyTorch's cells are unquoted and hold no
    commas, so a row is its line split at commas.
    """
    rows = []
    for line in text.splitlines():
        row = []
        for cell in line.split(","):
            m = _OVERLAP.match(cell)
            for part in m.group(1).split(";") if m else [cell]:
                if not part or _OTHER.match(part):
                    continue
                c = _COMPUTE.match(part)
                assert c, f"not a PyTorch cell: {part!r}"
                row.append((c.group(2), int(c.group(1)), int(c.group(3))))
        rows.append(row)
    return rows


def _makespan(text: str, cost: dict[str, float], comm: float) -> float:
    """Earliest-start simulation of the compute cells in `text`, written apart from jpipe's.

    Each rank runs its cells in order; ``F(s, m)`` waits for ``F(s-1, m)``, a ``B``
    or ``I`` of ``(s, m)`` for ``F(s, m)`` and the ``B``/``I`` of ``(s+1, m)``, ``W``
    for the ``I``; `comm` is added when the awaited cell ran on another rank.
    """
    rows = _compute_rows(text)
    owner = {s: r for r, row in enumerate(rows) for _, s, _ in row}
    last = max(owner)
    end: dict[tuple[str, int, int], float] = {}
    nxt, free = [0] * len(rows), [0.0] * len(rows)
    first_start = None
    while any(nxt[r] < len(row) for r, row in enumerate(rows)):
        progress = False
        for r, row in enumerate(rows):
            while nxt[r] < len(row):
                kind, s, m = row[nxt[r]]
                if kind == "F":
                    needs = [("F", s - 1, m)] if s > 0 else []
                elif kind == "W":
                    needs = [("I", s, m)]
                else:
                    needs = [("F", s, m)] + ([("G", s + 1, m)] if s < last else [])
                if not all(n in end for n in needs):
                    break
                start = max([free[r]] + [end[n] + comm * (owner[n[1]] != r) for n in needs])
                first_start = start if first_start is None else min(first_start, start)
                free[r] = end[(kind, s, m)] = start + cost[kind]
                if kind in "BI":
                    end[("G", s, m)] = end[(kind, s, m)]  # what the stage before waits for
                nxt[r] += 1
                progress = True
        assert progress, "the compute cells deadlock"
    return max(free) - first_start


def test_every_file_is_in_the_manifest_and_the_manifest_only_names_files():
    assert {p.name for p in HERE.glob("*.csv")} == set(FILES)
    assert MANIFEST["torch"].startswith("2.14.1")  # "2.14.1+cu130"
    assert len(VALID) > 80 and len(INVALID) > 10 and len(COMMS) > 40


COSTS = [
    (Costs(), {"F": 1, "I": 1, "W": 1, "B": 2}, 0.0),
    (Costs(F=2, I=3, W=1, B=4, comm=0.5), {"F": 2, "I": 3, "W": 1, "B": 4}, 0.5),
]


@pytest.mark.parametrize("filename", VALID)
def test_pytorch_214_file_reads_with_the_makespan_of_its_compute_cells(filename):
    meta = FILES[filename]
    text = (HERE / filename).read_text()
    schedule = Schedule.from_csv(HERE / filename)
    assert jpipe.validate(schedule) is schedule
    assert (schedule.num_ranks, schedule.num_stages, schedule.num_microbatches) == (
        meta["ranks"],
        meta["stages"],
        meta["microbatches"],
    )
    if "stage_to_rank" in meta:
        assert list(schedule.stage_to_rank) == meta["stage_to_rank"]
    assert [list(schedule.actions(r)) for r in range(schedule.num_ranks)] == [
        [jpipe.Action(k, s, m) for k, s, m in row] for row in _compute_rows(text)
    ]
    for costs, cost, comm in COSTS:
        assert jpipe.simulate(schedule, costs).makespan == _makespan(text, cost, comm)


@pytest.mark.parametrize("filename", COMMS)
def test_pytorch_214_comms_file_is_its_compute_file_less_the_other_cells(filename):
    text = (HERE / filename).read_text()
    cells = set(text.replace("\n", ",").split(","))
    for kind in NOT_COMPUTE:  # PyTorch wrote every kind of cell jpipe drops
        assert any(kind in c for c in cells), kind
    compute = re.sub(r"_comms(_defer)?\.csv$", "_compute.csv", filename)
    assert not any(kind in (HERE / compute).read_text() for kind in NOT_COMPUTE)
    if filename.endswith("_defer.csv"):  # the RECVs are elsewhere than in the plain form
        assert text != (HERE / filename.replace("_comms_defer", "_comms")).read_text()
    assert Schedule.from_csv(HERE / filename).ranks == Schedule.from_csv(HERE / compute).ranks


def _stray_1f1b(ranks: int, microbatches: int) -> tuple[int, int]:
    """The rank and microbatch where PyTorch 2.14's ``Schedule1F1B`` order strays, by its source.

    Rank r runs ``w = R - 1 - r`` warm-up forwards ``0..w-1``, then ``M - w``
    steady forwards (if any) counted on from its last warm-up index, a rank with
    no warm-up counting from 1: the last rank runs ``1..M``. The highest index is
    a microbatch that not every stage runs; the first rank reaching it is named.
    """
    R, M = ranks, microbatches
    highest = [(w - 1 + max(0, M - w)) if w > 0 else M for w in (R - 1 - r for r in range(R))]
    top = max(highest)
    return highest.index(top), top


@pytest.mark.parametrize("filename", INVALID)
def test_pytorch_214_invalid_1f1b_orders_are_refused_naming_the_stray_action(filename):
    meta = FILES[filename]
    assert meta["cls"] == "Schedule1F1B"  # the only class whose orders PyTorch refuses
    assert meta["pytorch_invalid"].startswith(f"Rank {meta['ranks'] - 1}, step 1: Running Full")
    schedule = Schedule.from_csv(HERE / filename)  # read: REDUCE_GRAD dropped
    rank, top = _stray_1f1b(meta["ranks"], meta["microbatches"])
    rows = _compute_rows((HERE / filename).read_text())
    position = rows[rank].index(("F", rank, top))  # its place in PyTorch's own row
    assert ("F", 0, top) not in rows[0] or ("F", 1, top) not in rows[1]  # truly stray
    with pytest.raises(jpipe.ScheduleError) as info:
        jpipe.validate(schedule)
    assert str(info.value).startswith(
        f"rank {rank}, position {position} (F({rank},{top})): stray microbatch {top}: "
    ), str(info.value)
    if meta["microbatches"] < meta["ranks"]:
        assert (
            "must be greater than or equal to the number of stages"
            in (meta["pytorch_constructor_refused"])
        )
