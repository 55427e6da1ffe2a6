"""Bench commands rewrite their own table in a docs page.

A measurement page marks each generated table with a pair of HTML comments,
which Markdown renders as nothing::

    <!-- bench:NAME -->
    ...the table, then one line: the command that made it, its date,
    jax / jaxlib and the machine...
    <!-- /bench:NAME -->

`replace_block` swaps what lies between one such pair for a fresh block and
leaves every other character of the page as it was; it refuses a page where
the pair is missing, doubled or out of order, naming the page and the block.
Each bench command that feeds a page takes ``--write-docs`` (`add_flag`) and
calls `write` with its table and its own command line; commands that only
print a table (or live outside ``bench/``) are run through this module::

    python -m bench.docs docs/planner-validation.md planner-validation -- \\
        python -m jpipe.plan --validate-all jpipe/_data/sailor/validation --markdown

which runs the command, takes its stdout as the table and writes the block.
History stays in git (``git log -p docs/PAGE.md``), not in the page.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys

_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")


class MarkerError(ValueError):
    """A page's markers for a block are missing, doubled or out of order."""


def markers(name: str) -> tuple[str, str]:
    """The opening and closing comment of block `name`."""
    if not _NAME.match(name):
        raise ValueError(
            f"block name {name!r}: use lower-case letters, digits, '-', '_' and '.' only"
        )
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def replace_block(text: str, name: str, body: str, page: str = "the page") -> str:
    """`text` with the lines between block `name`'s markers replaced by `body`.

    The markers stay on their own lines; everything before the opening one and
    after the closing one is kept byte for byte.
    """
    begin, end = markers(name)
    starts = [m.start() for m in re.finditer(re.escape(begin), text)]
    ends = [m.start() for m in re.finditer(re.escape(end), text)]
    if not starts and not ends:
        raise MarkerError(
            f"{page} has no block {name!r}: add the lines {begin} and {end} where its table belongs"
        )
    if len(starts) != 1 or len(ends) != 1:
        raise MarkerError(
            f"{page} has {len(starts)} '{begin}' and {len(ends)} '{end}' markers; "
            f"block {name!r} needs exactly one of each"
        )
    if ends[0] < starts[0]:
        raise MarkerError(f"{page}: '{end}' comes before '{begin}'")
    head = text[: starts[0] + len(begin)]
    tail = text[ends[0] :]
    return head + "\n" + body.strip("\n") + "\n" + tail


def blocks(text: str) -> list[str]:
    """The names of the blocks a page marks, in order."""
    return re.findall(r"<!-- bench:([a-z0-9][a-z0-9_.-]*) -->", text)


def machine() -> str:
    """One phrase for the host: its processor, cores and, if not a CPU, the devices."""
    host = f"{platform.machine() or platform.processor()}, {os.cpu_count()} cores"
    try:
        import jax

        devices = jax.devices()
        if devices and devices[0].platform != "cpu":
            host += f", {len(devices)} x {devices[0].device_kind}"
    except Exception:  # noqa: BLE001 - no JAX backend is no reason to refuse the page
        pass
    return host


def versions() -> str:
    try:
        import jax
        import jaxlib

        return f"jax {jax.__version__} / jaxlib {jaxlib.__version__}"
    except ImportError:
        return "no jax"


def stamp(command: str, date: str | None = None) -> str:
    """The line under a table: command, date, versions, machine."""
    date = date or datetime.date.today().isoformat()
    return f"`{command}` · {date} · {versions()} · {machine()}"


def block(table: str, command: str, date: str | None = None) -> str:
    return table.strip("\n") + "\n\n" + stamp(command, date)


def write(page: str, name: str, table: str, command: str, date: str | None = None) -> str:
    """Replaces block `name` of `page` with `table` and its stamp; returns the page."""
    with open(page, encoding="utf-8") as f:
        text = f.read()
    new = replace_block(text, name, block(table, command, date), page)
    with open(page, "w", encoding="utf-8") as f:
        f.write(new)
    return page


def command_line(module: str, argv=None) -> str:
    """``python -m MODULE ARGS``, as this process was started."""
    args = sys.argv[1:] if argv is None else list(argv)
    return f"python -m {module} " + shlex.join(args) if args else f"python -m {module}"


def add_flag(parser: argparse.ArgumentParser, page: str) -> None:
    """``--write-docs``: also rewrite this command's block(s) in `page`."""
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help=f"also replace this command's table in {page} (between its bench: markers)",
    )


def run_and_write(page: str, name: str, command: list[str]) -> int:
    """Runs `command`, takes its stdout as the table, writes it into `page`."""
    if not command:
        raise SystemExit("give the command after --")
    # Check the markers before spending the command's time.
    with open(page, encoding="utf-8") as f:
        replace_block(f.read(), name, "", page)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        sys.stdout.write(done.stdout)
        raise SystemExit(f"{shlex.join(command)} exited {done.returncode}; {page} not changed")
    made_by = shlex.join(["python", "-m", "bench.docs", page, name, "--", *command])
    write(page, name, done.stdout, made_by)
    print(f"wrote block {name!r} of {page}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m bench.docs",
        description="Run a command and write its stdout as block NAME of PAGE "
        "(or, with no command, list PAGE's blocks).",
    )
    parser.add_argument("page")
    parser.add_argument("name", nargs="?")
    args = parser.parse_args(argv)
    if args.name is None:
        with open(args.page, encoding="utf-8") as f:
            print("\n".join(blocks(f.read())))
        return 0
    return run_and_write(args.page, args.name, command)


if __name__ == "__main__":
    raise SystemExit(main())
