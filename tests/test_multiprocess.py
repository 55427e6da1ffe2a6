"""Several real processes on this machine, joined over loopback (gloo), as on several hosts.

Each test starts its processes with `jpipe.launch` (or its environment) and
2 fake CPU devices per process; starting a process with JAX costs seconds,
so each launch checks as much as it can (tests/multiprocess_worker.py).
"""

import io
import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from jpipe._launch import child_env, free_port, launch
from jpipe._pipeline import _host_grid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "multiprocess_worker.py")
ENV = dict(os.environ, PYTHONPATH=ROOT)  # the children import this checkout's jpipe
ENV.pop("XLA_FLAGS", None)  # conftest's 8 devices are for this process only
ENV.pop("JAX_NUM_CPU_DEVICES", None)


def _run(command, n=2, cpu_devices=2):
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    status = launch(command, n, cpu_devices=cpu_devices, env=ENV, stdout=out, stderr=err)
    return status, out.getvalue(), err.getvalue(), time.monotonic() - start


def test_launcher_prefixes_lines_and_stops_the_others_on_the_first_failure():
    code = (
        "import os, sys, time\n"
        "i = int(os.environ['JAX_PROCESS_ID'])\n"
        "print('hello from', i, os.environ['JAX_NUM_PROCESSES'], flush=True)\n"
        "if i == 1:\n"
        "    time.sleep(0.3); sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    status, out, err, seconds = _run([sys.executable, "-c", code], cpu_devices=None)
    assert status == 3
    assert seconds < 15, "the sleeping process should have been stopped"
    assert "[0] hello from 0 2" in out and "[1] hello from 1 2" in out
    assert "process 1 exited with status 3; stopping process(es) [0]" in err


def test_host_grid_keeps_a_hosts_devices_together():
    # Two hosts of four devices, listed out of order: stand-ins carry what the grid reads.
    devs = [
        types.SimpleNamespace(process_index=p, id=100 * p + k) for p in (1, 0) for k in range(4)
    ]
    ids = lambda grid: [[d.id for d in row] for row in grid]  # noqa: E731
    # pipe across the hosts, data within: each pipe rank's data group is on one host.
    grid = _host_grid(devs, {"pipe": 2, "data": 4}, {"pipe": 2})
    assert ids(grid) == [[0, 1, 2, 3], [100, 101, 102, 103]]
    # pipe 4 = 2 hosts x 2: neighbours 0-1 and 2-3 share a host, one hop crosses.
    grid = _host_grid(devs, {"pipe": 4, "data": 2}, {"pipe": 2})
    assert ids(grid) == [[0, 1], [2, 3], [100, 101], [102, 103]]
    # data across the hosts: every pipe rank has one device on each host.
    grid = _host_grid(devs, {"pipe": 4, "data": 2}, {"data": 2})
    assert ids(grid) == [[0, 100], [1, 101], [2, 102], [3, 103]]
    with pytest.raises(ValueError, match=r"2 hosts with 4 devices each"):
        _host_grid(devs, {"pipe": 4, "data": 2}, {"pipe": 4})
    with pytest.raises(ValueError, match=r"'data' axis of size 1 cannot span 2 hosts"):
        _host_grid(devs, {"pipe": 8, "data": 1}, {"data": 2})


def test_checker_pack_unpack_and_evaluation_across_two_processes():
    status, out, err, _ = _run([WORKER, "pipeline"])
    assert status == 0, err[-3000:]
    results = [
        json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT" in line
    ]
    assert sorted(r["process"] for r in results) == [0, 1]
    for r in results:
        assert r["check"] == 0  # python -m jpipe.check 1f1b --ranks 4 passed on both
        assert r["pipe_processes"] == [[0], [1]]  # pipe across the hosts, data within
        assert r["pipe4_processes"] == [0, 0, 1, 1]
        assert r["unpack_equal"]  # packed from this process's stages only, unpacked whole
        assert r["local_rows"] == ([0, 1] if r["process"] == 0 else [2, 3])
        assert r["eval_loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
    assert out.count("PASS") == 2


def test_an_exception_in_one_process_ends_the_run_naming_it():
    status, _, err, seconds = _run([WORKER, "raise"])
    assert status == 1
    assert "[1] [process 1 of 2] stopping after an uncaught exception" in err
    assert "ValueError: a deliberate failure in process 1" in err
    assert "process 1 exited with status 1" in err
    assert seconds < 40


def test_a_killed_process_is_named_by_the_survivor_within_a_minute():
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "collectives"],
            env=child_env(i, 2, address, cpu_devices=1, base=ENV),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        for p in procs:
            while "READY" not in (line := p.stdout.readline()):
                assert line, p.stderr.read()[-3000:]
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        status = procs[0].wait(timeout=60)
        seconds = time.monotonic() - killed
        err = procs[0].stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert status != 0
    assert seconds < 60
    assert "lost: process 1" in err, err[-3000:]
