"""Run one program as N processes on this machine, as a multi-host job would.

Usage::

    python -m jpipe.launch -n 2 [--cpu_devices 2] [--one_thread] -- train.py ARGS
    python -m jpipe.launch -n 2 --cpu_devices 2 -- -m jpipe.check 1f1b --ranks 4 -m 8
    python -m jpipe.launch --plan plan.json -- train.py --config.plan=plan.json ARGS

Each process gets ``JAX_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port),
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, which train.py and the checker
pass to `jax.distributed.initialize`. With ``--plan``, a per-rank plan file's
processes (its hosts) are started, each faking its own host's device count.
Output lines are prefixed with the
process index; the exit status is the first non-zero one, and when a process
fails the others are stopped. See `jpipe.runtime.launch` and docs/multihost.md.
"""

from __future__ import annotations

import argparse
import sys

from jpipe.planner import read_plan_file
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
    parser.add_argument("-n", "--num_processes", type=int, default=None, help="processes (N)")
    parser.add_argument(
        "--cpu_devices", type=int, default=None, help="fake K CPU devices in each process"
    )
    parser.add_argument(
        "--plan",
        default=None,
        help="start a per-rank plan file's processes (python -m jpipe.plan --memory-layout mpmd "
        "... --save FILE), each with its own host's count of fake CPU devices",
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
    devices = args.cpu_devices
    if args.plan is not None:
        if args.num_processes is not None or args.cpu_devices is not None:
            parser.error("--plan gives the processes and their devices: drop -n and --cpu_devices")
        try:
            hosts = read_plan_file(args.plan).process_devices
        except ValueError as e:
            parser.error(str(e))
        if hosts is None:
            parser.error(
                f"{args.plan} lists no processes: only a per-rank plan whose ranks each sit on "
                "one host does (python -m jpipe.plan --memory-layout mpmd ... --save FILE)"
            )
        args.num_processes, devices = len(hosts), list(hosts)
    elif args.num_processes is None:
        parser.error("give -n N (the processes), or --plan FILE")
    try:
        return launch_local(
            command,
            args.num_processes,
            cpu_devices=devices,
            one_thread=args.one_thread,
            grace_seconds=args.grace,
            timeout_seconds=args.timeout,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run_main(main))
