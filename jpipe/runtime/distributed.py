"""Several processes: starting `jax.distributed` and failing fast.

One jpipe program runs as one process per host (or per accelerator), all
running the same code on one global mesh. `initialize_distributed` joins them:

* Explicit arguments (the flags ``--coordinator_address``, ``--num_processes``,
  ``--process_id``, ``--local_device_ids``, named as JAX names them) win;
  then the environment variables ``JAX_COORDINATOR_ADDRESS``,
  ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` and ``JAX_LOCAL_DEVICE_IDS`` (what
  `jpipe.launch` sets for each child); then the clusters JAX detects by
  itself (SLURM, Open MPI, Kubernetes Indexed Jobs, Cloud TPU). With none of
  them it does nothing and the program runs as one process, as before.
* It sets the coordination service's timeouts. JAX's defaults suit long jobs on
  flaky networks, not failing fast: with them a killed peer is noticed after
  about 100 s and a peer that raised holds the others for 300 s. Measured on
  0.10.2 (docs in /work/shared/docs/jax-notes.md): a dead or hung (SIGSTOP'd)
  peer is detected after about the heartbeat timeout, and by default the
  survivors are then aborted from C++ (exit status -6) with JAX's own words
  ("The following tasks are unhealthy"), and a peer that never joins leaves
  the others waiting for the initialisation timeout and aborting without a
  name.
* So the tasks are "recoverable" (``jax_enable_recoverability``: a lost task
  does not abort the others) and jpipe names the lost process itself: a
  thread (`_watch_peers`) asks the service which processes are alive, as
  JAX's C++ heartbeats tell it, and `fail`s on every survivor with
  ``lost: process N (...)``; before joining, a timer names the process that
  did not join (`_name_who_did_not_join`), ahead of JAX's own limit. A
  Python callback for JAX's errors (``missed_heartbeat_callback``) is not
  usable on 0.10.2 (nor on 0.12.1): the status it is given cannot be
  converted (``std::bad_cast``, which terminates the process). Recoverable
  tasks no longer wait for each other in JAX's shutdown, so a normal exit
  waits at a barrier of jpipe's (`_leave_together`), process 0 (the service) last.
* JAX runs the coordination service inside process 0, so a lost process 0
  took the service with it and JAX aborted the others from C++ within a
  fraction of a second ("Terminating process because the JAX distributed
  service detected fatal errors ... the leader task was preempted/died"),
  before any Python could run. jpipe therefore runs the service in a small
  process of its own that process 0 starts (`_service_apart`, the same
  jaxlib service on the same address): a lost process 0 is then a lost task
  like any other, named by the watcher on every survivor (``lost: process 0
  (the coordinator, HOST:PORT; no heartbeat ...``). That process leaves when
  process 0 shuts down normally, or, once process 0 is gone, when no process
  is connected any longer (or after a limit). Only losing that service
  process itself (its host) still ends the others by JAX's abort.
* A Python exception in one process does not reach the others: its atexit
  `jax.distributed.shutdown()` waits for them at a barrier they never reach.
  `initialize_distributed` therefore installs an exception hook that prints the traceback
  under the process's index, flushes, and leaves with ``os._exit(1)``; the
  peers then stop within the heartbeat timeout.

Every process must start JAX's backend (any `jax.devices()` call) after
`initialize_distributed`, or the others wait for it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import traceback

# Environment variables the launcher sets; JAX itself reads only the first and last.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"

HEARTBEAT_TIMEOUT_SECONDS = 10
# JPIPE_HEARTBEAT_TIMEOUT (seconds) changes it, for hosts so loaded that a live process
# may miss its heartbeats for 10 s (a lost process is then named that much later).
ENV_HEARTBEAT_TIMEOUT = "JPIPE_HEARTBEAT_TIMEOUT"
SHUTDOWN_TIMEOUT_SECONDS = 30
# How long a process waits for all the others to join before it names who is missing;
# JPIPE_JOIN_TIMEOUT (seconds) changes it, for clusters that start hosts minutes apart.
INITIALIZATION_TIMEOUT_SECONDS = 30
ENV_JOIN_TIMEOUT = "JPIPE_JOIN_TIMEOUT"
# Who has started, before JAX can say (`_RollCall`): process 0 listens on the
# coordinator's port + 1; JPIPE_ROLL_CALL_PORT names another port, or 0 for none.
ENV_ROLL_CALL_PORT = "JPIPE_ROLL_CALL_PORT"
# JAX's own limits sit past jpipe's, so that jpipe's line comes first: JAX aborts from
# C++ with words of its own ("task 1") where jpipe names the process in one line.
_JAX_MARGIN_SECONDS = 30


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable {name}={value!r} is not an integer") from None


def _env_seconds(name: str) -> int | None:
    """A positive number of seconds from environment variable `name`, or None if unset."""
    seconds = _env_int(name)
    if seconds is not None and seconds < 1:
        raise ValueError(f"the environment variable {name}={seconds} must be at least 1 second")
    return seconds


def detected_cluster() -> str | None:
    """The name of the cluster JAX would detect (``"slurm"``, ``"ompi"``, ...), or None."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # a JAX without cluster detection: only explicit settings
        return None
    for env in ClusterEnv._cluster_types:
        if getattr(env, "opt_in_only_method", False):
            continue
        try:
            if env.is_env_present():
                return getattr(env, "name", env.__name__)
        except Exception:  # a detector that cannot tell (no kubernetes package...)
            continue
    return None


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | list[int] | str | None = None,
    *,
    heartbeat_timeout_seconds: int = HEARTBEAT_TIMEOUT_SECONDS,
    shutdown_timeout_seconds: int = SHUTDOWN_TIMEOUT_SECONDS,
    initialization_timeout: int = INITIALIZATION_TIMEOUT_SECONDS,
) -> bool:
    """Joins the other processes of a multi-process run, if there are any.

    Call it before any JAX computation (faking CPU devices may come before).

    Args:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: how many processes take part.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      local_device_ids: the accelerators this process uses (ints, or a
        comma-separated string), e.g. one GPU per process.
      heartbeat_timeout_seconds: a process silent this long counts as lost,
        and the others stop (the default, 10 s, or ``JPIPE_HEARTBEAT_TIMEOUT``).
      shutdown_timeout_seconds: how long a finishing process waits for the others.
      initialization_timeout: how long to wait for every process to connect
        before naming the missing one and exiting (the default, 30 s, or
        ``JPIPE_JOIN_TIMEOUT``).

    Returns:
      True when this is a multi-process run (`jax.distributed` is initialised),
      False when it runs as a single process.

    Raises:
      ValueError: settings that are incomplete or contradict each other.
    """
    import jax

    if jax.distributed.is_initialized():
        return True
    if isinstance(local_device_ids, str):
        local_device_ids = [int(i) for i in local_device_ids.split(",") if i.strip()]
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    given = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    cluster = None
    if num_processes == 1 and process_id in (None, 0):
        return False  # asked for one process: nothing to join
    if all(v is None for v in given.values()):
        cluster = detected_cluster()
        if cluster is None:
            return False  # one process, as without jax.distributed
    elif None in given.values() and detected_cluster() is None:
        missing = ", ".join(f"--{k}" for k, v in given.items() if v is None)
        raise ValueError(
            f"a multi-process run needs --coordinator_address, --num_processes and "
            f"--process_id (or a cluster JAX detects: SLURM, Open MPI, Kubernetes); "
            f"{missing} not given"
        )
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num_processes must be at least 1, got {num_processes}")
    if num_processes is not None and process_id is not None:
        if not 0 <= process_id < num_processes:
            raise ValueError(
                f"--process_id must be in [0, {num_processes}) for --num_processes="
                f"{num_processes}, got {process_id}"
            )
    global _heartbeat_seconds
    if heartbeat_timeout_seconds == HEARTBEAT_TIMEOUT_SECONDS:
        heartbeat_timeout_seconds = _env_seconds(ENV_HEARTBEAT_TIMEOUT) or heartbeat_timeout_seconds
    _heartbeat_seconds = heartbeat_timeout_seconds
    if initialization_timeout == INITIALIZATION_TIMEOUT_SECONDS and _env_int(ENV_JOIN_TIMEOUT):
        initialization_timeout = _env_int(ENV_JOIN_TIMEOUT)
    # A process that is lost does not take the others down from C++ (JAX's
    # "recoverable" tasks): jpipe's watcher names it and stops them instead.
    jax.config.update("jax_enable_recoverability", True)
    joined = threading.Event()
    if num_processes is not None and process_id is not None:  # else a cluster fills them in
        roll = _RollCall.start(coordinator_address, num_processes, process_id, joined)
        threading.Thread(
            target=_name_who_did_not_join,
            args=(joined, initialization_timeout, coordinator_address, num_processes, process_id),
            kwargs={"roll": roll},
            daemon=True,
            name="jpipe-join-timeout",
        ).start()
    try:
        with _service_apart():
            jax.distributed.initialize(
                coordinator_address=coordinator_address,
                num_processes=num_processes,
                process_id=process_id,
                local_device_ids=local_device_ids,
                heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                shutdown_timeout_seconds=shutdown_timeout_seconds,
                initialization_timeout=initialization_timeout + _JAX_MARGIN_SECONDS,
            )
    finally:
        joined.set()
    install_exit_on_error()
    _start_watching_peers()
    atexit.register(_leave_together, shutdown_timeout_seconds)
    return True


