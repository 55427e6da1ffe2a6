"""Trained weights out into the user's own model, and back in (`jpipe.train.export`).

A user's model of their own classes (Equinox-style: frozen dataclasses
registered as JAX pytrees; Equinox itself is not a dependency) is trained by
`jpipe.train.train`, exported with `load_params`, and evaluated outside
jpipe, by the user's own forward in plain JAX, to the trainer's held-out
loss; `config.init_from` starts a run from it. The same file serves
``train.py``, ``python -m jpipe.check --model`` and `jpipe.testing`.

Tolerances are float32 ones (1e-5, about 100 ulps of a loss near 1.5): the
exported model and the trainer compute the same sums in other programs. If
one fails, look for a parameter in the wrong place first (a bucket row, a
stage's order); do not loosen it.
"""

import dataclasses
import importlib
import json
import shutil
import sys
import textwrap
from pathlib import Path

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

from jpipe import check, models, testing
from jpipe import train as trainer
from jpipe.models import registry
from jpipe.train import sources

ROOT = Path(__file__).resolve().parents[1]
RTOL = 1e-5
MODULE = "export_user_model"  # the user's file, imported by this name

USER_FILE = textwrap.dedent('''
    """A user's model of their own classes, Equinox-style, and its data: one file."""

    import dataclasses
    import os

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jpipe import models
    from jpipe.train import config_from_file

    SEEN_DTYPES = []  # each stage's parameter dtype when traced


    def pytree(cls):
        return jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))


    @pytree
    class Linear:
        w: jax.Array
        b: jax.Array

        def __call__(self, x):
            return x @ self.w + self.b


    @pytree
    class Block:
        up: Linear
        down: Linear

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.up(x)))


    @pytree
    class Stage:
        embed: Linear | None
        blocks: tuple
        head: Linear | None

        def __call__(self, x, inputs):
            SEEN_DTYPES.append(jax.tree.leaves(self)[0].dtype)
            if self.embed is not None:
                x = jax.vmap(self.embed)(inputs["x"])  # a row at a time, as Equinox writes it
            for block in self.blocks:
                x = jax.vmap(block)(x)
            if self.head is None:
                return x
            logits = jax.vmap(self.head)(x).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, inputs["labels"][:, None], 1))


    def linear(key, n_in, n_out):
        return Linear(jax.random.normal(key, (n_in, n_out)) / np.sqrt(n_in), jnp.zeros((n_out,)))


    def loss(stages, batch):
        """The model without jpipe: each stage in turn on the whole batch."""
        x = None
        for stage in stages:
            x = stage(x, batch)
        return x


    def build(args: models.BuildArgs) -> models.StagedModel:
        c, S = args.config, args.num_stages
        counts = models.split_layers(c.num_layers, S, args.layers_per_stage or None)

        def init(rng, stages=None):
            key = rng if hasattr(rng, "dtype") else jax.random.key(rng)
            k = jax.random.split(key, 2 * c.num_layers + 2)
            blocks = [
                Block(linear(k[2 * i], c.width, 2 * c.width),
                      linear(k[2 * i + 1], 2 * c.width, c.width))
                for i in range(c.num_layers)
            ]
            out, first = [], 0
            for s, n in enumerate(counts):
                out.append(Stage(
                    embed=linear(k[-2], 8, c.width) if s == 0 else None,
                    blocks=tuple(blocks[first:first + n]),
                    head=linear(k[-1], c.width, 4) if s == S - 1 else None,
                ))
                first += n
            return out

        def stage(params, x, inputs):
            return params(x, inputs)

        return models.StagedModel((stage,) * S, init, loss, counts)


    def data(args):
        """Rows of 8 numbers labelled by the largest of the first 4: a pure function of the step."""
        step = args.start_step
        while True:
            rng = np.random.default_rng([args.seed, {"train": 0, "eval": 1}[args.split], step])
            x = rng.normal(size=(args.batch_size, 8)).astype(np.float32)
            mine = x[args.process_index * args.rows:(args.process_index + 1) * args.rows]
            yield {"x": mine, "labels": np.argmax(mine[:, :4], axis=1).astype(np.int32)}
            step += 1


    def get_config():
        """configs/default.py, shrunken, with this file's model and data."""
        here = os.path.abspath(__file__)
        config = config_from_file(os.environ["JPIPE_ROOT"] + "/configs/default.py")
        config.steps, config.log_every, config.eval_every = 3, 1, 3
        config.eval_batches, config.checkpoint_every = 2, 3
        config.batch_size, config.num_microbatches = 8, 2
        config.mesh.pipe, config.mesh.data = 2, 2
        config.optimizer.warmup_steps, config.optimizer.learning_rate = 0, 1e-2
        config.model = dict(name=here + ":build", num_layers=2, width=16, dtype="float32")
        config.data = dict(source=here + ":data")
        return config
''')


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """The user's file, on sys.path and imported as the user would: ``import export_user_model``."""
    folder = tmp_path_factory.mktemp("user")
    (folder / f"{MODULE}.py").write_text(USER_FILE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JPIPE_ROOT", str(ROOT))
        patch.syspath_prepend(str(folder))
        module = importlib.import_module(MODULE)
        yield module
        sys.modules.pop(MODULE, None)


@pytest.fixture(scope="module")
def trained(user, tmp_path_factory):
    """Three steps of the trainer on the user's model: ``(config, workdir, TrainResult)``."""
    workdir = tmp_path_factory.mktemp("run")
    config = user.get_config()
    return config, workdir, trainer.train(config, workdir, progress=False)


def eval_batches(config, n: int):
    c = trainer.TrainConfig.from_config(config)
    args = sources.DataArgs(ml_collections.FrozenConfigDict(config.data), "eval", c.batch_size, 0)
    return [batch for batch, _ in zip(sources.get_source(c.data.source)(args), range(n))]


@pytest.mark.slow
def test_trained_weights_come_out_in_the_users_own_classes(user, trained):
    config, workdir, result = trained
    params = trainer.load_params(workdir, config)
    # The user's classes (their `import`), the structure their own init makes, jax.Arrays.
    assert all(isinstance(stage, user.Stage) for stage in params)
    fresh = user.build(models.BuildArgs(ml_collections.FrozenConfigDict(config.model), 2)).init(0)
    assert jax.tree.structure(params) == jax.tree.structure(fresh)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(params))
    # Evaluated outside jpipe, by the user's own forward, to the trainer's held-out loss.
    own = np.mean([float(jax.jit(user.loss)(params, b)) for b in eval_batches(config, 2)])
    np.testing.assert_allclose(own, result.eval_losses[3], rtol=RTOL)
    assert result.eval_losses[3] < result.eval_losses[0]  # it trained
    # A checkpoint other than the newest; without a config, the builder's file the
    # checkpoint records by its whole path (still there) and its recorded fields.
    assert trainer.load_params(workdir, config, step=3)[0].embed.w.shape == (8, 16)
    with pytest.raises(trainer.ConfigError, match="no complete checkpoint of step 2"):
        trainer.load_params(workdir, config, step=2)
    alone = trainer.load_params(workdir)
    assert jax.tree.structure(alone) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(alone), jax.tree.leaves(params)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_init_from_starts_a_run_from_a_checkpoint_or_a_saved_file(trained, tmp_path):
    config, workdir, result = trained
    params = trainer.load_params(workdir, config)
    # From the run directory: the held-out loss before the first step is the one it ended on.
    again = config.copy_and_resolve_references()
    again.steps, again.init_from = 1, str(workdir)
    resumed = trainer.train(again, tmp_path / "again", progress=False)
    np.testing.assert_allclose(resumed.eval_losses[0], result.eval_losses[3], rtol=RTOL)
    # From a saved pytree: the same arrays, bit for bit, in the model's classes.
    path = trainer.save_params(tmp_path / "params", params)
    assert path.endswith(".npz") and "[0].embed.w" in np.load(path).files
    again.init_from = path
    loaded = trainer.prepare(again).init_params
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(got, np.asarray(want))


