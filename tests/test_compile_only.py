"""``--config.compile_only=True``: a train step compiled from shapes (jpipe.train.compile_only).

Tiny models on the 8 fake CPU devices of conftest.py: the step compiles in
seconds under both lowerings, prints its JSON line last with one entry per
device (SPMD) or per rank (per rank), reads no data and writes no work
directory; a device memory too small exits non-zero with one line; and
configs/llama3_8b.py shrunk to a tiny width compiles only and trains with
its options (bfloat16, blockwise attention, full remat, the logits
recomputed, BPE tokens) on.
"""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jpipe import train as trainer
from jpipe.train import compile_only
from jpipe.train import data as data_lib
from jpipe.train.config import config_from_file, device_memory_bytes

ROOT = Path(__file__).resolve().parents[1]


def _set(config, overrides: dict):
    for key, value in overrides.items():
        node = config
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return config


def tiny(**overrides):
    """configs/default.py, a 4-block GPT of width 32 on pipe 2 x data 2."""
    config = config_from_file(ROOT / "configs" / "default.py")
    return _set(
        config,
        {
            "steps": 2,
            "batch_size": 8,
            "num_microbatches": 4,
            "mesh.pipe": 2,
            "model.seq_len": 16,
            "model.num_layers": 4,
            "model.num_heads": 2,
            "model.d_model": 32,
            "model.d_ff": 64,
            **overrides,
        },
    )


def llama3_8b_shrunk(**overrides):
    """configs/llama3_8b.py at a tiny width and length, its options as they are."""
    config = config_from_file(ROOT / "configs" / "llama3_8b.py")
    return _set(
        config,
        {
            "steps": 2,
            "eval_every": 2,
            "eval_batches": 1,
            "checkpoint_every": 2,
            "num_microbatches": 4,  # 16 makes the program 4 times as long to compile
            "batch_size": 4,
            "data.max_bytes": 128 * 1024,
            "model.vocab_size": 384,  # BPE tokens, trained on the 128 KiB
            "model.seq_len": 64,
            "model.attention_block": 16,
            "model.num_layers": 4,
            "model.num_heads": 4,
            "model.num_kv_heads": 2,
            "model.d_model": 64,
            "model.d_ff": 128,
            **overrides,
        },
    )


def _run(config, monkeypatch, tmp_path):
    """`compile_only.run` in an empty directory with the corpus unreadable: (rc, stdout, log)."""

    def no_corpus(*args, **kwargs):
        raise AssertionError("compile-only read the corpus")

    monkeypatch.setattr(data_lib, "read_corpus", no_corpus)
    monkeypatch.chdir(tmp_path)
    out, log = io.StringIO(), []
    rc = compile_only.run(config, out=out, log=log.append)
    assert os.listdir(tmp_path) == []  # no runs/, no checkpoint
    return rc, out.getvalue(), log


@pytest.mark.slow
@pytest.mark.parametrize("lowering", ["spmd", "mpmd"])
def test_compile_only_both_lowerings(lowering, monkeypatch, tmp_path):
    rc, out, log = _run(tiny(lowering=lowering), monkeypatch, tmp_path)
    assert rc == 0
    lines = out.strip().splitlines()
    report = json.loads(lines[-1])  # the last line of stdout is the JSON object
    assert report["lowering"] == lowering
    assert report["fits"] is True
    assert report["device_memory_bytes"] == 80e9
    assert report["compile_seconds"] > 0
    rows = report["devices"]
    if lowering == "spmd":  # one row per device: 2 ranks x 2 data replicas
        assert [r["rank"] for r in rows] == [0, 0, 1, 1]
        assert len({r["device"] for r in rows}) == 4
        assert report["rank_compile_seconds"] is None  # one program
    else:  # one row per rank, its two devices named together
        assert [r["rank"] for r in rows] == [0, 1]
        assert all(len(r["device"].split(",")) == 2 for r in rows)
        # each rank's own pieces, timed: together within the step's whole compile
        per_rank = report["rank_compile_seconds"]
        assert len(per_rank) == 2 and all(t > 0 for t in per_rank)
        assert sum(per_rank) <= report["compile_seconds"]
        assert "'s pieces" in lines[-2] and "what a process a rank compiles" in lines[-2]
    for r in rows:
        assert r["arguments_bytes"] > 0 and r["temp_bytes"] > 0
        assert r["total_bytes"] >= r["arguments_bytes"] + r["temp_bytes"]
        # jpipe's byte model for the lowering, from the same shapes: near what compiled.
        assert r["predicted_bytes"] > 0
        assert 0.25 < r["predicted_bytes"] / r["total_bytes"] < 4
    assert report["peak_bytes"] == max(r["total_bytes"] for r in rows)
    assert "device_bytes" in report["predicted_by"]
    assert any("compiling" in line for line in log)  # progress before the compile
    assert "fits" in lines[-2]  # the table's last line


