"""Starting N processes of one program on this machine, as on N hosts.

`launch_local` runs the same command N times, each with the environment a
multi-host job gives its processes (read by `jpipe.runtime.distributed.initialize_distributed`):
``JAX_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port), ``JAX_NUM_PROCESSES``
and ``JAX_PROCESS_ID``; optionally N x K fake CPU devices
(``JAX_PLATFORMS=cpu``, ``JAX_NUM_CPU_DEVICES=K``) and one busy thread per
process, which is the closest a single machine gets to separate accelerators.

One thread (``one_thread``) means each child is pinned to one core of those
the launcher may use (child i to the i-th, round robin), before it starts:
XLA:CPU sizes its thread pools by the cores a process may run on, so a
pinned process computes on one thread. XLA's flags alone do not do it:
``--xla_cpu_multi_thread_eigen=false`` still left two busy Eigen threads and
a second busy Python thread per process (jaxlib 0.10.2, measured from
``/proc/self/task``). Where the system cannot pin (no
`os.sched_setaffinity`, as on macOS), the launcher says so and runs the
children with the flag only.

Supervision, so that a failure is seen and nothing is left behind:

* each line a child prints comes out prefixed with its index (``[1] ...``),
  stdout to stdout and stderr to stderr, except Gloo's report of each
  connection it makes (``[Gloo] Rank 0 is connected to 1 peer ranks. ...``,
  printed by JAX's CPU collectives once per communicator, 8 lines a process
  for a small training run), which says nothing when all goes well and
  nothing a failure message does not say better (`CHATTY_LINES`);
* when a child exits with a non-zero status, the launcher says which one and
  stops the others (SIGTERM, then SIGKILL after a grace period: JAX's
  preemption service catches SIGTERM and may not exit on it); its own exit
  status is the first non-zero status (128 + N for a child killed by signal N);
* Ctrl-C is forwarded to every child as SIGINT; the same grace period applies;
* with a time limit, a job still running when it is spent is stopped the same
  way and the launcher exits with 124 (as coreutils' ``timeout``): a hung
  collective then ends a test or a scheduled job instead of holding it;
* whatever else ends the launcher (an exception in the caller's thread) stops
  the children first, so none outlives it.

The children run in their own sessions, so a terminal's Ctrl-C reaches only
the launcher, which decides what each child gets.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from jpipe.runtime.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

CHATTY_LINES = re.compile(rb"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. ")
"""Lines of the children's output that the launcher drops (see the module docstring)."""

