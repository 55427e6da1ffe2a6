"""What this XLA does with the two constructs issue 10's last targets would need.

``python -m bench.xla_limits``

1. **Writes inside branches.** A step's buffers (residuals, carries,
   gradients) are written in place. If the write sat inside a branch of a
   multi-way `lax.switch` (so one conditional per piece kind would do), XLA
   must not copy the buffer. This compiles a scan over ticks whose body writes
   a 16 MiB buffer through each shape of conditional and prints the compiled
   temp bytes and the buffer-sized ``copy`` ops. On jaxlib 0.10.2's XLA:CPU
   only a two-way `cond` with one writing branch and one identity branch
   keeps the buffer in place; a switch or nested conds whose branches all
   write copy the whole buffer. On jaxlib 0.12.0's every shape here updates
   it in place (XLA's fix for buffers passed through conditionals), which
   is what lets jpipe lower a tick with one switch per piece kind
   (`jpipe.lower.spmd.program.switch_writes_in_place` probes the same thing).
2. **Transfers of only what is sent.** `lax.ragged_all_to_all` sends a
   dynamic number of elements per peer, so an idle channel would move zero
   bytes without a conditional around it. This runs one under `shard_map` and
   prints whether the backend implements it (XLA:CPU does not).

Prints one JSON object per line, the first naming the jax and jaxlib versions;
``--write-docs`` also writes the table into docs/compiler-measurements.md
(block ``xla-limits-jaxlib-X.Y``, one per jaxlib).
"""

from __future__ import annotations

import argparse
import json

import jpipe

jpipe.use_cpu_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

BUFFER = 1 << 22  # float32 elements: 16 MiB


def _writer(k):
    def write(buf, offset):
        value = jnp.sin(jnp.arange(1024 * (k + 1), dtype=jnp.float32) + offset)
        return lax.dynamic_update_slice(buf, value, (offset,))

    return write


def _identity(buf, offset):
    return buf


SHAPES = {
    "cond(write, identity)": lambda c, b, o: lax.cond(c >= 0, _writer(0), _identity, b, o),
    "cond(write, write)": lambda c, b, o: lax.cond(c >= 0, _writer(0), _writer(1), b, o),
    "switch(identity, write, identity)": lambda c, b, o: lax.switch(
        c, [_identity, _writer(0), _identity], b, o
    ),
    "switch(write, write, write)": lambda c, b, o: lax.switch(
        c, [_writer(0), _writer(1), _writer(2)], b, o
    ),
    "cond(c == 0, write, cond(c == 1, write, write))": lambda c, b, o: lax.cond(
        c == 0,
        _writer(0),
        lambda b2, o2: lax.cond(c == 1, _writer(1), _writer(2), b2, o2),
        b,
        o,
    ),
}


def conditional_copies() -> list[dict]:
    rows = []
    for name, body in SHAPES.items():

        def run(buf, classes, offsets, body=body):
            def tick(buf, xs):
                return body(xs[0], buf, xs[1]), None

            return lax.scan(tick, buf, (classes, offsets))[0]

        compiled = (
            jax.jit(run, donate_argnums=0)
            .lower(jnp.zeros(BUFFER), jnp.zeros(8, jnp.int32), jnp.zeros(8, jnp.int32))
            .compile()
        )
        copies = sum(
            " copy(" in line and f"f32[{BUFFER}]" in line
            for line in compiled.as_text().splitlines()
        )
        rows.append(
            {
                "conditional": name,
                "buffer_bytes": BUFFER * 4,
                "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                "buffer_copies": copies,
            }
        )
    return rows


def ragged_transfer() -> dict:
    """Each rank sends 2 elements to the next rank, none from the last."""
    mesh = jax.make_mesh((4,), ("pipe",))
    R = 4

    def per_rank(x):
        r = lax.axis_index("pipe")
        zeros = jnp.zeros((R,), jnp.int32)
        send = zeros.at[(r + 1) % R].set(jnp.where(r < R - 1, 2, 0))
        recv = zeros.at[(r - 1) % R].set(jnp.where(r > 0, 2, 0))
        out = lax.ragged_all_to_all(
            x[0], jnp.zeros_like(x[0]), zeros, send, zeros, recv, axis_name="pipe"
        )
        return out[None]

    x = jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(mesh, P("pipe")))
    step = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("pipe"), out_specs=P("pipe")))
    try:
        got = np.asarray(step(x))
    except Exception as err:  # noqa: BLE001 - the point is to report what the backend says
        return {
            "ragged_all_to_all": "unsupported",
            "backend": jax.default_backend(),
            "error": str(err)[:200],
        }
    expected = np.zeros((4, 8), np.float32)
    for r in range(1, 4):
        expected[r, :2] = np.arange(32.0).reshape(4, 8)[r - 1, :2]
    return {
        "ragged_all_to_all": "ok" if np.array_equal(got, expected) else "wrong result",
        "backend": jax.default_backend(),
    }


def _bytes(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} B"


def markdown(rows: list[dict], ragged: dict) -> str:
    lines = ["| conditional | temp | buffer copies |", "|---|---|---|"]
    lines += [
        f"| `{r['conditional']}` | {_bytes(r['temp_bytes'])} | {r['buffer_copies']} |" for r in rows
    ]
    lines += ["", f"`ragged_all_to_all` on {ragged['backend']}: {ragged['ragged_all_to_all']}."]
    return "\n".join(lines)


DOCS_PAGE = "docs/compiler-measurements.md"


def main(argv=None) -> None:
    import jaxlib

    from bench import docs

    parser = argparse.ArgumentParser(prog="python -m bench.xla_limits")
    docs.add_flag(parser, DOCS_PAGE)
    args = parser.parse_args(argv)
    print(json.dumps({"jax": jax.__version__, "jaxlib": jaxlib.__version__}))
    rows = conditional_copies()
    for row in rows:
        print(json.dumps(row))
    ragged = ragged_transfer()
    print(json.dumps(ragged))
    if args.write_docs:
        name = "xla-limits-jaxlib-" + ".".join(jaxlib.__version__.split(".")[:2])
        table = markdown(rows, ragged)
        docs.write(DOCS_PAGE, name, table, docs.command_line("bench.xla_limits", argv))
        print(f"wrote block {name!r} of {DOCS_PAGE}")


if __name__ == "__main__":
    main()