def _name_who_did_not_join(
    joined: threading.Event,
    seconds: int,
    address: str | None,
    n: int,
    me: int,
    roll: _RollCall | None = None,
) -> None:
    """After `seconds` without every process joined: says who is missing, and exits.

    Process 0 listens; a process that never connects cannot be told from one
    that has not started yet, so only the time tells. Who did start, jpipe's
    roll call (`_RollCall`) tells: the line names the processes missing from
    it. Without it (its port taken or closed) two processes still name the
    other, and more name the range awaited.
    """
    # Which processes have joined cannot be learnt on JAX 0.10.2 (nor 0.12.1):
    # `connect` returns only once all of them registered, and until then the
    # client's key-value store is not usable (a `key_value_set` before
    # `connect` returned aborts the process from C++: measured), so no process
    # can say "I am here" through the service; the service's Python object has
    # only `shutdown`, and its `GetTaskState` RPC is not bound in Python (it
    # would need grpcio and the service's protos). The service logs nothing
    # when a task registers.
    if joined.wait(seconds):
        return
    label = f"process {me} of {n}"
    present = roll.present() if roll is not None else None
    if present is not None and me in present:  # the roll call answered: it names them
        missing = sorted(set(range(n)) - present)
        who = (
            f"process {missing[0]}"
            if len(missing) == 1
            else "processes " + ", ".join(map(str, missing[:-1])) + f" and {missing[-1]}"
        )
        text = (
            f"{who} did not join within {seconds} s (killed, failed or never started; "
            f"{len(present)} of {n} started)"
        )
    elif me == 0:
        who = "process 1" if n == 2 else f"some of processes 1 to {n - 1}"
        text = f"{who} did not join within {seconds} s (it was killed, failed or never started)"
    elif not _answers(address):
        text = (
            f"process 0 (the coordinator, {address}) did not answer within {seconds} s (it was "
            "killed, failed or never started, or the address is not reachable from here)"
        )
    else:
        text = f"not every one of the {n} processes joined within {seconds} s"
    print(
        f"[{label}] lost before joining: {text}; start every process of the run, or give more "
        f"time with {ENV_JOIN_TIMEOUT}=SECONDS",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


class _RollCall:
    """Which processes of the run have started, known before JAX's join completes.

    JAX's join tells nothing until every process has registered (see
    `_name_who_did_not_join`), so jpipe keeps a roll of its own over plain
    TCP: process 0 listens on the coordinator's port + 1 (or
    ``JPIPE_ROLL_CALL_PORT``) while the join runs; every other process,
    from its start, tells it its index (``here I``) until it answers. At the
    join timeout each process asks it who came (``who``; process 0 reads its
    own roll; a process whose process 0 has already left takes the last
    answer it had) and names the others. The roll closes once the join
    completes.
    It is best effort: where the port cannot be bound or reached, `present`
    is None and the line falls back to what the time alone tells.
    """

    def __init__(self, port: int, host: str, me: int, server=None):
        self.port, self.host, self.me, self.server = port, host, me, server
        self.seen: set[int] = {0}

    @classmethod
    def start(
        cls, address: str | None, n: int, me: int, joined: threading.Event
    ) -> _RollCall | None:
        try:
            host, port = address.rsplit(":", 1)
            port = int(port) + 1
        except (AttributeError, ValueError):
            return None
        given = _env_int(ENV_ROLL_CALL_PORT)
        port = port if given is None else given
        if not 0 < port < 65536:
            return None
        host = host.strip("[]")
        if me != 0:
            roll = cls(port, host, me)
            threading.Thread(
                target=roll._report, args=(joined,), daemon=True, name="jpipe-roll-call"
            ).start()
            return roll
        import socket

        server = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("", port))
            server.listen(max(n, 8))
            server.settimeout(0.5)
        except OSError:  # the port is taken: no roll call, the line says less
            server.close()
            return None
        roll = cls(port, host, me, server)
        threading.Thread(
            target=roll._serve, args=(joined, n), daemon=True, name="jpipe-roll-call"
        ).start()
        return roll

    def _serve(self, joined: threading.Event, n: int) -> None:
        try:
            while not joined.is_set():
                try:
                    conn, _ = self.server.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                with conn:
                    conn.settimeout(2)
                    try:
                        said = conn.recv(64).decode("ascii", "replace").split()
                        if len(said) == 2 and said[0] == "here" and said[1].isdigit():
                            if int(said[1]) < n:
                                self.seen.add(int(said[1]))
                        elif said != ["who"]:
                            continue
                        conn.sendall((json.dumps(sorted(self.seen)) + "\n").encode())
                    except OSError:
                        continue
        finally:
            self.server.close()

    def _ask(self, words: str) -> set[int] | None:
        import socket

        try:
            with socket.create_connection((self.host, self.port), timeout=2) as conn:
                conn.sendall(words.encode() + b"\n")
                answer = conn.makefile().readline()
            seen = json.loads(answer)
            if isinstance(seen, list) and all(isinstance(i, int) for i in seen):
                return set(seen)
        except (OSError, ValueError):
            pass
        return None

    def _report(self, joined: threading.Event) -> None:
        # Says it is here until the join completes, keeping the latest roll:
        # process 0 may be gone (its own timer ran out first) when this one's does.
        known = None
        while not joined.is_set():
            known = self._ask(f"here {self.me}") or known
            if known is not None:
                self.seen = known
            joined.wait(1.0)

    def present(self) -> set[int] | None:
        """The processes that have said they started, this one included; None if unknown."""
        if self.server is not None:
            return set(self.seen)
        fresh = self._ask("who")
        if fresh is not None:
            return fresh
        return set(self.seen) if self.me in self.seen else None


