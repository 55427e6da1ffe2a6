"""The benchmark: its peer is exact, and ``python -m bench --quick`` gives a sane table.

No timing is asserted: the machine is shared. What is checked is that every
row ran and computed the same loss, that every figure is a positive number,
that jpipe has a row for every schedule, and that memory behaves as the
schedules promise (GPipe's grows with the microbatches, 1F1B's much less).
"""

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jpipe
from jpipe.train.config import config_from_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `bench` lives beside `jpipe`, not in the installed package

from bench.baselines import lockstep, spmd_pipeline  # noqa: E402
from bench.workloads import get_workload  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zbv")  # the quick bench's: growing, flat, and two chunks


@pytest.mark.slow
@pytest.mark.parametrize("num_microbatches,repeats", [(4, 1), (6, 1), (5, 2)])
def test_peer_matches_the_unpipelined_model(num_microbatches, repeats):
    """The vmap-style GPipe baseline computes the model's loss and every gradient."""
    workload = get_workload("tiny-dense")
    R = 4
    stage_fns, params = workload.stages(R * repeats)
    batch = workload.batch(num_microbatches)
    want_loss, want_grads = jax.jit(
        jax.value_and_grad(lambda p, b: jpipe.run_stages(stage_fns, p, b))
    )(params, batch)

    peer = spmd_pipeline(workload, num_microbatches, jax.devices()[:R], repeats=repeats)
    loss, grads = peer.lowerable(*peer.args)

    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for piece, want in enumerate(want_grads):
        r, s = divmod(piece, R)
        got = jax.tree.map(lambda a, r=r, s=s: np.asarray(a)[r, s], grads["blocks"])
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6), got, want)


@pytest.mark.slow
@pytest.mark.parametrize("variant", lockstep.VARIANTS)
def test_lockstep_diagnostics_do_the_pipelines_work(variant):
    """The diagnostic rows really compute each device's stage gradients.

    Each device runs a middle stage's F, I and W pieces for every microbatch,
    the I's cotangent being the F's own output; the accumulated weight
    gradients must be those of `jax.vjp` of the stage, so no piece was skipped.
    """
    workload = get_workload("tiny-dense")
    R, M = 4, 3
    stage_fns, params = workload.stages(R)
    data = lockstep.microbatch_inputs(workload, (stage_fns, params), M, R)
    program = lockstep.stage_pieces(workload, M, jax.devices()[:R], variant)
    grads, _ = program.lowerable(*program.args)
    for r in range(R):
        want = None
        for m in range(M):
            x = jax.tree.map(lambda a, r=r, m=m: a[r, m], data["x"])
            inputs = jax.tree.map(lambda a, r=r, m=m: a[r, m], data["inputs"])
            y, vjp = jax.vjp(lambda p, x=x, i=inputs: stage_fns[1](p, x, i), params[1])
            (g,) = vjp(y)
            want = g if want is None else jax.tree.map(np.add, want, g)
        got = jax.tree.map(lambda a, r=r: np.asarray(a)[r], grads)
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6), got, want)


