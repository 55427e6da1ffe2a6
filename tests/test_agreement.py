"""Processes of one run that were given different runs are refused before compiling.

Two real processes joined over loopback, started as a multi-host job starts
them (docs/multihost.md): no launcher, one with the ``JAX_*`` variables and
one with train.py's own flags.
"""

import os
import subprocess
import sys
import time

import pytest
from test_multiprocess import ENV, ROOT, TINY, _child_env, _free_address

from jpipe.train import agreement


def _start(tmp_path, extra: list[list[str]]) -> list[tuple[int, str, float]]:
    """train.py in 2 processes, `TINY` plus `extra[i]`: each one's status, stderr, seconds."""
    address = _free_address()
    base = [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={tmp_path / 'run'}"]
    base += [f"--config.{k}={v}" for k, v in {**TINY, "mesh.pipe": 2, "mesh.data": 2}.items()]
    procs, logs = [], []
    start = time.monotonic()
    for i in range(2):
        env = _child_env(i, address, ENV)
        command = base + extra[i]
        if i == 1:  # train.py's flags instead of the environment, as a user may give them
            for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
                env.pop(name)
            command += [f"--coordinator_address={address}", "--num_processes=2", "--process_id=1"]
        logs.append(open(tmp_path / f"stderr{i}", "w+"))
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=logs[i]))
    results = []
    try:
        for p, log in zip(procs, logs):
            status = p.wait(timeout=180)
            log.seek(0)
            results.append((status, log.read(), time.monotonic() - start))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


@pytest.mark.slow
def test_processes_started_with_different_configs_are_refused_on_every_process(tmp_path):
    # Alone, a different seed trains silently to a wrong result, and a different
    # number of microbatches crashes in gloo; both are named before compiling.
    results = _start(tmp_path, [[], ["--config.seed=1", "--config.num_microbatches=4"]])
    for i, (status, err, seconds) in enumerate(results):
        lines = [line for line in err.splitlines() if "different runs" in line]
        assert status == 1, f"process {i} exited {status}:\n{err[-3000:]}"
        assert len(lines) == 1, f"process {i}:\n{err[-3000:]}"
        line = lines[0]
        assert line.startswith(f"[process {i} of 2] error: the processes of this run"), line
        for field in (
            "seed: 0 in process 0, 1 in process 1",
            "num_microbatches: 2 in process 0, 4 in process 1",
            "<schedule actions>",
        ):
            assert field in line, line
        assert "compiled the train step" not in err
        assert seconds < 120, f"process {i} took {seconds:.0f} s to refuse"
    assert not (tmp_path / "run").exists(), "a refused run must not make its work directory"


def test_differences_name_each_field_with_both_values():
    lead = {"seed": "0", "optimizer.learning_rate": "0.003", "<model parameters>": "ab"}
    mine = {"seed": "1", "optimizer.learning_rate": "0.003", "<model parameters>": "cd", "x": "2"}
    assert agreement.differences(lead, mine, 3) == [
        "<model parameters>: ab in process 0, cd in process 3",
        "seed: 0 in process 0, 1 in process 3",
        "x: (absent) in process 0, 2 in process 3",
    ]
    assert agreement.differences(lead, dict(lead), 1) == []
