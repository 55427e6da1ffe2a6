"""``python -m bench.gpu``: every row of its table, on fake CPU devices.

No timing is asserted (the machine is shared): the table must hold the plain
row and every lowering for every schedule, each with positive times and the
plain model's loss, the command-buffer rows skipped as on any CPU, MFU ``n/a``
(no peak for a CPU) and the per-rank rows' host operations.
"""

import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `bench` lives beside `jpipe`, not in the installed package

from bench import gpu  # noqa: E402

SCHEDULES = ("1f1b", "zb_h1")
EXPECTED = {("plain", None)} | {
    (variant, s) for variant in ("spmd", "spmd+cmdbuf", "mpmd") for s in SCHEDULES
}


@pytest.mark.slow
def test_bench_gpu_tiny_has_every_row(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    # Four fake devices; the optimization flags only make CPU compiles quicker.
    env["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=4 "
        "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--size", "tiny", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    meta = result["meta"]
    assert (meta["platform"], meta["num_devices"], meta["pipe"], meta["data"]) == ("cpu", 4, 4, 1)
    assert meta["peak_bf16_flops"] is None
    assert meta["model_flops"] > 0 and meta["xla_flops_plain"] > 0

    rows = {(r["variant"], r["schedule"]): r for r in result["rows"]}
    assert set(rows) == EXPECTED and len(result["rows"]) == len(EXPECTED)
    plain_loss = rows[("plain", None)]["loss"]
    for (variant, schedule), row in rows.items():
        assert row["mfu"] is None, (variant, schedule)
        if variant == "spmd+cmdbuf":
            assert row["status"] == "skipped: not a GPU"
            assert "step_seconds" not in row
            continue
        assert row["status"] == "ok", (variant, schedule, row["status"])
        assert len(row["times"]) == meta["reps"] and min(row["times"]) > 0
        assert row["step_seconds"] > 0 and 0 < row["best_seconds"] <= row["step_seconds"]
        assert row["compile_seconds"] > 0
        assert abs(row["loss"] - plain_loss) <= 1e-2 * abs(plain_loss)  # bf16 compute
        if variant != "plain":
            assert row["mesh"] == "pipe=4 x data=1" and row["devices"] == 4
        if variant == "mpmd":
            assert row["host_ops"] > 0 and row["issue_seconds"] > 0

    table = proc.stdout
    lines = table.splitlines()
    for variant, schedule in EXPECTED:
        head = f"| {variant} | {schedule or '-'} |"
        line = next((ln for ln in lines if ln.startswith(head)), None)
        assert line is not None, (variant, schedule, table)
        assert "| n/a |" in line
        if variant == "spmd+cmdbuf":
            assert line.rstrip().endswith("| skipped: not a GPU |")
    assert "peak bf16 n/a (cpu)" in table


Device = namedtuple("Device", "device_kind")


@pytest.mark.parametrize(
    "count,want",
    [(1, (1, 1)), (2, (2, 1)), (3, (3, 1)), (4, (4, 1)), (6, (4, 1)), (8, (4, 2)), (16, (4, 4))],
)
def test_layout_from_the_devices(count, want):
    pipe, data, note = gpu.layout([Device("NVIDIA H200")] * count, None, None)
    assert (pipe, data) == want
    if count == 1:
        assert "pipe=1" in note and "not pipelining" in note


@pytest.mark.parametrize(
    "kind,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("cpu", None),
        ("Some Future Chip", None),
    ],
)
def test_peak_by_device_kind(kind, peak):
    assert gpu.peak_flops(kind) == peak
