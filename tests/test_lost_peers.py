"""A process lost before or after joining is named by jpipe's own line on every survivor.

Real processes over loopback, started as a multi-host job starts them (the
``JAX_*`` variables, no launcher), each running `PEER`: join, start the
backend, say so, wait. One is then stopped (SIGSTOP), killed, or never joins.
"""

import socket
import subprocess
import sys
import time

import pytest
from test_multiprocess import ENV, _free_address

pytestmark = pytest.mark.slow  # each test starts JAX processes and waits on timeouts

HEARTBEAT_SECONDS = 10  # jpipe.runtime.distributed.HEARTBEAT_TIMEOUT_SECONDS, as train.py runs
JOIN_SECONDS = 5  # the test's own join timeout (train.py's is 30 s: JPIPE_JOIN_TIMEOUT)

PEER = (
    "import os, sys, time\n"
    "import jpipe\n"
    f"jpipe.initialize_distributed(initialization_timeout={JOIN_SECONDS})\n"
    "import jax\n"
    "jax.devices()\n"
    "print('joined', flush=True)\n"
    "time.sleep(float(os.environ.get('PEER_SLEEP', '120')))\n"
)


def _start(process_id: int, n: int, address: str, log, **env) -> subprocess.Popen:
    env = dict(
        ENV,
        JAX_COORDINATOR_ADDRESS=address,
        JAX_NUM_PROCESSES=str(n),
        JAX_PROCESS_ID=str(process_id),
        JAX_PLATFORMS="cpu",
        JAX_NUM_CPU_DEVICES="1",
        **env,
    )
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("device_count", "_unused_device_count")
    return subprocess.Popen(
        [sys.executable, "-c", PEER], env=env, stdout=log, stderr=subprocess.STDOUT, text=True
    )


def _read(log) -> str:
    log.seek(0)
    return log.read()


def _stop_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _wait_joined(procs, logs) -> None:
    deadline = time.monotonic() + 120
    while not all("joined" in _read(log) for log in logs):
        assert time.monotonic() < deadline, [_read(log)[-2000:] for log in logs]
        assert all(p.poll() is None for p in procs), [_read(log)[-2000:] for log in logs]
        time.sleep(0.1)


def _port_is_free(address: str, seconds: float) -> bool:
    """Whether nothing listens at `address` any longer (the coordination service has left)."""
    deadline = time.monotonic() + seconds
    while True:
        with socket.socket() as s:
            # Binds past TIME_WAIT connections, never past a listener.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", int(address.rsplit(":", 1)[1])))
                return True
            except OSError:
                if time.monotonic() > deadline:
                    return False
        time.sleep(0.2)


def test_a_stopped_process_is_named_by_every_survivor_within_the_heartbeat_timeout(tmp_path):
    n, address = 3, _free_address()
    logs = [open(tmp_path / f"log{i}", "w+") for i in range(n)]
    procs = [_start(i, n, address, logs[i]) for i in range(n)]
    try:
        _wait_joined(procs, logs)
        procs[2].send_signal(19)  # SIGSTOP: alive, silent
        stopped = time.monotonic()
        for i in (0, 1):
            status = procs[i].wait(timeout=HEARTBEAT_SECONDS + 30)
            seconds = time.monotonic() - stopped
            out = _read(logs[i])
            assert status == 1, f"process {i} exited {status}:\n{out[-3000:]}"
            line = f"[process {i} of 3] lost: process 2 (no heartbeat for {HEARTBEAT_SECONDS} s"
            assert line in out, out[-3000:]
            assert "Terminating process" not in out, out[-3000:]  # not JAX's abort
            assert seconds < HEARTBEAT_SECONDS + 15, f"process {i} took {seconds:.0f} s"
    finally:
        _stop_all(procs)


def test_a_process_killed_before_it_joined_is_named_within_the_join_timeout(tmp_path):
    # Process 1 is killed before it could join: process 0 waits for it.
    address = _free_address()
    logs = [open(tmp_path / f"log{i}", "w+") for i in range(2)]
    killed = _start(1, 2, address, logs[1])
    killed.kill()
    killed.wait()
    # And a process 1 whose process 0 never starts: nothing answers at the address.
    alone_log = open(tmp_path / "alone", "w+")
    start = time.monotonic()
    procs = [_start(0, 2, address, logs[0]), _start(1, 2, _free_address(), alone_log)]
    try:
        for p, log, want in (
            (procs[0], logs[0], f"[process 0 of 2] lost before joining: process 1 did not join "
             f"within {JOIN_SECONDS} s"),
            (procs[1], alone_log, "[process 1 of 2] lost before joining: process 0 (the "
             "coordinator, 127.0.0.1:"),
        ):  # fmt: skip
            status = p.wait(timeout=JOIN_SECONDS + 90)
            out = _read(log)
            assert status == 1, out[-3000:]
            assert want in out, out[-3000:]
            assert "Terminating process" not in out, out[-3000:]
        assert time.monotonic() - start < JOIN_SECONDS + 60
    finally:
        _stop_all(procs)


