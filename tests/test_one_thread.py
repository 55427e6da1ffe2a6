"""`jpipe.launch_local(one_thread=True)`: each process computes on one thread, read from /proc."""

import io
import os
import sys

import pytest

import jpipe
from jpipe.runtime.launch import cores_for

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or not hasattr(os, "sched_setaffinity"),
    reason="needs Linux's /proc/self/task and sched_setaffinity",
)

# Each child runs a jitted matmul loop and reports the threads that did a
# real share of the work (a quarter of the CPU time the loop took, or more).
CHILD = r"""
import os, jax, jax.numpy as jnp
def cpu_by_thread():
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            stat = open(f"/proc/self/task/{t}/stat").read()
        except FileNotFoundError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[t] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out
x = jnp.ones((512, 512))
f = jax.jit(lambda a: jnp.tanh(a @ a) @ a / 512)
f(x).block_until_ready()
before = cpu_by_thread()
for _ in range(60):
    x = f(x)
x.block_until_ready()
after = cpu_by_thread()
used = {t: after[t] - before.get(t, 0.0) for t in after}
total = sum(used.values())
busy = [t for t, s in used.items() if s >= 0.25 * total]
print(f"cores {len(os.sched_getaffinity(0))} busy {len(busy)} total {total:.2f}")
"""


def _run(one_thread: bool) -> list[str]:
    out, err = io.StringIO(), io.StringIO()
    status = jpipe.launch_local(
        ["-c", CHILD],
        2,
        cpu_devices=1,
        one_thread=one_thread,
        stdout=out,
        stderr=err,
        timeout_seconds=300,
    )
    assert status == 0, err.getvalue()
    return sorted(line for line in out.getvalue().splitlines() if " busy " in line)


def test_one_thread_pins_each_process_to_one_core_and_it_computes_on_one_thread():
    lines = _run(one_thread=True)
    assert len(lines) == 2, lines
    for line in lines:
        fields = line.split()
        assert fields[1:5] == ["cores", "1", "busy", "1"], lines


def test_without_it_a_process_may_use_every_core():
    lines = _run(one_thread=False)
    assert len(lines) == 2, lines
    for line in lines:
        assert line.split()[2] == str(len(os.sched_getaffinity(0))), lines


def test_cores_go_round_robin_over_the_allowed_ones():
    allowed = sorted(os.sched_getaffinity(0))
    cores = cores_for(len(allowed) + 1)
    assert cores[: len(allowed)] == allowed and cores[-1] == allowed[0]
    assert os.sched_getaffinity(0) == set(allowed)  # the launcher's own cores untouched


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