@pytest.mark.slow
def test_weights_come_out_of_a_run_with_a_mesh_per_rank(user, trained, tmp_path):
    """The per-rank lowering gives each rank a mesh of its own and saves each rank's own
    arrays, ``params.<rank>.<bucket>`` of one row, not the packed ``[R, ...]`` buckets: they
    come out as a one-mesh run's do, to the held-out loss evaluated outside jpipe, and
    ``init_from`` starts a one-mesh run from them; resuming either checkpoint with the other
    layout is refused before anything is compiled, saying how to resume it."""
    config, one_mesh_dir, _ = trained
    config = config.copy_and_resolve_references()
    # ZB-V: 4 stages, rank 0 holding the first and the last (stage s is not on rank s).
    config.lowering, config.schedule, config.model.num_layers = "mpmd", "zbv", 4
    workdir = tmp_path / "run"
    result = trainer.train(config, workdir, progress=False)
    state = workdir / "checkpoints" / "3" / "state"
    saved = ocp.StandardCheckpointHandler().metadata(epath.Path(state)).tree["params"]
    assert isinstance(saved, list) and len(saved) == 2  # a dict of one row per bucket, per rank
    params = trainer.load_params(workdir, config)
    assert all(isinstance(stage, user.Stage) for stage in params)
    own = np.mean([float(jax.jit(user.loss)(params, b)) for b in eval_batches(config, 2)])
    np.testing.assert_allclose(own, result.eval_losses[3], rtol=RTOL)
    again = config.copy_and_resolve_references()
    again.lowering, again.steps, again.init_from = "spmd", 1, str(workdir)
    resumed = trainer.train(again, tmp_path / "again", progress=False)
    np.testing.assert_allclose(resumed.eval_losses[0], result.eval_losses[3], rtol=RTOL)
    # Resumed under the other layout: refused, each saying which lowering resumes it.
    longer = config.copy_and_resolve_references()
    longer.steps, longer.lowering = 4, "spmd"
    with pytest.raises(
        trainer.ConfigError, match="each rank's on a mesh of its own.*lowering=mpmd"
    ):
        trainer.train(longer, workdir, progress=False)
    shutil.copytree(one_mesh_dir, tmp_path / "one_mesh")
    longer = trained[0].copy_and_resolve_references()  # the one-mesh run's own model
    longer.steps, longer.lowering = 4, "mpmd"
    with pytest.raises(trainer.ConfigError, match="every rank's on one mesh.*lowering=spmd"):
        trainer.train(longer, tmp_path / "one_mesh", progress=False)


