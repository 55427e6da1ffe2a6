"""``python -m bench.gpu``: every row of its tables, on fake CPU devices.

No timing is asserted (the machine is shared): the GPT table must hold the
plain row and every lowering for every schedule, each with positive times and
the plain model's loss, the command-buffer rows skipped as on any CPU, MFU
``n/a`` (no peak for a CPU) and the per-rank rows' host operations; the
attention table, the xla and blockwise rows timed and within bf16 rounding
of each other, the cudnn row skipped as on any CPU.
"""

import json
import math
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import jax
import jax.numpy as jnp
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

    # The attention table follows, at the tiny size's CPU length (its rows are
    # checked in test_attention_rows_on_cpu).
    attention = result["attention"]
    assert (attention["meta"]["platform"], attention["meta"]["lengths"]) == ("cpu", [64])
    got = [(r["implementation"], r["seq_len"], r["status"]) for r in attention["rows"]]
    assert got == [("xla", 64, "ok"), ("blockwise", 64, "ok"), ("cudnn", 64, "skipped: not a GPU")]
    assert "| cudnn | 64 | cpu |" in table


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


def test_attention_names_jpipe_s_implementations():
    from jpipe.models import attention

    assert gpu.ATTENTION_IMPLEMENTATIONS == attention.IMPLEMENTATIONS


def _bf16_spacing(magnitude: float) -> float:
    """The gap between neighbouring bf16 numbers at `magnitude` (8 significant bits)."""
    return float(jnp.finfo(jnp.bfloat16).eps) * 2.0 ** math.floor(math.log2(magnitude))


def test_attention_rows_on_cpu():
    """The attention table on this CPU, at L=64 with 4 tiles: what a GPU-less run prints."""
    rows = list(gpu.attention_rows((64,), 16, reps=2, warmup=1))
    assert [r["implementation"] for r in rows] == ["xla", "blockwise", "cudnn"]
    xla, blockwise, cudnn = rows
    assert cudnn["status"] == "skipped: not a GPU" and "step_seconds" not in cudnn
    for row in (xla, blockwise):
        assert row["status"] == "ok", row["status"]
        assert (row["platform"], row["seq_len"]) == ("cpu", 64)
        assert len(row["times"]) == 2 and 0 < row["best_seconds"] <= row["step_seconds"]
        assert row["temp_bytes"] > 0 and row["tflops"] > 0
    assert blockwise["block"] == 16 and xla["block"] is None
    # Both compute in float32 from the same bf16 inputs and round each result
    # to bf16 once; xla also rounds the probabilities (and, in the backward,
    # dO V^T) to bf16 before the next product, where blockwise keeps float32.
    # Against a float64 reference each lands within one bf16 spacing of the
    # tensor's largest value (measured at L = 64 to 512: out 0.013 and 0.008
    # where the spacing is 0.016), so the two can be two spacings apart; they
    # are one apart (out 0.016 of 2.9, dk 0.031 of 5.0). A wrong mask, scale
    # or tile walk is off by the values themselves.
    diff, magnitude = blockwise["diff_vs_xla"], xla["abs_max"]
    assert set(diff) == set(magnitude) == {"out", "dq", "dk", "dv"}
    for name in diff:
        assert diff[name] <= 2 * _bf16_spacing(magnitude[name]), (name, diff, magnitude)

    section = {
        "meta": {
            **gpu.ATTENTION_SHAPE,
            "dtype": gpu.ATTENTION_DTYPE,
            "lengths": [64],
            "gpu_lengths": [256],
            "reps": 2,
            "warmup": 1,
            "platform": "cpu",
            "device_kind": "cpu",
            "jax": jax.__version__,
        },
        "rows": rows,
    }
    lines = gpu.attention_table(section).splitlines()
    assert "not a GPU: L=64 rather than a GPU's 256" in lines[1]
    assert lines[-3].startswith("| xla | 64 | cpu |") and "| ref, max " in lines[-3]
    assert lines[-2].startswith("| blockwise (tile 16) | 64 | cpu |")
    assert lines[-1].startswith("| cudnn | 64 | cpu |")
    assert lines[-1].endswith("| skipped: not a GPU |")