def _answers(address: str | None) -> bool:
    """Whether something listens at ``host:port``."""
    import socket

    try:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except (OSError, ValueError, AttributeError):
        return False


# The coordination service's own process (`_service_apart`). Arguments: jaxlib's module,
# the address to listen on, the number of processes, JAX's keyword arguments for the
# service (JSON), and how long to serve, at most, once process 0 is gone. It answers
# "ready" (or "error: ...") on stdout, then serves until process 0 writes "stop" on its
# stdin (a normal shutdown). When process 0 is gone instead (its end of stdin closed, or
# this process adopted by another parent), it serves the others until none is connected
# for a second (Linux: /proc/net/tcp*), or the limit: they name process 0 in the meantime.
_SERVICE_CODE = r"""
import importlib, json, os, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C, a scheduler's SIGTERM:
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # for the processes of the run, not the service
module, address, n, kwargs, linger = sys.argv[1:6]
try:
    service = importlib.import_module(module).get_distributed_runtime_service(
        address, int(n), **json.loads(kwargs))
except Exception as e:
    print("error:", (str(e).strip().splitlines() or [type(e).__name__])[0], flush=True)
    sys.exit(1)
print("ready", flush=True)
parent = os.getppid()
said = b""
while os.getppid() == parent:
    if select.select([0], [], [], 0.5)[0]:
        data = os.read(0, 64)
        said += data
        if not data or b"stop" in said:
            break
if b"stop" not in said:
    port = int(address.rsplit(":", 1)[1])

    def connected():
        count, read = 0, False
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(name) as f:
                    rows = f.read().splitlines()[1:]
            except OSError:
                continue
            read = True
            for row in rows:
                cols = row.split()
                if len(cols) > 3 and cols[3] == "01" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    count += 1
        return count if read else None

    deadline, quiet = time.monotonic() + float(linger), None
    while time.monotonic() < deadline:
        if connected() == 0:
            quiet = quiet or time.monotonic()
            if time.monotonic() - quiet >= 1:
                break
        else:
            quiet = None
        time.sleep(0.2)
    os._exit(0)  # process 0 is gone: nothing to shut down in order
service.shutdown()
"""
# How long the service process serves, at most, once process 0 is gone (beyond twice the
# heartbeat timeout); it leaves earlier when it sees no process connected any longer.
SERVICE_LINGER_SECONDS = 30