@pytest.mark.slow
def test_init_from_refuses_parameters_of_another_shape_naming_the_leaf(user, trained, tmp_path):
    config, workdir, _ = trained
    params = trainer.load_params(workdir, config)
    wide = dataclasses.replace(
        params[1], head=dataclasses.replace(params[1].head, w=np.zeros((16, 5), np.float32))
    )
    bad = config.copy_and_resolve_references()
    bad.init_from = trainer.save_params(tmp_path / "wide.npz", [params[0], wide])
    with pytest.raises(trainer.ConfigError, match=r"parameter \[1\]\.head\.w has shape \(16, 5\)"):
        trainer.prepare(bad)
    bad.init_from = trainer.save_params(tmp_path / "short.npz", params[:1])
    with pytest.raises(trainer.ConfigError, match=r"has no parameter \[1\]\.blocks\[0\]"):
        trainer.prepare(bad)
    bad.init_from = str(workdir)
    bad.model.width = 32  # another model than the checkpoint's
    with pytest.raises(trainer.ConfigError, match="holds other arrays than the model"):
        trainer.prepare(bad)
    bad.init_from = str(tmp_path / "nowhere")
    with pytest.raises(trainer.ConfigError, match="config.init_from=.*no such directory or file"):
        trainer.prepare(bad)


