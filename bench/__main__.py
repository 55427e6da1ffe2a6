"""``python -m bench``: fakes the CPU devices before JAX starts, then runs a suite.

JAX fixes the number of CPU devices when its backend starts, so this peeks at
``--ranks`` and asks for that many before anything touches JAX. On a GPU or
TPU host with enough devices the real ones are used (`bench.run.pick_devices`).
The suites (`bench.run`'s table, `bench.compiler`) are chosen here, so that
neither imports the other's entry point.
"""

import argparse
import json
import os
import sys

import jpipe

_peek = argparse.ArgumentParser(add_help=False)
_peek.add_argument("--ranks", type=int, default=4)
_peek.add_argument("--suite", default="table")
_peeked = _peek.parse_known_args()[0]
jpipe.use_cpu_devices(max(8 if _peeked.suite == "memory" else 1, _peeked.ranks))

# After the device count is set:
from bench import compiler, docs, memory, report  # noqa: E402
from bench.run import meta, parser, pick_devices, run_table, settle  # noqa: E402

# Where --write-docs puts each suite's table: (page, block).
DOCS = {
    "table": ("docs/benchmarks.md", "bench-table"),
    "compiler": ("docs/compiler-measurements.md", "compiler-suite"),
    "memory": ("docs/compiler-measurements.md", "memory-suite"),
}


def main(argv=None) -> int:
    args = settle(parser().parse_args(argv))
    os.makedirs(args.out, exist_ok=True)
    if args.suite == "memory":
        rows = memory.run(args, log=(lambda *a: print(*a, file=sys.stderr)) if args.json else print)
        if args.json:
            print(json.dumps(rows))
            return 0
        paths = report.write_memory(rows, args.out)
        table = report.memory_markdown(rows)
    elif args.suite == "compiler":
        result = compiler.run(args, devices_picker=pick_devices, meta=meta)
        paths = report.write_compiler(result, args.out, plot=not args.no_plot)
        table = report.for_docs(report.compiler_markdown(result))
    else:
        result = run_table(args)
        paths = report.write_table(result, args.out, plot=not args.no_plot)
        table = report.for_docs(report.table_markdown(result))
    for path in paths:
        print(f"wrote {path}")
    if args.write_docs:
        page, name = DOCS[args.suite]
        docs.write(page, name, table, docs.command_line("bench", argv))
        print(f"wrote block {name!r} of {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
