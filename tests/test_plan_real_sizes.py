"""The cluster planner at real sizes: attention and remat in its memory model,
Llama-3-8B on 16 A100-40s, and the one error that says why nothing fits.

Real planner runs on the published Sailor profiles (pure Python, no mocks).
"""

import dataclasses
import json
import re

import pytest

from jpipe.planner import load_sailor_profile, memory_footprint, plan, plan_file, read_plan_file
from jpipe.planner.choices import (
    ATTENTION,
    REMAT,
    SAILOR_SHAPES,
    MemoryChoice,
    choices_to_try,
    with_choice,
)
from jpipe.planner.cli import main
from jpipe.planner.plans import GIB, NoPlanFits
from jpipe.planner.profiles import profile_from_json, profile_to_json

LLAMA = ["--model", "LLAMA-3-8", "--global-batch", "256"]


@pytest.fixture(scope="module")
def llama():
    return load_sailor_profile("LLAMA-3-8")


def test_the_choices_are_the_models():
    """The planner names the options `jpipe.models.attention` has (without importing JAX)."""
    from jpipe.models.attention import IMPLEMENTATIONS, REMAT_POLICIES

    assert ATTENTION == IMPLEMENTATIONS and REMAT == REMAT_POLICIES


@pytest.mark.parametrize("model", sorted(SAILOR_SHAPES))
def test_sailor_blocks_hold_one_fp32_copy_of_the_scores(model):
    """What the model rests on: every block's measured bytes at every T are the same rest
    plus heads / T x L x L fp32 probabilities, and the rest shrinks with T as a sharded
    part and a replicated one would (R(T) = R_rep + R_sharded / T)."""
    prof = load_sailor_profile(model)
    shape = prof.shape
    s, h, a = shape.sequence_length, shape.hidden, shape.heads
    rest = {}
    for t, row in prof.activation_bytes.items():
        blocks = [row[l] for l in shape.block_layers]
        assert max(blocks) / min(blocks) < 1.01, "the blocks of a Sailor profile keep alike"
        rest[t] = (max(blocks) - 4 * a * s * s / t) / (4 * s * h)  # in s x h floats
        assert rest[t] > 1
    ts = sorted(rest)
    for t0, t1 in zip(ts, ts[1:]):
        assert rest[t1] < rest[t0]
    if model == "LLAMA-3-8":
        assert rest == pytest.approx({1: 28.0, 2: 18.0, 4: 13.0}, abs=1e-3)


def test_block_bytes_under_each_choice(llama):
    """Llama at T = 1, one sequence of 8,192 tokens: measured 92 s h floats (64 of them
    the scores); blockwise drops the scores; full keeps the input and holds one block
    while it re-runs; dots keeps the projections' outputs."""
    sh = 4 * 8192 * 4096  # one s x h fp32 tensor: 128 MiB
    lse = 4 * 32 * 8192
    layer = 5
    measured = llama.activation_bytes[1][layer]
    assert measured == pytest.approx(92 * sh, rel=1e-4)
    rest = measured - 64 * sh  # the measured rest, 28 s h floats
    got = {}
    for choice in (MemoryChoice(a, r) for a in ("xla", "blockwise") for r in REMAT):
        p = with_choice(llama, choice)
        got[choice.attention, choice.remat] = (
            p.activations(1, 1)[layer],
            p.recomputes(1, 1)[layer],
        )
        assert p.activations(1, 1)[0] == llama.activations(1, 1)[0]  # the embedding as is
    assert got["xla", "none"] == (measured, 0.0)
    assert got["blockwise", "none"] == pytest.approx((rest + lse, 0.0))
    assert got["blockwise", "full"] == pytest.approx((sh, rest + lse))
    assert got["xla", "full"] == pytest.approx((sh, measured))
    assert got["blockwise", "attention"] == pytest.approx((2 * sh, rest + lse))
    # input 1 + queries, keys, values 3 + output projection 1 + SwiGLU's two halves 8 + MLP out 1
    assert got["blockwise", "dots"] == pytest.approx((14 * sh, rest + lse))


