"""examples/: each model, pipelined, against itself unpipelined; through train.py; in its own loop.

The three examples (a ViT in Flax linen, the same in Flax NNX, an MLP-Mixer
in plain JAX) each give `build(BuildArgs)` and a config for ``train.py``,
and a `train_own_loop` around `jpipe.Pipeline` with optax. Tolerances are
float32 ones (`jpipe.testing.check_model`'s 1e-5, about 100 ulps); if one
fails, look for a bug in the split (a stage's parameters, the order of the
blocks) before anything else, and do not loosen it.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jpipe import models, testing
from jpipe import train as trainer

pytestmark = pytest.mark.slow  # every test compiles and runs pipelines

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NAMES = ("vit_linen", "vit_nnx", "mixer_jax")


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def images():
    return load("images")


def tiny(config, steps: int):
    """The example's config shrunken: a few steps, checkpoints at 2."""
    config.steps = steps
    config.log_every = 1
    config.eval_every = 2
    config.eval_batches = 1
    config.checkpoint_every = 2
    config.batch_size = 16
    config.mesh.pipe = 2  # two ranks compile in half the time of four
    config.num_microbatches = 2
    return config


@pytest.mark.parametrize("name", NAMES)
def test_pipelined_stages_match_the_model(name):
    example = load(name)
    config = ml_collections.FrozenConfigDict(example.get_config().model)
    model = example.build(models.BuildArgs(config, num_stages=4))
    batch = images().make_batch(0, "train", 0, 16)
    result = testing.check_model(model, batch, "1f1b", num_microbatches=4, data=2)
    assert result.passed, result.summary()
    assert result.stages == 4 and result.data == 2


def test_zero_bubble_and_uneven_split():
    example = load("vit_nnx")
    config = ml_collections.FrozenConfigDict(example.get_config().model)
    model = example.build(models.BuildArgs(config, 4, layers_per_stage="0,2,2,0"))
    assert model.layers_per_stage == (0, 2, 2, 0)
    batch = images().make_batch(0, "train", 1, 8)
    result = testing.check_model(model, batch, "zb_h1", num_microbatches=8)
    assert result.passed, result.summary()


def test_every_split_starts_from_the_same_weights():
    for name in ("vit_nnx", "mixer_jax"):  # split_flax_model's init: tests/test_gpt.py
        example = load(name)
        config = ml_collections.FrozenConfigDict(example.get_config().model)
        split = example.build(models.BuildArgs(config, 4)).init(0)
        whole = example.build(models.BuildArgs(config, 1)).init(0)
        merged = models.merge_stage_params(split)
        jax.tree.map(np.testing.assert_array_equal, merged, models.merge_stage_params(whole))


