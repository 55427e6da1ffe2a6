"""Run one program as N processes on this machine, as a multi-host job would.

Usage::

    python -m jpipe.launch -n 2 [--cpu_devices 2] [--one_thread] -- train.py ARGS
    python -m jpipe.launch -n 2 --cpu_devices 2 -- -m jpipe.check 1f1b --ranks 4 -m 8

Each process gets ``JAX_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port),
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, which train.py and the checker
pass to `jax.distributed.initialize`. Output lines are prefixed with the
process index; the exit status is the first non-zero one, and when a process
fails the others are stopped. See `jpipe.runtime.launch` and docs/multihost.md.
"""

from __future__ import annotations

import argparse
import sys

from jpipe.runtime.console import run_main
from jpipe.runtime.launch import launch_local


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1 :]
    else:
        own, command = argv, []
    parser = argparse.ArgumentParser(
        prog="python -m jpipe.launch",
        description=__doc__.split("\n")[0],
        usage=(
            "python -m jpipe.launch -n N [--cpu_devices K] [--one_thread] [--timeout S]"
            " -- PROGRAM ARGS"
        ),
    )
    parser.add_argument("-n", "--num_processes", type=int, required=True, help="processes (N)")
    parser.add_argument(
        "--cpu_devices", type=int, default=None, help="fake K CPU devices in each process"
    )
    parser.add_argument(
        "--one_thread", action="store_true", help="one busy thread per process, each on one core"
    )
    parser.add_argument(
        "--grace", type=float, default=3.0, help="seconds a stopped process has before SIGKILL"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="stop every process after this many seconds and exit with 124 (default: no limit)",
    )
    args = parser.parse_args(own)
    if not command:
        parser.error("give the program after --, e.g. -- train.py --workdir=runs/x")
    try:
        return launch_local(
            command,
            args.num_processes,
            cpu_devices=args.cpu_devices,
            one_thread=args.one_thread,
            grace_seconds=args.grace,
            timeout_seconds=args.timeout,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run_main(main))