def test_remat_costs_a_recomputation_in_the_backward(llama):
    full = with_choice(llama, MemoryChoice("blockwise", "full"))
    dots = with_choice(llama, MemoryChoice("blockwise", "dots"))
    flash = with_choice(llama, MemoryChoice("blockwise", "none"))
    t0, tf, td = (p.layer_times("A100-40", 1, 4) for p in (llama, full, dots))
    assert flash.layer_times("A100-40", 1, 4) == t0  # a flash-style kernel: same time
    layer, head = 5, llama.num_layers - 1
    assert tf.backward[layer] == pytest.approx(t0.backward[layer] + t0.forward[layer])
    assert tf.backward[head] == t0.backward[head]  # the head is not a block
    extra = td.backward[layer] - t0.backward[layer]
    assert 0 < extra < 0.3 * t0.forward[layer]  # the attention's inner products only


def test_the_search_tries_the_measured_choice_first(llama):
    assert choices_to_try(llama) == [
        MemoryChoice("xla", "none"),
        MemoryChoice("blockwise", "none"),
        MemoryChoice("blockwise", "dots"),
        MemoryChoice("blockwise", "full"),
    ]
    assert choices_to_try(llama, remat="full") == [MemoryChoice("blockwise", "full")]
    assert choices_to_try(llama, "xla", "auto")[-1] == MemoryChoice("xla", "full")
    assert with_choice(llama, MemoryChoice("xla", "none")) is llama
    with pytest.raises(ValueError, match="--attention"):
        choices_to_try(llama, "flash")


def test_a_model_that_fits_as_measured_gets_the_plans_it_always_got():
    """The default search (auto) and the measured choice give the same plans."""
    opt = load_sailor_profile("OPT-350")
    devices = [("A100-40", 4), ("V100-16", 4)]
    auto = plan(opt, devices, 256, top=2)
    fixed = plan(opt, devices, 256, top=2, attention="xla", remat="none")
    assert auto.memory_choice == MemoryChoice("xla", "none") and auto.tried == ()
    assert [c.evaluation.step_seconds for c in auto.best] == [
        c.evaluation.step_seconds for c in fixed.best
    ]
    assert auto.profile is opt


def test_llama_3_8b_on_16_a100_40_gets_a_plan(llama):
    """As measured (scores materialized, nothing rematerialized) nothing fits; the search
    finds the cheapest choice that does. Sailor's runtime keeps 24 bytes a parameter
    (fp32 weights, gradients, Adam's moments, two buffers): 8.8e9 x 24 = 197 GiB over
    pipe x tensor = 16 devices, about 12.3 GiB each."""
    result = plan(llama, [("A100-40", 16)], 256, top=1)
    ev = result.best[0].evaluation
    assert result.memory_choice != MemoryChoice("xla", "none")
    assert MemoryChoice("xla", "none") in result.tried
    assert ev.plan.pipe * ev.plan.tensor_parallel == 16
    total = sum(n * 1 for n in llama.params_per_gpu(1)) * 24
    assert total / GIB == pytest.approx(197, rel=0.02)
    assert ev.memory.fits("spmd", 0.10)
    m = ev.memory.binding("spmd", 0.10)
    assert 11 * GIB < m.parts["parameters"] < 16 * GIB
    assert m.footprint_bytes <= 40 * GIB * 0.9
    # the plan file names the options the memory assumes, and reads back
    pf = plan_file(ev, result.profile)
    assert pf["model_options"] == result.memory_choice.to_json()
    assert read_plan_file(pf).pipe == ev.plan.pipe


