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
import numpy as np
import pytest
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


@pytest.mark.parametrize("axes", [{"data": 2, "tensor": 2}, {"fsdp": 2, "tensor": 2}], ids=str)
def test_split_stages_equal_the_whole_model(axes):
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
        pipe = jpipe.Pipeline(model.stages, schedule, mesh)
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
    with pytest.raises(ValueError, match="needs 16 devices"):
        jpipe.make_mesh(2, 2, fsdp=2, tensor=2)
    with pytest.raises(ValueError, match="at least 1"):
        jpipe.make_mesh(2, tensor=0)
    np.testing.assert_equal(jpipe.make_mesh(4).devices.shape, (4, 1, 1, 1))


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
