"""`python -m jpipe.check --lowering {spmd,mpmd}`: a schedule checked under the lowering it runs."""

import io
import json
import os
import sys
import types

import jax
import pytest

import jpipe
from jpipe import check, testing


@pytest.mark.parametrize("spec", ["1f1b", "zbv"])
def test_check_runs_under_the_per_rank_lowering(spec, capsys):
    assert check.main([spec, "-r", "2", "-m", "4", "--lowering", "mpmd", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["max_rel_err"] <= result["rtol"]
    # check_schedule reports the lowering of the jpipe.Pipeline it built (Pipeline.lowering,
    # the name of the lowering kind whose runtime ran the step), not the flag it was given.
    assert result["lowering"] == "mpmd"
    assert (result["schedule"], result["ranks"], result["microbatches"]) == (spec, 2, 4)


def test_the_report_names_the_lowering_and_spmd_is_the_default(capsys):
    assert check.main(["1f1b", "-r", "2", "-m", "4"]) == 0
    out = capsys.readouterr().out
    first, *_, last = out.splitlines()
    assert first.endswith(", spmd lowering"), out
    assert "largest piece" not in out  # one program: its own figures
    assert last == "PASS"


def test_an_unknown_lowering_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        check.main(["1f1b", "-r", "2", "-m", "4", "--lowering", "per-rank"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--lowering" in err and "invalid choice" in err and "'mpmd'" in err


def test_a_process_without_a_rank_is_refused_by_name(monkeypatch):
    # Under jpipe.launch, -r 2 on 2 processes x 2 devices leaves process 1 without a rank;
    # the per-rank lowering's transfers fail there, so check_schedule refuses it first.
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    devices = [types.SimpleNamespace(process_index=0) for _ in range(2)]
    with pytest.raises(ValueError, match=r"every process must hold a pipeline rank.*none in \[1\]"):
        testing._check_every_process_holds_a_rank(devices, 2)
    testing._check_every_process_holds_a_rank([*devices, types.SimpleNamespace(process_index=1)], 3)
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    testing._check_every_process_holds_a_rank(devices, 2)


def _launch(argv, cpu_devices):
    """`python -m jpipe.launch -n 2 --cpu_devices K -- -m jpipe.check ARGV`: (status, out, err)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    # conftest's 8 devices are this process's; each child fakes its own
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if "device_count" not in f]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env.pop("JAX_NUM_CPU_DEVICES", None)
    out, err = io.StringIO(), io.StringIO()
    command = [sys.executable, "-m", "jpipe.check", *argv]
    status = jpipe.launch_local(
        command, 2, cpu_devices=cpu_devices, env=env, stdout=out, stderr=err, timeout_seconds=400
    )
    return status, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_the_per_rank_check_across_two_processes():
    # One rank per process (1 device each): each process places its own rank's batch.
    status, out, err = _launch(["1f1b", "-r", "2", "-m", "4", "--lowering", "mpmd", "--json"], 1)
    assert status == 0, err[-3000:]
    results = [json.loads(line.split("] ", 1)[1]) for line in out.splitlines() if "{" in line]
    assert len(results) == 2
    assert all(r["passed"] and r["lowering"] == "mpmd" for r in results)
    # Both ranks in process 0 (2 devices each): process 1 holds none, and the check says so.
    status, out, err = _launch(["1f1b", "-r", "2", "-m", "4", "--lowering", "mpmd"], 2)
    assert status == 2, (out, err[-3000:])
    assert "every process must hold a pipeline rank" in out + err
