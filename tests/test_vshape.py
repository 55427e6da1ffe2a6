"""V-Half and V-Min against 1F1B on the same model, like for like.

The same model is cut into R stages for 1F1B (stage r on rank r) and into 2R
half-size stages for the V schedules (stages r and 2R - 1 - r on rank r):

- memory: `jpipe.Sizes` gives a half stage's residuals 1 byte and a full
  stage's 2, and each rank's peak bytes are compared, so the unit is one full
  (1F1B) stage's residuals for one microbatch;
- time: a half stage costs half a full one: 1F1B at F = 1, B = 2, the V
  schedules at F = I = W = 1/2. The bubble time is the makespan less a rank's
  own work, 3M for every rank of either.

The paper's figures (Qi et al., 2024, "Pipeline Parallelism with
Controllable Memory", table of V-Min, V-Half, V-ZB): a peak of
floor((R + 2) / 2) (V-Half) and floor((R + 4) / 3) (V-Min) microbatches
against 1F1B's R, for a bubble of about a half and two thirds of 1F1B's.
"""

from pathlib import Path

import pytest

from jpipe import Costs, Sizes, get_schedule, simulate

SCHEDULES_PAGE = Path(__file__).resolve().parent.parent / "docs" / "schedules.md"

PAPER_PEAK = {"vhalf": lambda R: (R + 2) // 2, "vmin": lambda R: (R + 4) // 3}
PAPER_BUBBLE = {"vhalf": 1 / 2, "vmin": 2 / 3}  # of 1F1B's bubble time
HALF_STAGE = Costs(F=0.5, I=0.5, W=0.5)
FULL_STAGE = Costs(F=1, B=2)


def run(name, R, M):
    """The simulation of `name` on the model cut for it (two stages per rank unless 1F1B)."""
    if name == "1f1b":
        return simulate(get_schedule(name, R, M), FULL_STAGE, Sizes(activation=2))
    return simulate(get_schedule(name, R, M), HALF_STAGE, Sizes(activation=1))


def peak(sim):
    """The worst rank's peak, in full-stage microbatches."""
    return max(sim.peak_bytes) / 2


def bubble_time(sim, M):
    return sim.makespan - 3 * M


@pytest.mark.parametrize("name", ["vhalf", "vmin"])
def test_peak_is_the_papers_figure(name):
    for R in (*range(1, 13), 16):
        for M in (1, 2, R - 1, R, R + 1, 2 * R + 1, 4 * R):
            if M < 1:
                continue
            sim = run(name, R, M)
            assert peak(sim) <= PAPER_PEAK[name](R), (R, M, sim.peak_bytes)
            if M >= R:  # the steady state is reached, and its peak is the paper's
                assert peak(sim) == PAPER_PEAK[name](R), (R, M, sim.peak_bytes)
            # The simulator's count of live (stage, microbatch) pairs says the same.
            assert max(sim.peak_activations) == 2 * peak(sim)


@pytest.mark.parametrize("R", [4, 8])
def test_against_1f1b_and_zbv_like_for_like(R):
    for M in (R, R + 1, 2 * R, 4 * R):
        ofob, zbv = run("1f1b", R, M), run("zbv", R, M)
        assert peak(ofob) == R
        assert peak(zbv) <= R + 1 / 2  # ZB-V: about 1F1B's memory
        for name in ("vhalf", "vmin"):
            sim = run(name, R, M)
            assert peak(sim) / peak(ofob) == PAPER_PEAK[name](R) / R
            assert bubble_time(sim, M) <= PAPER_BUBBLE[name] * bubble_time(ofob, M)
            assert sim.bubble_fraction < ofob.bubble_fraction
            if M >= 2 * R - 1:  # ZB-V's zero-bubble range; below it V-Half can beat it
                assert zbv.bubble_fraction < sim.bubble_fraction
        # More memory, less bubble.
        assert run("vhalf", R, M).bubble_fraction < run("vmin", R, M).bubble_fraction


@pytest.mark.parametrize("R", [2, 4, 8, 16])
def test_bubble_time_against_1f1b(R):
    for M in (1, 2, R // 2, R - 1, R, R + 1, 2 * R, 4 * R):
        if M < 1:
            continue
        ofob = bubble_time(run("1f1b", R, M), M)
        assert bubble_time(run("vmin", R, M), M) <= PAPER_BUBBLE["vmin"] * ofob, (R, M)
        if M >= R // 2:  # with fewer microbatches there is nothing to fill the warm-up with
            assert bubble_time(run("vhalf", R, M), M) <= PAPER_BUBBLE["vhalf"] * ofob, (R, M)


def test_the_docs_table_is_the_simulators():
    text = SCHEDULES_PAGE.read_text()
    header = "| R | M | peak: 1F1B | ZB-V | V-Half | V-Min | bubble: 1F1B | ZB-V | V-Half | V-Min |"
    assert header in text, "docs/schedules.md lost the V-Half / V-Min table"
    rows = []
    for line in text.split(header, 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    assert rows, "docs/schedules.md's V-Half / V-Min table has no rows"
    for cells in rows:
        R, M = int(cells[0]), int(cells[1])
        sims = [run(name, R, M) for name in ("1f1b", "zbv", "vhalf", "vmin")]
        expected = [f"{peak(s):g}" for s in sims]
        expected += [f"{100 * s.bubble_fraction:.1f}%" for s in sims]
        assert cells[2:] == expected, (
            f"docs/schedules.md's row for R = {R}, M = {M} reads {cells[2:]}; the simulator "
            f"gives {expected}: update the table (python -m pytest tests/test_vshape.py)"
        )