# One example: the others train through the trainer in the own-loop test below, and
# the GPT's Ctrl-C resume is tests/test_train.py's (each run here is 1 to 2 minutes).
@pytest.mark.parametrize("name", ["vit_linen"])
def test_train_py_resumes_after_ctrl_c_to_the_same_losses(name, tmp_path):
    """``python train.py --config=examples/NAME.py``, sent SIGINT mid-run and resumed."""
    tiny_flags = [
        f"--config={EXAMPLES / f'{name}.py'}",
        "--config.mesh.pipe=2",
        "--config.mesh.data=1",
        "--config.num_microbatches=2",
        "--config.batch_size=8",
        # Enough steps that the run is still going when the signal lands, however
        # late a loaded machine lets this test see the second loss (12 once finished first).
        "--config.steps=40",
        "--config.log_every=1",
        "--config.eval_every=100",
        "--config.eval_batches=1",
        "--config.checkpoint_every=100",  # the only checkpoint before the end is Ctrl-C's
    ]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # train.py fakes its own
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"  # as conftest's: faster compiles

    def command(workdir):
        return [sys.executable, str(EXAMPLES.parent / "train.py"), f"--workdir={workdir}"]

    def losses(workdir):
        if not (workdir / "metrics.jsonl").exists():
            return {}
        records = [
            json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()
        ]
        return {r["step"]: r["loss"] for r in records if "loss" in r}

    broken, unbroken = tmp_path / "broken", tmp_path / "unbroken"
    # The child gets Ctrl-C's default meaning even where pytest runs in the background
    # (a shell's `&` ignores SIGINT, and a child inherits an ignored signal).
    previous = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        run = subprocess.Popen(
            command(broken) + tiny_flags, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 180
    while len(losses(broken)) < 2:
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 130, (out + err)[-3000:]
    step = int(out.strip().splitlines()[-1].split()[3].rstrip(","))  # "interrupted at step N, ..."
    assert 2 <= step < 40
    again = subprocess.run(command(broken) + tiny_flags, capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from the checkpoint of step {step}" in again.stdout
    whole = subprocess.run(command(unbroken) + tiny_flags, capture_output=True, text=True, env=env)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert losses(broken) == losses(unbroken)  # bit for bit
    assert sorted(losses(broken)) == list(range(1, 41))


def test_own_loop_starts_from_the_model():
    # Key 0 and the first batch (seed 0, 32 rows): the loss before the first
    # update is the unpipelined model's on them.
    example = load("vit_linen")
    own = example.train_own_loop(steps=3, ranks=2, microbatches=2)
    config = ml_collections.FrozenConfigDict(example.get_config().model)
    model = example.build(models.BuildArgs(config, num_stages=2))
    want = model.loss(model.init(jax.random.key(0)), images().make_batch(0, "train", 0, 32))
    np.testing.assert_allclose(own[0], want, rtol=1e-5)
    assert all(np.isfinite(own)) and len(own) == 3


@pytest.mark.parametrize("name", ["vit_nnx", "mixer_jax"])  # vit_linen: the resume test
def test_own_loop_starts_where_the_trainer_does(name, tmp_path):
    # The same weights (key 0) and the same first batch (seed 0, 32 rows):
    # the loss before the first update is the same in both loops.
    example = load(name)
    config = tiny(example.get_config(), 1)
    config.batch_size = 32
    config.eval_every = 0
    config.checkpoint_every = 0
    run = trainer.train(config, tmp_path, progress=False)
    own = example.train_own_loop(steps=3, ranks=2, microbatches=2)
    np.testing.assert_allclose(own[0], run.losses[1], rtol=1e-5)
    assert all(np.isfinite(own)) and len(own) == 3


def test_a_builder_with_the_wrong_stage_count_is_refused(tmp_path):
    config = tiny(load("vit_linen").get_config(), 1)
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('v', {str(EXAMPLES / 'vit_linen.py')!r})\n"
        "v = importlib.util.module_from_spec(spec); spec.loader.exec_module(v)\n"
        "def build(args):\n"
        "    return v.build(args._replace(num_stages=3))\n"
    )
    config.model.name = f"{bad}:build"
    with pytest.raises(trainer.ConfigError, match="returned 3 stages but the schedule has 2"):
        trainer.prepare(config)
    config.model.name = f"{bad}:nothing"
    with pytest.raises(trainer.ConfigError, match="has no function 'nothing'"):
        trainer.prepare(config)
    config.model.name = f"{EXAMPLES / 'vit_linen.py'}:build"
    config.data = {"source": ""}  # the text corpus, for a model without a seq_len
    with pytest.raises(trainer.ConfigError, match="has no integer seq_len"):
        trainer.prepare(config)


def test_nnx_stages_draw_dropout_from_the_row_keys():
    from flax import nnx

    class Embed(nnx.Module):
        def __init__(self, rngs):
            self.table = nnx.Embed(16, 8, rngs=rngs)

        def __call__(self, inputs, keys=None):
            return models.row_dropout(self.table(inputs["tokens"]), keys, 0.5)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x, keys=None):
            return x + models.row_dropout(jax.nn.tanh(self.dense(x)), keys, 0.5)

    class Head(nnx.Module):
        def __init__(self, rngs):
            self.out = nnx.Linear(8, 16, rngs=rngs)

        def __call__(self, x, inputs, keys=None):
            logits = self.out(x)
            picked = jnp.take_along_axis(
                jax.nn.log_softmax(logits), inputs["targets"][..., None], -1
            )
            return -picked.mean()

    model = models.split_nnx_model(Embed, Block, Head, num_layers=2, num_stages=2, keys="keys")
    assert model.keys == "keys"
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(0, 16, (8, 4)).astype(np.int32),
        "targets": rng.integers(0, 16, (8, 4)).astype(np.int32),
    }
    keyed = {**batch, "keys": np.asarray(models.row_keys(0, 0, 8))}
    params = model.init(0)
    assert float(model.loss(params, keyed)) != float(model.loss(params, batch))  # masks drawn
    result = testing.check_model(model, keyed, "1f1b", num_microbatches=4)
    assert result.passed, result.summary()