@pytest.mark.slow
def test_quick_bench_writes_a_sane_table(tmp_path):
    """``python -m bench --quick`` (smallest model) writes JSON, Markdown and a plot.

    Three schedules, one timed repetition: the test checks the table's
    shape and the memory's growth, not the times.
    """
    out = tmp_path / "bench"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)  # the bench fakes its own devices
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            "--model",
            "tiny-dense",
            "--schedules",
            ",".join(SCHEDULES),
            "--reps",
            "1",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("bench.json", "bench.md", "bench.png"):
        assert (out / name).stat().st_size > 0, name

    result = json.loads((out / "bench.json").read_text())
    rows = result["rows"]
    Ms = sorted({r["microbatches"] for r in rows})
    assert len(Ms) >= 2, "quick mode compares at least two microbatch counts"

    for r in rows:
        where = f"M={r['microbatches']} {r['name']}"
        assert "error" not in r, f"{where}: {r.get('error')}"
        for key in (
            "compile_seconds",
            "step_seconds",
            "argument_bytes",
            "temp_bytes",
            "vs_one_device",
        ):
            assert r[key] > 0, f"{where}: {key} = {r[key]}"
        assert r["loss_rel_err"] < 1e-4, f"{where} computes a different loss"
        if r["kind"] == "jpipe":
            for key in ("predicted_overlap_seconds", "predicted_lockstep_seconds", "work_seconds"):
                assert r[key] > 0, f"{where}: {key} = {r[key]}"

    names = {(r["microbatches"], r["name"]) for r in rows}
    for M in Ms:
        assert (M, "one device") in names and (M, "data parallel") in names
        assert (M, "peer gpipe") in names
        for schedule in SCHEDULES:
            assert any(n == M and name.startswith(f"jpipe {schedule}") for n, name in names), (
                f"no jpipe {schedule} row at M={M}"
            )

    def temp(schedule, M):
        (r,) = [r for r in rows if r["microbatches"] == M and r["name"] == f"jpipe {schedule}"]
        return r["temp_bytes"]

    small, large = Ms[0], Ms[-1]
    gpipe_growth = temp("gpipe", large) - temp("gpipe", small)
    one_f_one_b_growth = temp("1f1b", large) - temp("1f1b", small)
    assert temp("gpipe", large) > 1.5 * temp("gpipe", small), "GPipe's memory should grow with M"
    assert gpipe_growth > 2 * one_f_one_b_growth, (
        f"1F1B's temp memory grew by {one_f_one_b_growth} bytes from M={small} to M={large}, "
        f"GPipe's by {gpipe_growth}: 1F1B should stay much flatter"
    )

    table = (out / "bench.md").read_text()
    assert "| jpipe 1f1b |" in table and "| peer gpipe |" in table


@pytest.mark.slow
def test_memory_suite_row_on_a_small_gpt():
    """`python -m bench --suite memory` compiles from shapes; its row on a tiny GPT is sane."""
    from bench import memory

    config = jpipe.models.GPTConfig(
        vocab_size=300, seq_len=16, num_layers=4, num_heads=2, d_model=32, d_ff=64
    )
    one = memory.row(4, "1f1b", 1, 8, config)
    zb = memory.row(4, "zb_h1", 1, 8, config)
    for rec in (one, zb):
        assert rec["temp_bytes"] > 0 and rec["argument_bytes"] > 0
        assert len(rec["need_per_rank"]) == 4 and rec["need_bytes"] == max(rec["need_per_rank"])
        assert rec["own_param_bytes"] <= rec["param_bytes"]
    # 1F1B's first rank holds the most residuals; ZB-H1 adds carries on top.
    assert one["need_per_rank"][0] > one["need_per_rank"][2]
    assert zb["need_bytes"] >= one["need_bytes"]
    # A piece's compiled working memory holds at least its new residuals.
    assert one["need_bytes"] > one["need_2act_bytes"]
    from bench import report

    table = report.memory_markdown([one, zb]).splitlines()
    assert len(table) == 4 and "| 4 | 4 | zb_h1 | 8 | kept |" in table[3]
    sliced = memory.row(4, "zb_h1", 1, 8, dataclasses.replace(config, logit_chunks=4))
    assert sliced["temp_bytes"] < zb["temp_bytes"]  # one slice's logits at a time
    assert "| 4 | 4 | zb_h1 | 8 | 4 slices |" in report.memory_markdown([sliced])