def test_a_users_file_is_imported_under_its_own_name(user, tmp_path):
    path = Path(user.__file__)
    build = registry.load_function(f"{path}:build", "model")
    assert build is user.build and sys.modules[MODULE] is user  # reused, not run again
    # Not yet imported: the file becomes the module `import` would give.
    fresh = tmp_path / "export_fresh_model.py"
    fresh.write_text("class Thing:\n    pass\n\ndef make():\n    return Thing()\n")
    made = registry.load_function(f"{fresh}:make", "model")()
    try:
        assert type(made).__module__ == "export_fresh_model"
        assert sys.modules["export_fresh_model"].Thing is type(made)
        # Another file of the same stem: the name is taken, it runs under a private one.
        other = tmp_path / "elsewhere" / "export_fresh_model.py"
        other.parent.mkdir()
        other.write_text(fresh.read_text())
        second = registry.load_function(f"{other}:make", "model")
        assert second.__module__.startswith("_jpipe_user_")
        # A stem that would hide another module (the standard library's `json`).
        shadow = tmp_path / "json.py"
        shadow.write_text("def make():\n    return 1\n")
        assert registry.load_function(f"{shadow}:make", "model").__module__ != "json"
        assert sys.modules["json"] is json
    finally:
        sys.modules.pop("export_fresh_model", None)


@pytest.mark.slow
def test_model_dtype_is_applied_to_a_builder_from_a_file(user, trained):
    config, _, _ = trained
    low = config.copy_and_resolve_references()
    low.model.dtype = "bfloat16"
    model = trainer.prepare(low).model
    params = model.init(0)
    batch = eval_batches(config, 1)[0]
    user.SEEN_DTYPES.clear()
    loss = model.loss(params, batch)
    assert set(user.SEEN_DTYPES) == {np.dtype("bfloat16")}  # the stages computed in bfloat16
    assert loss.dtype == np.float32  # from float32 parameters, to a float32 loss
    user.SEEN_DTYPES.clear()
    exact = user.loss(params, batch)
    assert set(user.SEEN_DTYPES) == {np.dtype("float32")}
    assert 0 < abs(float(loss) - float(exact)) < 2e-2 * float(exact)  # bfloat16's rounding
    low.model.dtype = "int8"
    with pytest.raises(trainer.ConfigError, match="config.model.dtype='int8'"):
        trainer.prepare(low)


@pytest.mark.slow
def test_check_and_testing_take_the_trainers_builder(user, capsys):
    spec = f"{user.__file__}:build"
    # The file's own get_config() gives config.model and the batches, as for train.py.
    assert check.main(["1f1b", "-r", "2", "-m", "2", "--model", spec, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["max_rel_err"] <= RTOL and result["model"] == spec
    result = testing.check_model(spec, None, "1f1b", 2, num_ranks=2, config=user.get_config())
    assert result.passed, result.summary()
    # Without a config whose config.model has its fields: one line saying what to give.
    bare = Path(user.__file__).with_name("export_bare_model.py")
    bare.write_text(USER_FILE.replace("def get_config", "def _get_config"))
    try:
        argv = ["1f1b", "-r", "2", "-m", "2", "--model", f"{bare}:build"]
        assert check.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: the model builder") and "give one (--config FILE" in err
        assert err.count("\n") == 1
    finally:
        sys.modules.pop("export_bare_model", None)


@pytest.mark.slow
def test_a_registered_models_checkpoint_needs_no_config(tmp_path):
    # A GPT split over 4 ranks with tensor 2, checkpointed as the trainer does
    # (its state and meta), read back without a config and on one device.
    import jpipe
    from jpipe.train.checkpoint import Checkpoints, checkpoint_meta
    from jpipe.train.step import TrainState

    config = trainer.config_from_file(ROOT / "configs" / "default.py")
    config.mesh.data, config.mesh.tensor, config.data.max_bytes = 1, 2, 64 * 1024
    config.model.update(num_layers=4, d_model=32, d_ff=64, num_heads=2, seq_len=16)
    prepared = trainer.prepare(config)
    model = prepared.model
    pipeline = jpipe.Pipeline(model.stages, prepared.schedule, prepared.mesh)
    params = model.init(7)
    state = TrainState(np.int32(0), pipeline.pack(params, model.specs(params)), {})
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    checkpoints.save(5, state, checkpoint_meta(pipeline, prepared))
    checkpoints.close()
    loaded = trainer.load_params(tmp_path)
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
