"""What `jpipe.launch` passes on from its children's output (no JAX: plain child processes)."""

import io

from jpipe import launch_local

GLOO = (
    "[Gloo] Rank {r} is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
)


def test_gloos_connection_lines_are_dropped_and_everything_else_kept():
    # A child that prints what JAX's CPU collectives print on stdout for each
    # connection, around lines of its own on both streams.
    code = (
        "import os, sys\n"
        "r = os.environ['JAX_PROCESS_ID']\n"
        "print('before', r)\n"
        f"for _ in range(4): print({GLOO!r}.format(r=r))\n"
        "print('[Gloo] something else', r)\n"
        "print('warning', r, file=sys.stderr)\n"
        "print('after', r)\n"
    )
    out, err = io.StringIO(), io.StringIO()
    assert launch_local(["-c", code], 2, stdout=out, stderr=err, timeout_seconds=60) == 0
    lines = sorted(out.getvalue().splitlines())
    assert lines == sorted(
        f"[{i}] {text} {i}"
        for i in range(2)
        for text in ("before", "[Gloo] something else", "after")
    )
    assert sorted(err.getvalue().splitlines()) == ["[0] warning 0", "[1] warning 1"]