ONE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def cores_for(num_processes: int) -> list[int] | None:
    """The core each of `num_processes` children is pinned to, round robin over the cores
    this process may use; None where the system cannot pin a process."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return [allowed[i % len(allowed)] for i in range(num_processes)]


def _start_pinned(core: int | None, start):
    """Runs `start()` (which forks a child) with this thread pinned to `core`, so the
    child starts pinned to it; this thread's own cores are restored after."""
    if core is None:
        return start()
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})  # 0: this thread only, on Linux; a child inherits it
    try:
        return start()
    finally:
        os.sched_setaffinity(0, mine)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def child_env(
    process_id: int,
    num_processes: int,
    coordinator_address: str,
    *,
    cpu_devices: int | None = None,
    one_thread: bool = False,
    base: dict | None = None,
) -> dict:
    """The environment of child `process_id`: the coordinator, its index, its devices."""
    env = dict(os.environ if base is None else base)
    env[ENV_COORDINATOR] = coordinator_address
    env[ENV_NUM_PROCESSES] = str(num_processes)
    env[ENV_PROCESS_ID] = str(process_id)
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed
    flags = env.get("XLA_FLAGS", "").split()
    if cpu_devices is not None:
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
        flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={cpu_devices}")
    if one_thread:
        flags += ONE_THREAD_XLA_FLAGS.split()
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def command_line(command: Sequence[str]) -> list[str]:
    """``train.py ARGS``, ``-m module ARGS`` or ``-c CODE`` run with this Python; else as given."""
    command = list(command)
    if not command:
        raise ValueError("no command to launch: give one after --, e.g. -- train.py")
    if command[0] in ("-m", "-c") or command[0].endswith(".py"):
        return [sys.executable] + command
    return command


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _pump(stream, out, prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        if CHATTY_LINES.match(raw):
            continue
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def launch_local(
    command: Sequence[str],
    num_processes: int,
    *,
    cpu_devices: int | Sequence[int] | None = None,
    one_thread: bool = False,
    grace_seconds: float = 3.0,
    timeout_seconds: float | None = None,
    env: dict | None = None,
    stdout=None,
    stderr=None,
) -> int:
    """Runs `command` as `num_processes` cooperating processes; returns the exit status.

    Args:
      command: the program and its arguments (see `command_line`).
      num_processes: N, the processes to start.
      cpu_devices: fake this many CPU devices in each process (and use the CPU), or
        a count per process (hosts of a plan, `jpipe.planner.TrainerSettings.process_devices`).
      one_thread: one busy thread per process: each pinned to one core (see the
        module docstring).
      grace_seconds: after SIGTERM or SIGINT, how long a child has before SIGKILL.
      timeout_seconds: stop every child when the job has run this long (None:
        no limit) and return 124.
      env: the base environment (default: this process's).
      stdout, stderr: where the prefixed lines go (default: this process's).

    Returns:
      0 when every process exited with 0, else the first non-zero exit status
      (128 + N for a process killed by signal N); 130 after Ctrl-C; 124 when
      the time limit was spent.
    """
    if timeout_seconds is not None and timeout_seconds <= 0:
        raise ValueError(f"the time limit must be positive, got {timeout_seconds} s")
    if num_processes < 1:
        raise ValueError(f"-n must be at least 1, got {num_processes}")
    counts = [cpu_devices] * num_processes if isinstance(cpu_devices, int) else cpu_devices
    if counts is not None:
        counts = list(counts)
        if len(counts) != num_processes:
            raise ValueError(f"{len(counts)} device counts for {num_processes} processes")
        if min(counts) < 1:
            raise ValueError(f"--cpu_devices must be at least 1, got {min(counts)}")
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    argv = command_line(command)
    address = f"127.0.0.1:{free_port()}"
    lock = threading.Lock()

    def say(text: str) -> None:
        with lock:
            stderr.write(f"jpipe.launch: {text}\n")
            stderr.flush()

    cores = cores_for(num_processes) if one_thread else None
    if one_thread and cores is None:
        say("--one_thread cannot pin processes to cores here; XLA's flag only")
    children: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for i in range(num_processes):
            start = lambda i=i: subprocess.Popen(  # noqa: E731
                argv,
                env=child_env(
                    i,
                    num_processes,
                    address,
                    cpu_devices=None if counts is None else counts[i],
                    one_thread=one_thread,
                    base=env,
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            child = _start_pinned(None if cores is None else cores[i], start)
            children.append(child)
            for stream, out in ((child.stdout, stdout), (child.stderr, stderr)):
                t = threading.Thread(target=_pump, args=(stream, out, f"[{i}] ", lock), daemon=True)
                t.start()
                pumps.append(t)
    except OSError as e:
        for child in children:
            child.kill()
        raise ValueError(f"cannot start {argv[0]!r}: {e}") from None

    status = 0
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    try:
        while True:
            codes = [c.poll() for c in children]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                status = _exit_status(code)
                running = [j for j, c in enumerate(codes) if c is None]
                say(
                    f"process {i} {_describe(code)}"
                    + (f"; stopping process(es) {running}" if running else "")
                )
                _stop(children, signal.SIGTERM, grace_seconds)
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                running = [j for j, c in enumerate(codes) if c is None]
                say(f"time limit of {timeout_seconds:g} s spent; stopping process(es) {running}")
                _stop(children, signal.SIGTERM, grace_seconds)
                status = 124
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        say("interrupted; stopping every process")
        _stop(children, signal.SIGINT, grace_seconds)
        status = 130
    except BaseException:
        _stop(children, signal.SIGKILL, 0.0)
        raise
    for t in pumps:
        t.join(timeout=5)
    return status


def _stop(children: list[subprocess.Popen], sig: int, grace_seconds: float) -> None:
    """Sends `sig` to the children still running, then SIGKILL after the grace period."""
    for child in children:
        if child.poll() is None:
            try:
                child.send_signal(sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_seconds
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
