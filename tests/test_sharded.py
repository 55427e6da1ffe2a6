"""Meshes with more axes: tensor (Megatron) and fsdp (ZeRO-3) splits inside the stages.

The program is manual over every mesh axis. Over ``tensor`` each device
holds its block of every split weight and the stage functions sum over the
axis themselves (`jpipe.models.gpt`'s blocks, Megatron-style); over ``fsdp``
every parameter, its gradient and its optimizer state are split, the program
gathers a stage's arrays just before each piece runs and reduce-scatters the
weight gradients, and the batch's rows are split like ``data``. Checked here:
loss and every gradient equal the whole, unsplit, unpipelined model in
float32, and each device holds only its blocks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jpipe
from jpipe import models, testing
from jpipe.models import gpt

CONFIG = models.GPTConfig(vocab_size=32, seq_len=8, num_layers=4, num_heads=2, d_model=16, d_ff=32)
RTOL = 1e-5  # float32; as the compiler tests (see jpipe.testing.CheckResult)
# Per mesh: a schedule that keeps the backward whole or splits it into I and
# W, and interleaved 1F1B (two stages per rank) with a masked loss.
SCHEDULES = {
    "data": [("1f1b", (2, 2), None), ("interleaved_1f1b", (1,) * 4, 2)],
    "fsdp": [("zb_h1", (2, 2), None), ("interleaved_1f1b", (1,) * 4, 2)],
}


def per_device_bytes(packed: dict) -> int:
    return sum(v.addressable_shards[0].data.nbytes for v in packed.values())


@pytest.mark.slow
@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
@pytest.mark.parametrize("axes", [{"data": 2, "tensor": 2}, {"fsdp": 2, "tensor": 2}], ids=str)
def test_split_stages_equal_the_whole_model(axes, lowering):
    mesh = jpipe.make_mesh(2, **axes)
    batch = models.example_batch(CONFIG, batch_size=8, seed=3)
    # Random token masks (a jpipe.WeightedLoss): the pipeline sums weighted
    # losses and weights over pipe, data and fsdp and divides once.
    masked = {**batch, "weights": np.random.default_rng(0).random((8, 8)) < 0.6}
    schedules = SCHEDULES["fsdp" if "fsdp" in axes else "data"]
    for (name, split, chunks), inputs in zip(schedules, (batch, masked)):
        model = models.make_stages(CONFIG, split, tensor_axis="tensor")
        params = model.init(0)
        schedule = jpipe.get_schedule(name, 2, 4, chunks)
        pipe = jpipe.Pipeline(model.stages, schedule, mesh, lowering=lowering)
        packed = pipe.pack(params, gpt.tensor_specs(CONFIG, params))
        loss, grads = pipe.value_and_grad(packed, jax.device_put(inputs, pipe.batch_sharding))
        # The reference is the whole model on the whole batch: no pipeline,
        # no split weights.
        whole = models.make_stages(CONFIG, split)
        want = jpipe.reference_value_and_grad(whole.stages, params, inputs)
        _, rel = testing.compare((loss, pipe.unpack(grads)), want)
        assert rel <= RTOL, (name, rel)

    # Each device holds its block of a split weight: a qkv kernel [16, 48] is
    # split by columns over tensor (and by rows over fsdp, when there is one).
    qkv = [name for name in pipe.layout.buckets if name.startswith("float32[16x48]")]
    assert qkv
    fsdp = axes.get("fsdp", 1)
    assert {packed[name].addressable_shards[0].data.shape for name in qkv} == {(1, 16 // fsdp, 24)}
    # All parameters together: tensor halves the blocks' matrices, fsdp
    # halves everything (these sizes all divide).
    whole = jpipe.Pipeline(model.stages, schedule, jpipe.make_mesh(2))
    whole_bytes = per_device_bytes(whole.pack(params))
    if fsdp == 2:
        assert per_device_bytes(packed) * 2 < whole_bytes
    else:
        assert whole_bytes / 2 < per_device_bytes(packed) < whole_bytes


@pytest.mark.slow
def test_specs_are_checked_against_the_mesh():
    mesh = jpipe.make_mesh(2, fsdp=2, tensor=2)
    config = models.GPTConfig(**{**CONFIG.__dict__, "vocab_size": 33})  # an odd head [16, 33]
    model = models.make_stages(config, (2, 2))
    params = model.init(0)
    schedule = jpipe.get_schedule("1f1b", 2, 4)

    def pack_with(spec_of):
        specs = [jax.tree.map(lambda leaf: P(), p) for p in params]
        specs[1]["head"]["unembed"]["kernel"] = spec_of
        return jpipe.Pipeline(model.stages, schedule, mesh).pack(params, specs)

    with pytest.raises(ValueError, match="'model', which is not an axis"):
        pack_with(P(None, "model"))
    with pytest.raises(ValueError, match="the fsdp axis, which splits every array by itself"):
        pack_with(P("fsdp"))
    with pytest.raises(ValueError, match="dimension 1 of size 33 cannot be split 2 ways"):
        pack_with(P(None, "tensor"))
    with pytest.raises(ValueError, match="names an axis twice"):
        pack_with(P("tensor", "tensor"))
    with pytest.raises(ValueError, match="more entries than dimensions"):
        pack_with(P(None, None, "tensor"))
    with pytest.raises(ValueError, match="do not match its parameters"):
        jpipe.Pipeline(model.stages, schedule, mesh).pack(params, [P(), P()])


def test_make_mesh_axes():
    mesh = jpipe.make_mesh(2, 1, fsdp=2, tensor=2)
    assert dict(mesh.shape) == {"pipe": 2, "data": 1, "fsdp": 2, "tensor": 2}
    # Tensor is innermost: its devices are neighbours.
    assert [d.id for d in mesh.devices[0, 0, 0]] == [0, 1]
    with pytest.raises(ValueError, match="needs 16 devices") as error:
        jpipe.make_mesh(2, 2, fsdp=2, tensor=2)
    # On CPU it says how to fake enough devices, both ways.
    assert "jax.config.update('jax_num_cpu_devices', 16)" in str(error.value)
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in str(error.value)
    with pytest.raises(ValueError, match="at least 1"):
        jpipe.make_mesh(2, tensor=0)
    np.testing.assert_equal(jpipe.make_mesh(4).devices.shape, (4, 1, 1, 1))


@pytest.mark.slow
def test_init_makes_each_device_only_its_block():
    config = models.GPTConfig(
        vocab_size=512, seq_len=32, num_layers=4, num_heads=4, d_model=128, d_ff=512
    )
    model = models.make_stages(config, (2, 2), tensor_axis="tensor")
    mesh = jpipe.make_mesh(2, fsdp=2, tensor=2)
    pipe = jpipe.Pipeline(model.stages, jpipe.get_schedule("1f1b", 2, 4), mesh)
    key = jax.random.key(5)
    shapes = jax.eval_shape(model.init, key)
    specs = gpt.tensor_specs(config, shapes)
    made = pipe.init(model.init, key, specs)
    # The same parameters, placed the same way, as packing the whole model.
    packed = pipe.pack(model.init(key), specs)
    for name, array in packed.items():
        assert made[name].sharding == array.sharding, name
        np.testing.assert_array_equal(np.asarray(made[name]), np.asarray(array))
    # What each rank's program allocates on a device (its output, its block
    # of the packed arrays, and its temporaries) is less than the rank's own
    # stage whole, let alone the model.
    stage_bytes = [
        sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(p)) for p in shapes
    ]
    block = per_device_bytes(packed)
    for r, program in enumerate(pipe.init_programs(model.init, key, specs)):
        memory = program.lower(key).compile().memory_analysis()
        assert memory.output_size_in_bytes < 1.1 * block
        assert memory.output_size_in_bytes + memory.temp_size_in_bytes < 0.7 * stage_bytes[r]


# -- stages that write their own collectives -----------------------------------
#
# `jpipe.testing.tensor_model`'s blocks use plain JAX collectives over
# "tensor", as `jax.shard_map` users write them (no custom_vjp wrappers). The
# pipeline traces each stage as one device sees it, under JAX's rules for
# varying values (`jpipe.stage.manual`), so their gradients must equal the unsplit
# model's. 8 fake devices: pipe 3 x tensor 2, and pipe 2 x fsdp 2 x tensor 2.
COLLECTIVE_MESHES = {
    "pipe3-tensor2": (3, {"tensor": 2}),
    "pipe2-fsdp2-tensor2": (2, {"fsdp": 2, "tensor": 2}),
}
COLLECTIVE_SCHEDULES = (("1f1b", None), ("zb_h1", None), ("interleaved_1f1b", 2))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", COLLECTIVE_MESHES, ids=str)
@pytest.mark.parametrize("block", ["mlp", "attention", "two_blocks"])
@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
def test_plain_collectives_give_the_unsplit_models_gradients(block, mesh, lowering):
    ranks, axes = COLLECTIVE_MESHES[mesh]
    for name, chunks in COLLECTIVE_SCHEDULES:
        result = testing.check_schedule(
            name, ranks, 4, chunks, model=f"tensor:{block}", lowering=lowering, **axes
        )
        assert result.passed, (name, result.max_rel_err)
        assert result.max_rel_err <= RTOL


@pytest.mark.slow
@pytest.mark.parametrize("mesh", COLLECTIVE_MESHES, ids=str)
@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
def test_sequence_parallelism_inside_a_stage(mesh, lowering):
    # psum_scatter splits a block's sum over the sequence, each device works
    # on its positions, all_gather(..., to="invarying") gathers them back.
    ranks, axes = COLLECTIVE_MESHES[mesh]
    for name, chunks in COLLECTIVE_SCHEDULES[:2]:
        result = testing.check_schedule(
            name, ranks, 4, chunks, model="tensor:sequence", lowering=lowering, **axes
        )
        assert result.passed, (name, result.max_rel_err)


@pytest.mark.slow
def test_the_reference_can_be_the_stages_under_shard_map():
    # No unsplit functions: the reference is the user's own stages under
    # jax.shard_map (check_vma=True) on the whole batch, unpipelined.
    model = testing.tensor_model(3, "two_blocks")
    without = testing.CheckModel(model.stages, model.params, model.make_batch, model.specs)
    result = testing.check_schedule("1f1b", 3, 4, model=without, tensor=2)
    assert result.passed, result.max_rel_err
    # ... and it is the unsplit model.
    assert result.reference_loss == pytest.approx(
        testing.check_schedule("1f1b", 3, 4, model=model, tensor=2).reference_loss, rel=1e-6
    )


@pytest.mark.slow
def test_without_the_varying_rules_the_gradients_are_wrong(monkeypatch):
    # What this guards against: traced with the axis names merely bound (as
    # before), psum transposes to psum and the input's cotangent is never
    # summed over tensor: the row-split MLP's split weights get 2x gradients.
    from jpipe.lower.spmd import program as _lower

    monkeypatch.setattr(_lower, "DeviceView", lambda *args: None)  # trace as before
    result = testing.check_schedule("1f1b", 3, 4, model="tensor:mlp", tensor=2)
    assert not result.passed and result.max_rel_err > 0.3, result.max_rel_err


def _collective_stage(collective):
    def stage(params, x, inputs):
        return collective(jnp.tanh(x @ params["w"]))

    return stage


def _pipeline_with(middle, axes=None):
    """A 3-stage pipeline whose middle stage is `middle`; the others plain."""
    model = testing.tensor_model(3, "mlp")
    stages = (model.stages[0], middle, model.stages[2])
    params = [model.params[0], {"w": np.eye(8, dtype=np.float32)}, model.params[2]]
    specs = [model.specs[0], {"w": None}, model.specs[2]]
    mesh = jpipe.make_mesh(3, tensor=2)
    pipe = jpipe.Pipeline(stages, jpipe.get_schedule("1f1b", 3, 4), mesh)
    packed = pipe.pack(params, specs)
    batch = jax.device_put(model.make_batch(8), pipe.batch_sharding)
    return pipe, packed, batch, (stages, params, model)


@pytest.mark.parametrize(
    "collective,named",
    [
        (lambda y: lax.pmean(y, "pipe"), "psum"),
        (lambda y: lax.psum(y * (1 + lax.axis_index("tensor")), ("tensor", "pipe")), "psum"),
        (lambda y: lax.ppermute(y, "pipe", [(0, 1), (1, 2), (2, 0)]), "ppermute"),
        (lambda y: lax.all_gather(y, "pipe", axis=0, tiled=True)[: y.shape[0]], "all_gather"),
        (
            lambda y: lax.psum_scatter(jnp.tile(y, (3, 1, 1)), "pipe", tiled=True),
            "psum_scatter",
        ),
    ],
    ids=["pmean", "psum-two-axes", "ppermute", "all_gather", "psum_scatter"],
)
def test_a_collective_over_pipe_is_refused_before_compiling(collective, named):
    pipe, packed, batch, _ = _pipeline_with(_collective_stage(collective))
    with pytest.raises(
        ValueError, match=rf"stage 1 calls lax\.{named}\b.* over the pipeline axis 'pipe'"
    ):
        pipe.value_and_grad(packed, batch)
    assert pipe.compile_seconds is None  # refused while tracing: nothing compiled


@pytest.mark.slow
def test_axis_index_over_pipe_is_allowed_and_exact():
    def stage(params, x, inputs):  # a rank-dependent scale, 1 on every rank
        rank = lax.axis_index("pipe").astype(jnp.float32)
        return jnp.tanh(x @ params["w"]) * (1.0 + 0.0 * rank)

    def plain(params, x, inputs):
        return jnp.tanh(x @ params["w"])

    pipe, packed, batch, (stages, params, model) = _pipeline_with(stage)
    loss, grads = pipe.value_and_grad(packed, batch)
    reference = (model.reference[0], plain, model.reference[2])
    want = jpipe.reference_value_and_grad(reference, params, model.make_batch(8))
    assert testing.compare((loss, pipe.unpack(grads)), want)[1] <= RTOL


def test_an_output_that_still_varies_over_tensor_is_refused():
    # A column-split matmul with nothing to close it: each device has its
    # own half of the features, which the next stage cannot take.
    def split_out(params, x, inputs):
        return jnp.tanh(x @ params["w"])

    model = testing.tensor_model(3, "mlp")
    stages = (model.stages[0], split_out, model.stages[2])
    params = [model.params[0], {"w": np.ones((8, 8), np.float32)}, model.params[2]]
    specs = [model.specs[0], {"w": P(None, "tensor")}, model.specs[2]]
    pipe = jpipe.Pipeline(stages, jpipe.get_schedule("1f1b", 3, 4), jpipe.make_mesh(3, tensor=2))
    packed = pipe.pack(params, specs)
    batch = jax.device_put(model.make_batch(8), pipe.batch_sharding)
    with pytest.raises(
        ValueError,
        match=r"stage 1 returns an output that differs between the "
        r"devices of 'tensor'.*to=\"invarying\"",
    ):
        pipe.value_and_grad(packed, batch)


_USER_MODEL = '''
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jpipe.testing import CheckModel


def build(num_stages):
    """A user's row-split MLP stages, checked against themselves under jax.shard_map."""
    rng = np.random.default_rng(0)

    def make_stage(last):
        def stage(params, x, inputs):
            x = inputs["x"] if x is None else x
            x = x + lax.psum(jnp.tanh(x @ params["w1"]) @ params["w2"], "tensor")
            return jnp.mean((x - inputs["y"]) ** 2) if last else x

        return stage

    stages = tuple(make_stage(s == num_stages - 1) for s in range(num_stages))
    params = [
        {"w1": rng.normal(size=(4, 8)).astype(np.float32) * 0.3,
         "w2": rng.normal(size=(8, 4)).astype(np.float32) * 0.3}
        for _ in range(num_stages)
    ]
    specs = [{"w1": P(None, "tensor"), "w2": P("tensor", None)}] * num_stages

    def make_batch(rows, seed=1):
        r = np.random.default_rng(seed)
        return {"x": r.normal(size=(rows, 4)).astype(np.float32),
                "y": r.normal(size=(rows, 4)).astype(np.float32)}

    return CheckModel(stages, params, make_batch, specs)