def test_cli_prints_the_choice_a_plan_uses(capsys):
    assert main([*LLAMA, "--devices", "A100-40:16", "--top", "1"]) == 0
    text = capsys.readouterr().out
    assert "model options: blockwise attention, dots remat" in text
    assert "nothing fits with xla attention, no remat" in text
    assert main([*LLAMA, "--devices", "A100-40:16", "--top", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_options"] == {"attention": "blockwise", "remat": "dots"}
    assert {"attention": "xla", "remat": "none"} in out["model_options_tried"]


def test_no_plan_fits_names_the_binding_device_once(llama):
    """Four A100-40s cannot hold Llama's parameters: one error, the closest shape's
    binding device with what it needs and has, the sequence length and B."""
    with pytest.raises(NoPlanFits) as caught:
        plan(llama, [("A100-40", 4)], 256)
    e = caught.value
    text = str(e)
    assert text.count("no plan fits") == 1 and text.count("no split of") <= 1
    m = e.miss
    assert m.device.kind == "A100-40" and m.needed_bytes > m.available_bytes
    assert m.available_bytes == pytest.approx(40 * GIB * 0.9)
    assert e.sequence_length == 8192 and m.plan.microbatch_size == 1
    for part in (
        f"needs {m.needed_bytes / GIB:.3g} GiB on the A100-40 of rank {m.device.rank}",
        "which has 40 GiB, 36 GiB of it usable",
        "sequences of 8192 tokens, 1 sequence a microbatch here",
        "with blockwise attention, full remat",
        "tried, attention/remat: xla/none, blockwise/none, blockwise/dots, blockwise/full",
    ):
        assert part in text, (part, text)
    assert "\n" not in text


def test_where_only_the_per_rank_layout_fits_the_error_names_its_plan(llama):
    """At 21.5 GB an A100-40 cannot hold the SPMD program's fullest device (every device
    holds the largest rank's terms: the first rank's embedding beside the last one's
    head share), but the per-rank lowering's devices each hold their own rank's: the
    error says so, with that plan's shape, bytes and time, which the per-rank plan
    itself gives."""
    small = dataclasses.replace(llama, memory=dict(llama.memory) | {"A100-40": 21.5e9})
    small = dataclasses.replace(small, derived=set(), _links={})
    with pytest.raises(NoPlanFits) as caught:
        plan(small, [("A100-40", 16)], 256, top=1)
    e = caught.value
    own = plan(small, [("A100-40", 16)], 256, top=1, memory_layout="mpmd").best[0].evaluation
    assert e.per_rank is not None and e.per_rank.step_seconds == own.step_seconds
    assert e.per_rank.memory.fits("mpmd", 0.10) and not e.per_rank.memory.fits("spmd", 0.10)
    text = str(e)
    assert "under the per-rank lowering's layout (--memory-layout mpmd" in text
    assert f"{own.memory.max_bytes('mpmd') / GIB:.3g} GiB on its fullest device" in text
    assert e.to_json()["per_rank_plan"]["peak_bytes"] == own.memory.max_bytes("mpmd")
    # where nothing fits under either layout, the error says nothing of the other
    with pytest.raises(NoPlanFits) as caught:
        plan(llama, [("A100-40", 4)], 256)
    assert caught.value.per_rank is None and "per-rank" not in str(caught.value)


def test_cli_names_a_faster_per_rank_plan(capsys, tmp_path):
    """At 30 GB an A100-40's SPMD plans need full remat; the per-rank layout fits the
    cheaper dots remat, a faster plan: the planner says so under the SPMD plans, and
    not where the per-rank layout was asked for."""
    argv = [*LLAMA, "--devices", "A100-40:16", "--memory", "A100-40:30e9", "--top", "1"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("the per-rank lowering"))
    assert "with blockwise attention, dots remat" in line
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    per_rank, best = out["per_rank_plan"], out["plans"][0]
    assert per_rank["memory_layout"] == "mpmd" and per_rank["remat"] == "dots"
    assert per_rank["step_seconds"] < 0.99 * best["predicted_seconds"]
    assert f"{best['predicted_seconds'] / per_rank['step_seconds'] - 1:.1%} faster" in line
    assert main([*argv, "--memory-layout", "mpmd"]) == 0
    assert "the per-rank lowering" not in capsys.readouterr().out


def test_a_plan_names_the_per_rank_lowering_where_the_one_program_holds_more(capsys):
    """OPT-350 over A100-40s and V100-16s: the best SPMD plan's fullest device holds more
    than 1.10x what the per-rank lowering's would for the same plan; its why says so,
    with both figures, and a plan under the mpmd layout says nothing of the kind."""
    argv = ["--model", "OPT-350", "--devices", "A100-40:4,V100-16:4", "--global-batch", "256",
            "--schedules", "1f1b,zb_h1", "--top", "1"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    line = next(x for x in best["why"] if "would hold" in x)
    own, held = (float(x) for x in re.findall(r"([0-9.]+) GiB", line))
    ratio = float(re.search(r"\(([0-9.]+)x\)", line).group(1))
    assert ratio > 1.10 and held / own == pytest.approx(ratio, abs=0.01)  # GiB to 3 digits
    assert main([*argv, "--memory-layout", "mpmd", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    assert not any("would hold" in x for x in best["why"])


def test_cli_json_answers_every_error_in_json(capsys):
    def run(*argv):
        assert main([*argv, "--json"]) == 2
        captured = capsys.readouterr()
        out = json.loads(captured.out)  # one JSON object on stdout
        assert out["error"] and captured.err.startswith("error: ")
        return out

    out = run(*LLAMA, "--devices", "A100-40:4")
    assert out["binding_device"] == "A100-40"
    assert out["needed_bytes"] > out["available_bytes"] == pytest.approx(40 * GIB * 0.9)
    assert out["sequence_length"] == 8192 and out["microbatch_size"] == 1
    assert (out["attention"], out["remat"]) == ("blockwise", "full")
    assert len(out["tried"]) == 4
    # as measured, named: the error says the choice and that auto tries the others
    out = run(*LLAMA, "--devices", "A100-40:16", "--attention", "xla", "--remat", "none")
    assert (out["attention"], out["remat"]) == ("xla", "none")
    assert "--attention auto --remat auto" in out["error"]
    # bad arguments, argparse's own included
    assert "--devices" in run(*LLAMA)["error"]
    assert "--attention" in run(*LLAMA, "--devices", "A100-40:16", "--attention", "flash")["error"]
    assert "required" in run()["error"]
    assert "--layer-costs expects" in run("--layer-costs", "3,x")["error"]
    assert "no Sailor profile" in run("--model", "GPT-5", "--devices", "A100-40:1",
                                      "--global-batch", "8")["error"]  # fmt: skip


def test_validate_takes_the_choices():
    """`--validate` predicts a measured plan as measured, or under a choice asked for."""
    path = "jpipe/_data/sailor/validation/mit/N4/plan_config_N4_D2.json"

    def predicted(*extra):
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["--validate", path, "--json", *extra]) == 0
        return json.loads(buf.getvalue())["predicted_max_mem_bytes"]

    measured = predicted()
    assert predicted("--attention", "xla", "--remat", "none") == measured
    assert predicted("--attention", "blockwise") < measured
    assert predicted("--attention", "blockwise", "--remat", "full") < predicted(
        "--attention", "blockwise"
    )


def test_remat_working_memory_is_counted(llama):
    """Full remat: each stage keeps its blocks' inputs per live microbatch, and one
    block's bytes while its backward re-runs it (the footprint's working term)."""
    full = with_choice(llama, MemoryChoice("blockwise", "full"))
    ev = plan(full, [("A100-40", 16)], 256, top=1, attention="auto", remat="auto")
    assert ev.memory_choice is None  # a derived profile is planned as it stands
    p = ev.best[0].evaluation.plan
    fp = memory_footprint(p, full)
    tp = p.tensor_parallel
    block = full.recomputes(p.microbatch_size, tp)[5]
    assert block > 0
    assert fp.devices("spmd")[0].parts["working"] == pytest.approx(block)


def test_a_profile_keeps_its_model_shape_and_refuses_derived_bytes(llama):
    again = profile_from_json(profile_to_json(llama))
    assert again.shape == llama.shape
    with pytest.raises(ValueError, match="save the profile as measured"):
        profile_to_json(with_choice(llama, MemoryChoice("blockwise", "full")))
    bare = dataclasses.replace(llama, shape=None)
    assert choices_to_try(bare) == [None]
    with pytest.raises(ValueError, match="does not give the model's shape"):
        plan(bare, [("A100-40", 16)], 256, attention="blockwise")
    with pytest.raises(ValueError, match="model_options.remat"):
        read_plan_file(
            {**plan_file(plan(load_sailor_profile("OPT-350"), [("A100-40", 2)], 8,
                              top=1).best[0].evaluation, load_sailor_profile("OPT-350")),
             "model_options": {"attention": "xla", "remat": "some"}}
        )  # fmt: skip