@pytest.mark.slow
def test_per_rank_prediction_follows_each_pieces_working_memory():
    """ZB-H1 per rank, where a rank's largest piece (an I) does not run at its peak of
    values (the deferred Ws' carries): jpipe's byte model, adding at each piece the values
    held when it starts to that piece's own working memory, is within 1% of every rank's
    account (it leaves out only the batch; each rank on a mesh of its own holds no padding
    rows of other ranks' buckets)."""
    report = compile_only.compile_only(
        tiny(lowering="mpmd", schedule="zb_h1"), log=lambda line: None
    )
    for row in report.devices:
        assert row.predicted_bytes == pytest.approx(row.total_bytes, rel=0.01), row


@pytest.mark.slow
def test_ranks_of_their_own_tensor_degrees(monkeypatch, tmp_path):
    """A mesh per rank (``mesh.tensor_per_rank``): each rank's own shapes and update program."""
    config = tiny(
        lowering="mpmd", **{"mesh.data": 1, "mesh.tensor": 2, "mesh.tensor_per_rank": "1,2"}
    )
    rc, out, _ = _run(config, monkeypatch, tmp_path)
    assert rc == 0
    rows = json.loads(out.strip().splitlines()[-1])["devices"]
    assert [(r["rank"], r["device"]) for r in rows] == [(0, "cpu:0"), (1, "cpu:1,cpu:2")]
    # Rank 1 splits its blocks over 2 devices: fewer bytes of parameters a device.
    assert 0 < rows[1]["arguments_bytes"] < rows[0]["arguments_bytes"]
    assert all(r["predicted_bytes"] > 0 for r in rows)


@pytest.mark.slow
def test_too_little_memory_exits_nonzero(tmp_path):
    """Through train.py: exit 1, the JSON still last on stdout, one line naming the device."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # as conftest's, faster compiles
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        f"--workdir={tmp_path / 'run'}",
        "--config.compile_only=True",
        "--config.compile_only_device_memory=1KB",
        "--config.mesh.pipe=2",
        "--config.mesh.data=1",
        "--config.num_microbatches=2",
        "--config.batch_size=4",
        "--config.model.seq_len=16",
        "--config.model.num_layers=2",
        "--config.model.d_model=32",
        "--config.model.d_ff=64",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["fits"] is False and report["device_memory_bytes"] == 1e3
    assert len(report["devices"]) == 2  # the 2 devices train.py faked for pipe 2
    worst = max(report["devices"], key=lambda r: r["total_bytes"])
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: device {worst['device']} (rank {worst['rank']}) needs ")
    assert f"{worst['total_bytes']:,} bytes" in last and "1KB" in last
    assert not (tmp_path / "run").exists()

    bad = subprocess.run(
        command[:4] + ["--config.compile_only_device_memory=H200-141"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: config.compile_only_device_memory='H200-141': ")
    assert "A100-80" in bad.stderr


def test_device_memory_field():
    assert device_memory_bytes("80GB") == (80e9, "80GB")
    assert device_memory_bytes("72GiB")[0] == 72 * 2**30
    assert device_memory_bytes(8e10) == (8e10, "8e+10 bytes")
    assert device_memory_bytes("A100-80") == (80 * 2**30, "A100-80")  # jpipe's planner's kinds
    for bad in ("H200-141", "lots", 0, -1.0, True):
        with pytest.raises(trainer.ConfigError, match="config.compile_only_device_memory="):
            device_memory_bytes(bad)
    assert trainer.TrainConfig.from_config(tiny()).compile_only_device_memory == "80GB"


@pytest.mark.slow
def test_llama3_8b_shrunk_compiles_only_and_trains(monkeypatch, tmp_path):
    config = llama3_8b_shrunk()
    model = config.model
    assert (model.attention, model.remat, model.remat_logits, model.dtype) == (
        "blockwise",
        "full",
        True,
        "bfloat16",
    )
    assert (config.mesh.pipe, config.mesh.tensor, config.schedule) == (4, 2, "1f1b")
    assert config_from_file(ROOT / "configs" / "llama3_8b.py").num_microbatches == 16
    (tmp_path / "compile").mkdir()
    config.compile_only_predict = False  # the tiny tests check the prediction; it takes long
    rc, out, log = _run(config, monkeypatch, tmp_path / "compile")
    assert rc == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert len(report["devices"]) == 8 and report["fits"]
    assert all(r["predicted_bytes"] is None for r in report["devices"])
    assert report["predicted_by"] is None
    assert "compile-only: no prediction (config.compile_only_predict=False)" in log
    monkeypatch.undo()  # the corpus readable again: now train
    result = trainer.train(llama3_8b_shrunk(), str(tmp_path / "run"), progress=False)
    assert sorted(result.losses) == [1, 2]
    assert all(0 < loss < 10 for loss in result.losses.values())


def test_llama3_70b_config_is_its_sizes():
    config = trainer.TrainConfig.from_config(config_from_file(ROOT / "configs" / "llama3_70b.py"))
    m = config.model
    assert (m.num_layers, m.d_model, m.d_ff, m.num_heads, m.num_kv_heads) == (
        80,
        8192,
        28672,
        64,
        8,
    )
    assert (m.vocab_size, m.seq_len, m.attention, m.remat) == (128256, 8192, "blockwise", "full")
    assert (config.mesh.pipe, config.mesh.tensor, config.mesh.size) == (8, 8, 64)
    assert (config.schedule, config.num_microbatches) == ("1f1b", 32)
