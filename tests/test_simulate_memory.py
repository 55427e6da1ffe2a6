"""Bytes in the simulator: per-rank peak memory and per-boundary transfer latency."""

import json

import pytest

import jpipe
from jpipe import Sizes
from jpipe.show import main


def test_without_sizes_nothing_changes():
    sim = jpipe.simulate(jpipe.get_schedule("1f1b", 4, 8))
    assert sim.peak_bytes is None and sim.sizes is None
    assert "peak_bytes" not in sim.summary()


@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (4, 2)])
def test_gpipe_and_1f1b_peaks(p, m):
    act, params = 7.0, [100.0 * (s + 1) for s in range(p)]
    sizes = Sizes(activation=act, params=params)
    gpipe = jpipe.simulate(jpipe.get_schedule("gpipe", p, m), sizes=sizes)
    assert gpipe.peak_bytes == tuple(params[r] + m * act for r in range(p))
    ofob = jpipe.simulate(jpipe.get_schedule("1f1b", p, m), sizes=sizes)
    assert ofob.peak_bytes == tuple(params[r] + min(p - r, m) * act for r in range(p))
    assert "peak_bytes" in ofob.summary()


def test_split_backward_holds_the_carry_until_w():
    # one stage, one microbatch: F (act) -> I (adds the carry; W reads both) -> W (both freed)
    one = jpipe.Schedule.of([["0F0", "0I0", "0W0"]])
    assert jpipe.simulate(one, sizes=Sizes(activation=10, carry=25)).peak_bytes == (35.0,)
    assert jpipe.simulate(one, sizes=Sizes(activation=10, carry=4)).peak_bytes == (14.0,)
    # two forwards then both I before either W: both residuals and carries are live together
    two = jpipe.Schedule.of([["0F0", "0F1", "0I0", "0I1", "0W0", "0W1"]])
    assert jpipe.simulate(two, sizes=Sizes(activation=10, carry=8)).peak_bytes == (36.0,)
    assert jpipe.simulate(two, sizes=Sizes(activation=1, carry=8)).peak_bytes == (18.0,)


def test_zero_bubble_keeps_carries():
    sim = jpipe.simulate(
        jpipe.get_schedule("zb_h1", 3, 6), sizes=Sizes(activation=10, carry=4, params=100)
    )
    # rank 0 peaks at its first I: 3 residuals live (F0 F1 F2) and I0's carry
    # (W0 still needs residual 0); the last rank holds its deferred carries
    # (zb_h1 runs W late there).
    assert sim.peak_bytes[0] == 134.0
    assert all(b >= 110.0 for b in sim.peak_bytes)


def test_sizes_errors_name_the_value():
    with pytest.raises(ValueError, match="size carry must be a finite non-negative"):
        Sizes(carry=-1)
    with pytest.raises(ValueError, match="size params has 2 values but the schedule has 3"):
        jpipe.simulate(jpipe.get_schedule("1f1b", 3, 3), sizes=Sizes(params=[1, 2]))
    with pytest.raises(ValueError, match="KEY one of activation, carry, params"):
        Sizes.parse("act=3")


def test_per_boundary_comm():
    schedule = jpipe.get_schedule("gpipe", 3, 1)
    # one microbatch: F0 F1 F2 B2 B1 B0 with unit costs; boundary 0 costs 0, boundary 1 costs 2
    sim = jpipe.simulate(schedule, jpipe.Costs(F=1, B=1, comm=(0, 2)))
    assert sim.makespan == 6 + 2 * 2
    same = jpipe.simulate(schedule, jpipe.Costs(F=1, B=1, comm=(0.5, 0.5)))
    assert same.makespan == jpipe.simulate(schedule, jpipe.Costs(F=1, B=1, comm=0.5)).makespan
    with pytest.raises(ValueError, match="comm has 3 values but a schedule of 3 stages has 2"):
        jpipe.simulate(schedule, jpipe.Costs(comm=(1, 1, 1)))


def test_show_json_reports_peak_bytes(capsys):
    argv = ["1f1b", "-r", "3", "-m", "5", "--bytes", "activation=2e6,params=1e9", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["peak_bytes"] == [1e9 + 3 * 2e6, 1e9 + 2 * 2e6, 1e9 + 2e6]
    assert main(["1f1b", "-r", "2", "-m", "2", "--bytes", "act=1"]) == 2
    assert "KEY one of activation" in capsys.readouterr().err