def test_of_three_the_one_that_never_started_is_named_by_the_two_that_did(tmp_path):
    # JAX's join says nothing until everyone is in: jpipe's roll call, on a
    # port of its own, tells the two that started which one is missing.
    address, roll = _free_address(), _free_address().rsplit(":", 1)[1]
    logs = [open(tmp_path / f"log{i}", "w+") for i in range(2)]
    procs = [_start(i, 3, address, logs[i], JPIPE_ROLL_CALL_PORT=roll) for i in range(2)]
    try:
        for i in (0, 1):
            status = procs[i].wait(timeout=JOIN_SECONDS + 90)
            out = _read(logs[i])
            assert status == 1, out[-3000:]
            want = (
                f"[process {i} of 3] lost before joining: process 2 did not join within "
                f"{JOIN_SECONDS} s (killed, failed or never started; 2 of 3 started)"
            )
            assert want in out, out[-3000:]
            assert "Terminating process" not in out, out[-3000:]
    finally:
        _stop_all(procs)


def test_a_killed_coordinator_is_named_by_every_survivor_within_the_heartbeat_timeout(tmp_path):
    # Process 0 is killed after joining. JAX runs the coordination service inside
    # process 0 and, when it goes, aborts the others from C++ at once; jpipe runs the
    # service in a process of its own, so the survivors see process 0's heartbeats stop.
    n, address = 3, _free_address()
    logs = [open(tmp_path / f"log{i}", "w+") for i in range(n)]
    procs = [_start(i, n, address, logs[i]) for i in range(n)]
    try:
        _wait_joined(procs, logs)
        procs[0].kill()
        killed = time.monotonic()
        for i in (1, 2):
            status = procs[i].wait(timeout=HEARTBEAT_SECONDS + 30)
            seconds = time.monotonic() - killed
            out = _read(logs[i])
            assert status == 1, f"process {i} exited {status}:\n{out[-3000:]}"
            line = (
                f"[process {i} of 3] lost: process 0 (the coordinator, {address}; no heartbeat "
                f"for {HEARTBEAT_SECONDS} s"
            )
            assert line in out, out[-3000:]
            assert "Terminating process" not in out, out[-3000:]  # not JAX's abort
            assert seconds < HEARTBEAT_SECONDS + 15, f"process {i} took {seconds:.0f} s"
        # The service's process leaves once no process is connected.
        assert _port_is_free(address, 10), "the coordination service still listens"
    finally:
        _stop_all(procs)


def test_a_normal_exit_leaves_no_coordination_service_behind(tmp_path):
    n, address = 2, _free_address()
    logs = [open(tmp_path / f"log{i}", "w+") for i in range(n)]
    procs = [_start(i, n, address, logs[i], PEER_SLEEP="0") for i in range(n)]
    try:
        for i, p in enumerate(procs):
            assert p.wait(timeout=120) == 0, _read(logs[i])[-3000:]
        assert _port_is_free(address, 0), "the coordination service still listens"
    finally:
        _stop_all(procs)


def test_the_heartbeat_timeout_can_be_set_from_the_environment(monkeypatch):
    """`JPIPE_HEARTBEAT_TIMEOUT` (seconds, at least 1) sets the heartbeat timeout for a
    loaded host; the mixed plan's kill test in tests/test_multiprocess.py runs train.py
    with 30 and reads "no heartbeat for 30 s" from a survivor."""
    from jpipe.runtime import distributed

    name = distributed.ENV_HEARTBEAT_TIMEOUT
    monkeypatch.delenv(name, raising=False)
    assert distributed._env_seconds(name) is None
    monkeypatch.setenv(name, "30")
    assert distributed._env_seconds(name) == 30
    for bad, words in (("0", "must be at least 1 second"), ("ten", "is not an integer")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=words):
            distributed._env_seconds(name)