@pytest.mark.slow
def test_mesh_memory_splits_what_each_axis_promises():
    """`python -m bench.mesh_memory --quick`'s rows: fsdp halves every array, tensor the blocks'.

    The bytes of every mesh come from the shardings alone (nothing compiled);
    one mesh, the 8-GPU config's pipe 2 x fsdp 2 x tensor 2, is compiled.
    """
    from bench import mesh_memory

    config = mesh_memory.QUICK
    meshes = mesh_memory.MESHES + ((2, 1, 2),)
    rows = {
        (r["pipe"], r["fsdp"], r["tensor"]): r
        for r in mesh_memory.run(quick=True, log=lambda *a: None, meshes=meshes, compile=False)
    }
    D, F = config.d_model, config.d_ff
    # Per block: what tensor splits (qkv and MLP-in by columns with their
    # biases, attention-out and MLP-out by rows) and what stays whole
    # (LayerNorms, the biases added after a row split).
    split = 3 * D * D + 3 * D + D * D + D * F + F + F * D
    whole = 6 * D
    pipe_only = rows[(8, 1, 1)]
    total = 4 * (
        config.num_layers * (split + whole)
        + 2 * config.vocab_size * D  # token embedding, head
        + config.seq_len * D  # positions
        + 2 * D  # the final LayerNorm
    )
    assert sum(pipe_only["own_per_rank"]) == total  # every array once, float32

    for pipe, tensor in ((4, 1), (2, 2)):
        halves, wholes = rows[(pipe, 2, tensor)], rows[(pipe, 1, tensor)]
        # fsdp 2 splits every array of these sizes (all even) in two, except
        # the column-split biases under tensor: their one dimension is
        # tensor's, so fsdp finds no free one and leaves them whole.
        kept = (3 * D + F) // tensor if tensor > 1 else 0
        assert halves["own_per_rank"] == [
            b // 2 + blocks * 4 * kept // 2
            for b, blocks in zip(wholes["own_per_rank"], wholes["layers_per_stage"])
        ]
        if tensor == 1:
            assert halves["param_bytes"] * 2 == wholes["param_bytes"]
        # Adam's two moments are laid out like the parameters (plus scalar counts).
        for r in (halves, wholes):
            assert 2 * r["param_bytes"] <= r["opt_bytes"] <= 2 * r["param_bytes"] + 64

    # Tensor 2 halves the blocks' split matrices and nothing else: not the
    # embeddings, the head, LayerNorms or the biases after a row split.
    split4, whole4 = rows[(4, 1, 2)], rows[(4, 1, 1)]
    for r, blocks in enumerate(whole4["layers_per_stage"]):
        saved = whole4["own_per_rank"][r] - split4["own_per_rank"][r]
        assert saved == blocks * 4 * split // 2, r

    # The config's mesh, compiled (one block per stage, to be quick): its
    # arguments are the state and one device's rows of the batch.
    small = dataclasses.replace(config, num_layers=2)
    rec = mesh_memory.row(2, 2, 2, small, mesh_memory.load_config().optimizer, 2)
    held = rec["param_bytes"] + rec["opt_bytes"]
    batch = 2 * (rec["batch_rows"] // 2) * config.seq_len * 4  # tokens, targets: int32, fsdp 2
    assert held <= rec["argument_bytes"] <= held + batch + 64
    assert rec["temp_bytes"] > 0 and len(rec["need_per_rank"]) == 2
    worst = rec["need_per_rank"].index(rec["need_bytes"])
    assert rec["need_rank_param_bytes"] == rec["own_per_rank"][worst]
    # The need holds the rank's gradient accumulator (as big as its own parameters) and more.
    assert rec["need_bytes"] > rec["need_rank_param_bytes"]
    table = mesh_memory.markdown([rec]).splitlines()
    assert len(table) == 3 and table[2].startswith("| pipe 2 x fsdp 2 x tensor 2 | 1,1 |")


def test_the_8_gpu_config_prepares_with_the_parameters_it_states():
    """``configs/gpt_1b_8gpu.py`` (the bench's model) passes `prepare` on 8 devices."""
    from bench import mesh_memory
    from jpipe.train.prepare import prepare

    config = config_from_file(mesh_memory.CONFIG_FILE)
    config.data.max_bytes = 4 * 2**20  # enough for one eval batch; the run reads the whole corpus
    prepared = prepare(config, jax.devices()[:8])
    assert dict(prepared.mesh.shape) == {"pipe": 2, "data": 1, "fsdp": 2, "tensor": 2}
    assert prepared.layers_per_stage == (12, 12)
    model = jpipe.models.make_stages(prepared.config.model, prepared.layers_per_stage)
    count = jpipe.models.gpt.num_params(jax.eval_shape(model.init, jax.random.key(0)))
    doc = ast.get_docstring(ast.parse(Path(mesh_memory.CONFIG_FILE).read_text()))
    assert count == 1_416_552_448 and f"{count:,}" in doc


def test_ab_compares_programs_not_their_instruction_names():
    from bench.ab import instructions

    def program(names, op="add"):
        a, b, c = names
        return (
            f"ENTRY %main.{a} (p: f32[2]) -> f32[2] {{\n"
            f'  %p.{b} = f32[2]{{0}} parameter(0), metadata={{op_name="x"}}\n'
            f"  ROOT %{op}.{c} = f32[2]{{0}} {op}(%p.{b}, %p.{b})\n}}"
        )

    assert instructions(program((1, 2, 3))) == instructions(program((7, 9, 11)))
    assert instructions(program((1, 2, 3))) != instructions(program((1, 2, 3), "multiply"))
