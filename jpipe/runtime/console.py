"""What every command line does around its `main`: a reader that stops early, a shadowed package.

``python -m jpipe.show ... | head`` closes the pipe after a few lines. The
next write then raises `BrokenPipeError` (Python ignores SIGPIPE and turns
it into that exception), and without care the user sees its traceback, and
another from the interpreter's final flush of stdout. A command line that
was cut short by its reader has done nothing wrong: `run_main` ends it
quietly, with the status a shell gives a program that SIGPIPE stopped
(128 + 13), as ``yes | head`` reports under ``set -o pipefail``. Nothing
here imports JAX.

A folder named ``jpipe`` in the directory a command runs from (a clone of
the repository, run from its parent) hides the package when it is installed
editable (``pip install -e .``: setuptools' import hook comes after Python's
search of the current directory). Python then takes the folder for a
namespace package: ``jpipe/__init__.py`` never runs, the modules under it
still import, and the first ``from jpipe import B`` fails with "cannot import
name 'B' from 'jpipe' (unknown location)". Nothing inside the package can
change that for a user's own ``import jpipe``; `run_main` at least refuses
at the start of a command, in one line that names the folder.

Use it in a command's ``if __name__ == "__main__":`` block::

    sys.exit(run_main(main))
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

CLOSED_PIPE_STATUS = 128 + 13
"""The exit status after the reader closed stdout: a shell's status for SIGPIPE."""


def shadowing_folders() -> list[str]:
    """The folders that stand for ``jpipe`` when it was imported as a namespace package, else [].

    The package has an ``__init__.py``; a module ``jpipe`` without a file is
    a folder of that name found first on `sys.path` (see the module docstring).
    """
    package = sys.modules.get("jpipe")
    if package is None or getattr(package, "__file__", None) is not None:
        return []
    return [str(p) for p in getattr(package, "__path__", [])]


def shadowing_message(folders: list[str]) -> str:
    """The one line that says a folder hides the package, and what to do."""
    where = " and ".join(folders)
    return (
        f"'jpipe' was imported from the folder {where}, which is not the jpipe package "
        "(it has no __init__.py): a folder named jpipe in the directory you run from "
        "(a clone of the repository?) hides the installed package. Run from inside the "
        "clone or from another directory, or rename the folder"
    )


def run_main(main: Callable[[], int | None]) -> int:
    """Runs `main` and returns its status, or `CLOSED_PIPE_STATUS` if stdout closed early.

    First refuses, with status 2 and one ``error:`` line, to run with a
    folder standing for the package (`shadowing_folders`). stdout is flushed
    inside, so a closed pipe shows here rather than at exit; after one,
    stdout is pointed at the null device, so the interpreter's own last
    flush has nowhere to fail.
    """
    folders = shadowing_folders()
    if folders:
        print(f"error: {shadowing_message(folders)}", file=sys.stderr)
        return 2
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return CLOSED_PIPE_STATUS
    return 0 if status is None else status