'''


@pytest.mark.slow
def test_the_checker_runs_a_users_own_stages(tmp_path, capsys):
    import json

    from jpipe import check

    path = tmp_path / "my_model.py"
    path.write_text(_USER_MODEL)
    argv = ["zb_h1", "-r", "2", "-m", "4", "--tensor", "2", "--fsdp", "2", "--model"]
    assert check.main([*argv, f"{path}:build", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["tensor"], result["fsdp"], result["model"]) == (2, 2, f"{path}:build")
    assert result["passed"] and result["max_rel_err"] <= RTOL
    assert check.main(["1f1b", "-r", "3", "-m", "4", "--tensor", "2", "--model", "tensor:mlp"]) == 0
    assert "x 2 tensor" in capsys.readouterr().out
    assert check.main(["1f1b", "-r", "2", "-m", "4", "--model", "tensor:conv"]) == 2
    assert "unknown block 'conv'" in capsys.readouterr().err
    assert check.main(["1f1b", "-r", "2", "-m", "4", "--model", f"{tmp_path}/none.py:f"]) == 2
    assert "model file" in capsys.readouterr().err


@pytest.mark.slow
def test_a_stage_may_average_over_the_batch_axes():
    # Cross-replica statistics: the middle stages centre their activations
    # on the mean over the microbatch's rows, which data and fsdp split:
    # lax.pmean over both. The reference centres on each whole microbatch.
    model = testing.tensor_model(4, "mlp")

    def centred(axes):
        def stage(params, x, inputs):
            mean = x.mean(axis=(0, 1))
            return jnp.tanh((x - (lax.pmean(mean, axes) if axes else mean)) @ params["w"])

        return stage

    middle = {"w": np.eye(8, dtype=np.float32) * 0.9}
    params = [model.params[0], middle, middle, model.params[3]]
    specs = [model.specs[0], {"w": None}, {"w": None}, model.specs[3]]
    M = 4
    batch = model.make_batch(M * 2 * 4)
    reference = (model.reference[0], centred(()), centred(()), model.reference[3])
    want = jpipe.reference_value_and_grad(reference, params, batch, M)
    for axes in ({"data": 2}, {"data": 2, "fsdp": 2}):
        stages = (model.stages[0], centred(tuple(axes)), centred(tuple(axes)), model.stages[3])
        schedule = jpipe.get_schedule("interleaved_1f1b", 2, M)
        pipe = jpipe.Pipeline(stages, schedule, jpipe.make_mesh(2, **axes))
        packed = pipe.pack(params, specs)
        loss, grads = pipe.value_and_grad(packed, jax.device_put(batch, pipe.batch_sharding))
        assert testing.compare((loss, pipe.unpack(grads)), want)[1] <= RTOL, axes


@pytest.mark.slow
def test_ranks_of_different_tensor_degrees_train_as_the_whole_model():
    """Rank 0 on one device (tensor 1), ranks 1 and 2 on tensor-parallel pairs (5 devices).

    The per-rank lowering with one mesh per rank: each stage's arrays are split
    over its own rank's tensor degree, activations and their gradients are
    regrouped between the shapes, and SGD applied per rank for 3 steps gives
    the losses, gradients and parameters of the whole, unsplit, unpipelined model trained
    the same way (float32).
    """
    import optax

    meshes = jpipe.make_rank_meshes([{"tensor": 1}, {"tensor": 2}, {"tensor": 2}])
    assert [dict(m.shape)["tensor"] for m in meshes] == [1, 2, 2]
    model = models.make_stages(CONFIG, (1, 2, 1), tensor_axis="tensor")
    params = model.init(0)
    schedule = jpipe.get_schedule("1f1b", 3, 4)
    pipe = jpipe.Pipeline(model.stages, schedule, meshes, lowering="mpmd")
    packed = pipe.pack(params, gpt.tensor_specs(CONFIG, params))
    # Each rank holds only its own stages' arrays, split by its own degree:
    # a qkv kernel [16, 48] whole on rank 0's device, in column halves on rank 1's.
    qkv = [b for b in packed[0] if b.startswith("float32[16x48]")]
    assert qkv and [b for b in packed[1] if b.startswith("float32[16x48]")]
    assert {packed[0][b].addressable_shards[0].data.shape for b in qkv} == {(1, 16, 48)}
    assert {packed[1][b].addressable_shards[0].data.shape for b in packed[1] if "16x48" in b} == {
        (1, 16, 24)
    }
    assert not set(packed[0]) & {b for b in pipe.layout.buckets if b not in packed[0]}

    # Plain SGD with momentum, per rank (an update linear in the gradients, so the
    # parameters stay within float32 of the reference's; Adam's first steps
    # divide near-zero gradients by their own size).
    optimizer = optax.sgd(0.5, momentum=0.9)
    update = jax.jit(lambda g, state: optimizer.update(g, state))
    states = [optimizer.init(p) for p in packed]  # per rank: on its own devices
    whole = models.make_stages(CONFIG, (1, 2, 1))
    reference, ref_state = params, optimizer.init(params)
    losses = []
    for step in range(3):
        batch = models.example_batch(CONFIG, batch_size=8, seed=step)
        loss, grads = pipe.value_and_grad(packed, batch)
        assert isinstance(grads, list) and [set(g) for g in grads] == [set(p) for p in packed]
        want = jpipe.reference_value_and_grad(whole.stages, reference, batch, 4)
        _, rel = testing.compare((loss, pipe.unpack(grads)), want)
        assert rel <= RTOL, (step, rel)
        for r in range(3):
            updates, states[r] = update(grads[r], states[r])
            packed[r] = optax.apply_updates(packed[r], updates)
        updates, ref_state = optimizer.update(want[1], ref_state)
        reference = optax.apply_updates(reference, updates)
        _, rel = testing.compare(pipe.unpack(packed), reference)
        assert rel <= RTOL, (step, rel)
        losses.append(float(loss))
    assert losses[-1] < losses[0]  # it trains


@pytest.mark.slow
def test_rank_meshes_are_checked():
    model = models.make_stages(CONFIG, (2, 2), tensor_axis="tensor")
    schedule = jpipe.get_schedule("1f1b", 2, 4)
    meshes = jpipe.make_rank_meshes([{"tensor": 1}, {"tensor": 2}])
    with pytest.raises(ValueError, match="needs the per-rank lowering: pass lowering='mpmd'"):
        jpipe.Pipeline(model.stages, schedule, meshes)
    with pytest.raises(ValueError, match="got 1 rank meshes for a schedule of 2 ranks"):
        jpipe.Pipeline(model.stages, schedule, meshes[:1], lowering="mpmd")
    data = jpipe.make_rank_meshes([{"data": 1}, {"data": 2}])
    with pytest.raises(ValueError, match="rank 1's mesh has data=2, rank 0's 1"):
        jpipe.Pipeline(model.stages, schedule, data, lowering="mpmd")
    with pytest.raises(ValueError, match="device .* is in the meshes of ranks 0 and 1"):
        jpipe.Pipeline(model.stages, schedule, [meshes[0], meshes[0]], lowering="mpmd")
    with pytest.raises(ValueError, match="accepted: data, fsdp, tensor"):
        jpipe.make_rank_meshes([{"pipe": 2}])
    pipe = jpipe.Pipeline(model.stages, schedule, meshes, lowering="mpmd")
    with pytest.raises(ValueError, match="Pipeline.packed_shapes makes the packed"):
        pipe.packed_shapes(model.init(0))
    # init makes each rank's own buckets on its own mesh, as pack places them.
    key = jax.random.key(5)
    specs = gpt.tensor_specs(CONFIG, jax.eval_shape(model.init, key))
    made, packed = pipe.init(model.init, key, specs), pipe.pack(model.init(key), specs)
    assert [set(m) for m in made] == [set(p) for p in packed]
    for m, p in zip(made, packed):
        for name, array in p.items():
            assert m[name].sharding == array.sharding, name
            np.testing.assert_array_equal(np.asarray(m[name]), np.asarray(array))
    # BPipe's eviction from rank 0 to rank 3, of another shape, is refused by name.
    four = models.make_stages(CONFIG, (1, 1, 1, 1), tensor_axis="tensor")
    bpipe = jpipe.get_schedule("1f1b_bpipe", 4, 4)
    assert any(r == 0 and a.kind == "EVICT" and a.partner == 3 for r, _, a in bpipe.all_actions())
    shapes = [{"tensor": 1}, {"tensor": 1}, {"tensor": 1}, {"tensor": 2}]
    evicting = jpipe.Pipeline(four.stages, bpipe, jpipe.make_rank_meshes(shapes), lowering="mpmd")
    params = four.init(0)
    packed = evicting.pack(params, gpt.tensor_specs(CONFIG, params))
    batch = models.example_batch(CONFIG, batch_size=8, seed=0)
    with pytest.raises(ValueError, match="evict to a rank of the same shape"):
        evicting.value_and_grad(packed, batch)
