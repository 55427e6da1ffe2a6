"""Several processes: starting `jax.distributed` and failing fast.

One jpipe program runs as one process per host (or per accelerator), all
running the same code on one global mesh. `initialize` joins them:

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
  peer is detected after about the heartbeat timeout, and the survivors are
  aborted from C++ (exit status -6) with a message listing the "unhealthy"
  task, i.e. the lost process's index.
* A Python exception in one process does not reach the others: its atexit
  `jax.distributed.shutdown()` waits for them at a barrier they never reach.
  `initialize` therefore installs an exception hook that prints the traceback
  under the process's index, flushes, and leaves with ``os._exit(1)``; the
  peers then stop within the heartbeat timeout.

Every process must start JAX's backend (any `jax.devices()` call) after
`initialize`, or the others wait for it.
"""

from __future__ import annotations

import os
import sys
import traceback

# Environment variables the launcher sets; JAX itself reads only the first and last.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"

HEARTBEAT_TIMEOUT_SECONDS = 10
SHUTDOWN_TIMEOUT_SECONDS = 30
INITIALIZATION_TIMEOUT_SECONDS = 120


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable {name}={value!r} is not an integer") from None


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


def initialize(
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
        and the others stop.
      shutdown_timeout_seconds: how long a finishing process waits for the others.
      initialization_timeout: how long to wait for every process to connect.

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
    _heartbeat_seconds = heartbeat_timeout_seconds
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        shutdown_timeout_seconds=shutdown_timeout_seconds,
        initialization_timeout=initialization_timeout,
    )
    install_exit_on_error()
    return True


def num_processes() -> int:
    """The processes of this run, known after `initialize` without starting a backend."""
    import jax
    from jax._src import distributed

    if not jax.distributed.is_initialized():
        return 1
    return int(distributed.global_state.num_processes)


def process_label() -> str:
    """``"process I of N"`` for messages, without starting a backend."""
    import jax
    from jax._src import distributed

    state = distributed.global_state
    if not jax.distributed.is_initialized():
        return "process 0 of 1"
    return f"process {state.process_id} of {state.num_processes}"


def fail(message: str, code: int = 1) -> None:
    """Prints `message` naming this process, flushes, and exits at once.

    `sys.exit` would run JAX's atexit shutdown, which waits (up to the
    shutdown timeout) for peers that are blocked in a collective; `os._exit`
    lets the coordination service's heartbeats tell them instead.
    """
    try:
        print(f"[{process_label()}] {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(code)


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
    gone = lost_processes()
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


def exit_now(code) -> None:
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