class _ServiceProcess:
    """Process 0's handle on the coordination service running in a process of its own.

    JAX keeps it as its service and calls `shutdown` last in
    `jax.distributed.shutdown` (after process 0's client shut down).
    """

    def __init__(self, process: subprocess.Popen):
        self._process = process

    def shutdown(self) -> None:
        process = self._process
        if process.poll() is None:
            try:
                process.stdin.write(b"stop\n")
                process.stdin.flush()
            except (OSError, ValueError):
                pass
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class _JaxlibWithServiceApart:
    """jaxlib's module, as `jax._src.distributed` sees it in `_service_apart`."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def get_distributed_runtime_service(self, *args, **kwargs):
        service = None
        if len(args) == 2:  # (address, num_nodes), as JAX 0.10 to 0.12 call it
            service = _start_service_process(self._module.__name__, *args, kwargs)
        if service is None:  # it could not be started: in this process, as JAX does
            return self._module.get_distributed_runtime_service(*args, **kwargs)
        return service


@contextlib.contextmanager
def _service_apart():
    """While JAX initialises, process 0 starts the coordination service in a process of its own.

    So that a lost process 0 does not take the service with it (JAX would
    then abort every other process from C++): the others keep the service,
    see process 0's heartbeats stop, and name it (`_watch_peers`). Where
    JAX's internals are not as expected, the service stays in this process.
    """
    from jax._src import distributed

    module = getattr(distributed, "_jax", None)
    if module is None or not hasattr(module, "get_distributed_runtime_service"):
        yield
        return
    distributed._jax = _JaxlibWithServiceApart(module)
    try:
        yield
    finally:
        distributed._jax = module


def _copy_to_stderr(stream) -> None:
    try:
        for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
            os.write(2, chunk)
    except OSError:
        return


def _start_service_process(module: str, address: str, num_nodes: int, kwargs: dict):
    """Starts `_SERVICE_CODE`; its handle, or None where it could not start."""
    try:
        arguments = json.dumps(kwargs)
    except (TypeError, ValueError):
        return None
    linger = 2 * _heartbeat_seconds + SERVICE_LINGER_SECONDS
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _SERVICE_CODE, module, address, str(num_nodes), arguments,
             str(linger)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
    except OSError:
        return None
    # The service's log lines go to this process's stderr, through this process: its
    # stderr then ends when it ends (whoever reads it is not kept waiting by the service).
    threading.Thread(
        target=_copy_to_stderr, args=(process.stderr,), daemon=True, name="jpipe-service-log"
    ).start()
    answer: list[bytes] = []
    reader = threading.Thread(target=lambda: answer.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)
    line = answer[0].decode(errors="replace").strip() if answer else ""
    if line == "ready":
        process.stdout.close()
        return _ServiceProcess(process)
    process.kill()
    process.wait()
    if line.startswith("error:"):
        raise RuntimeError(
            f"cannot start JAX's coordination service on {address}: {line[6:].strip()}"
        )
    return None


# Set when this process leaves normally: the watcher then stops judging.
_leaving = threading.Event()
_watcher: threading.Thread | None = None


def _start_watching_peers() -> None:
    """Starts the thread that names a lost peer (`_watch_peers`), once per process."""
    global _watcher
    if _watcher is None:
        _watcher = threading.Thread(target=_watch_peers, daemon=True, name="jpipe-peer-watcher")
        _watcher.start()


def _watch_peers() -> None:
    """Asks the coordination service, again and again, which processes are alive.

    `get_live_nodes` answers once every live process has asked (so a busy or
    slow process only delays the answer) and leaves out a process whose
    heartbeats stopped for the heartbeat timeout: killed, stopped (SIGSTOP)
    or cut off. Liveness is judged by JAX's heartbeats, sent from C++, so a
    process whose Python is busy is never taken for lost. A process left out
    is named by `fail` on every process that asked, which then exits.
    """
    from jax._src import distributed

    state = distributed.global_state
    client, n = state.client, state.num_processes
    while not _leaving.is_set():
        try:
            live = client.get_live_nodes(list(range(n)))
        except Exception as e:  # noqa: BLE001 (the service is gone, or this process leaves)
            if _leaving.is_set() or state.client is None:
                return
            fail(f"lost: process 0 (the coordinator) or the connection to it ({_first_line(e)})")
        if _leaving.is_set() or state.client is None:
            return
        gone = [i for i in range(n) if i not in live]
        if gone:
            coordinator = f"the coordinator, {state.coordinator_address}; " if 0 in gone else ""
            fail(
                f"lost: process {', '.join(map(str, gone))} ({coordinator}no heartbeat for "
                f"{_heartbeat_seconds} s: it was killed, stopped or hung)",
                survivors=[i for i in range(n) if i in live],
            )
        _leaving.wait(1.0)


def _leave_together(timeout_seconds: int) -> None:
    """At a normal exit: waits for the others, then lets JAX shut down, process 0 last.

    With recoverable tasks JAX's shutdown no longer waits for the others, and
    process 0 leaving first would take the coordination service from those
    still finishing (JAX then aborts them: "Failed to disconnect from
    coordination service").
    """
    from jax._src import distributed

    _leaving.set()
    client = distributed.global_state.client
    if client is None:
        return
    try:
        client.wait_at_barrier("jpipe/leave", timeout_seconds * 1000)
    except Exception:  # noqa: BLE001 (a peer that failed: JAX's shutdown reports it)
        return
    state = distributed.global_state
    if state.process_id != 0:
        # The watcher may be waiting in `get_live_nodes` for process 0's next
        # call (below): let it return before the client goes.
        if _watcher is not None:
            _watcher.join(timeout=5)
        return
    # Process 0 holds the service: it shuts down last. `get_live_nodes` answers
    # once every live process has asked, and a process that has shut down is no
    # longer live, so it returns {0} when the others are gone.
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        try:
            if set(client.get_live_nodes(list(range(state.num_processes)))) <= {0}:
                return
        except Exception:  # noqa: BLE001
            return
        time.sleep(0.05)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def num_processes() -> int:
    """The processes of this run, known after `initialize_distributed`, no backend started."""
    import jax
    from jax._src import distributed

    if not jax.distributed.is_initialized():
        return 1
    return int(distributed.global_state.num_processes)


_agreed = {}  # how many times each name was used, so that every call has keys of its own


def from_process_zero(name: str, text: str, timeout_seconds: float = 600) -> str:
    """Process 0's `text`, in every process; also a barrier (every process waits for it).

    Through the coordination service's key-value store, not a collective:
    `jax.experimental.multihost_utils`' collectives lay the devices out as
    processes x local devices, so they fail where processes hold different
    numbers of devices (a mixed cluster's hosts). A no-op alone.
    """
    import jax
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return text
    n = _agreed[name] = _agreed.get(name, 0) + 1
    key = f"jpipe/from0/{name}/{n}"
    if jax.process_index() == 0:
        client.key_value_set(key, text)
    else:
        text = client.blocking_key_value_get(key, int(timeout_seconds * 1000))
    client.wait_at_barrier(key + "/read", int(timeout_seconds * 1000))
    return text


def process_index() -> int:
    """This process's index, known after `initialize_distributed`, no backend started."""
    import jax
    from jax._src import distributed

    if not jax.distributed.is_initialized():
        return 0
    return int(distributed.global_state.process_id)


def process_label() -> str:
    """``"process I of N"`` for messages, without starting a backend."""
    import jax
    from jax._src import distributed

    state = distributed.global_state
    if not jax.distributed.is_initialized():
        return "process 0 of 1"
    return f"process {state.process_id} of {state.num_processes}"


def fail(message: str, code: int = 1, survivors: list[int] | None = None) -> None:
    """Prints `message` naming this process, flushes, and exits at once.

    `sys.exit` would run JAX's atexit shutdown, which waits (up to the
    shutdown timeout) for peers that are blocked in a collective; `os._exit`
    lets the coordination service's heartbeats tell them instead.

    Args:
      message: one line.
      code: the exit status.
      survivors: the processes known to be failing with the same message
        (a lost peer named by each): process 0 waits for them to print
        before it exits, as after `failing_together`.
    """
    _leaving.set()
    try:
        print(f"[{process_label()}] {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        _said_and_wait_for_the_others(survivors)
    finally:
        os._exit(code)


# Set by `failing_together`: every process is about to fail with the same message.
_failing_together = False
# How long process 0 waits, then, for the others to have printed theirs.
FAILING_TOGETHER_GRACE_SECONDS = 10


def failing_together() -> None:
    """Tells `fail` that every process is about to fail alike (a config they disagree on).

    Where process 0 holds the coordination service (when it could not be
    started apart, `_service_apart`), its exit makes JAX abort every other
    process from C++ ("Terminating process because the JAX distributed
    service detected fatal errors") at once, often before that process has
    printed its own line. After this call, process 0's `fail` waits (up to
    `FAILING_TOGETHER_GRACE_SECONDS`) until each other process has printed
    before it exits.
    """
    global _failing_together
    _failing_together = True


def _said_and_wait_for_the_others(survivors: list[int] | None = None) -> None:
    """Marks this process's message printed; process 0, failing with others, waits for theirs."""
    from jax._src import distributed

    state = distributed.global_state
    if state.client is None:
        return
    try:
        state.client.key_value_set(f"jpipe/failed/{state.process_id}", "1", allow_overwrite=True)
        if state.process_id != 0 or not (_failing_together or survivors):
            return
        others = range(1, state.num_processes) if survivors is None else survivors
        deadline = time.monotonic() + FAILING_TOGETHER_GRACE_SECONDS
        for p in others:
            if p == 0:
                continue
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0:
                return
            state.client.blocking_key_value_get(f"jpipe/failed/{p}", left)
    except Exception:  # noqa: BLE001 (a lost service or peer: nothing left to wait for)
        return


def lost_processes(timeout_seconds: float | None = None) -> list[int] | None:
    """The processes the coordination service no longer hears from, or None if it cannot tell.

    Asks the service which processes are alive (every live process that asks
    waits for the others, so this returns once the dead ones are noticed:
    within the heartbeat timeout). Waits at most `timeout_seconds` (default:
    the heartbeat timeout plus 5 s).
    """
    import threading

    from jax._src import distributed

    state = distributed.global_state
    if state.client is None:
        return None
    n = state.num_processes
    found: list = []

    def ask():
        try:
            found.append(state.client.get_live_nodes(list(range(n))))
        except Exception as e:  # the coordinator itself is gone
            found.append(e)

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(_heartbeat_seconds + 5 if timeout_seconds is None else timeout_seconds)
    if not found or isinstance(found[0], Exception):
        return None
    return [i for i in range(n) if i not in found[0]]


def _lost_from_the_watcher() -> list[int]:
    """Waits for the watcher to name a lost peer (it exits the process when it does).

    Asking the service here as well would pair this call with the others'
    watchers in `get_live_nodes`, which answers once every live process asked.
    Returns an empty list when no one was named within the heartbeat timeout.
    """
    time.sleep(_heartbeat_seconds + 5)
    return []


_heartbeat_seconds = HEARTBEAT_TIMEOUT_SECONDS
# How a collective or a transfer reports a peer that went away (gloo on CPU; NCCL, the
# coordination service; the transfer API's sockets, as the per-rank lowering meets them:
# "recv() failed errno: 107 err: Transport endpoint is not connected"; a barrier of the
# coordination service, as orbax's checkpoint save meets it: "Barrier failed because: task
# is set to ERROR: UNAVAILABLE: Task 1 heartbeat timeout"). Matched without regard to case.
_PEER_LOST_WORDS = (
    "gloo", "connection closed", "connection reset", "unhealthy", "nccl",
    "recv() failed", "send() failed", "transport endpoint is not connected", "broken pipe",
    "heartbeat timeout",
)  # fmt: skip


def _says_peer_lost(message: str) -> bool:
    """Whether an error's message is one a collective or transfer gives when a peer is gone."""
    return any(word in message.lower() for word in _PEER_LOST_WORDS)


def _excepthook(kind, value, tb) -> None:
    if issubclass(kind, KeyboardInterrupt):
        fail("interrupted", 130)
    text = "".join(traceback.format_exception(kind, value, tb)).rstrip()
    if not _says_peer_lost(str(value)):
        fail(f"stopping after an uncaught exception:\n{text}")
    # A collective failed because a peer is gone: print what failed now, then
    # ask which peer. JAX's own heartbeat check may abort this process first,
    # with "The following tasks are unhealthy (stopped sending heartbeats):"
    # and the lost process's index; either way the message names it.
    print(
        f"[{process_label()}] stopping after an uncaught exception:\n{text}\n"
        f"[{process_label()}] a collective or transfer failed; asking which process is lost "
        f"(up to {_heartbeat_seconds + 5} s)",
        file=sys.stderr,
        flush=True,
    )
    gone = _lost_from_the_watcher() if _watcher is not None else lost_processes()
    if gone:
        fail(f"lost: process {', '.join(map(str, gone))} (no longer reachable)")
    if gone is None:
        fail("lost: the coordinator (process 0) or the connection to it")
    fail("every process still answers; the collective failed for another reason")


def install_exit_on_error() -> None:
    """Makes an uncaught exception (or `sys.exit` with an error) leave at once.

    An uncaught exception goes through `sys.excepthook`; `SystemExit` does
    not, so absl-style ``sys.exit("error: ...")`` is handled by the caller
    with `exit_on_error` around its main function.
    """
    sys.excepthook = _excepthook


def exit_distributed(code) -> None:
    """`sys.exit(code)` that, in a multi-process run, fails fast on an error.

    A zero or None status exits normally (JAX's shutdown barrier is where the
    processes finish together); an error leaves through `fail`.
    """
    import jax

    if not code or not jax.distributed.is_initialized():
        sys.exit(code)
    if isinstance(code, int):
        fail(f"exiting with status {code}", code)
    fail(str(code), 1)
