"""The embedding and the head split over the vocabulary on ``tensor`` (``vocab_split``).

Each tensor device holds V/T rows of the embedding and V/T columns of the
head, and the cross-entropy never gathers the logits (`jpipe.models.vocab`).
Exactness is float32 (1e-5 relative, as everywhere) against the unpipelined,
unsplit model: the vocabulary's softmax sum is taken in T parts, which moves
the figures by about 1e-7. Do not loosen the tolerances.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jpipe
from jpipe import models, testing
from jpipe.models import gpt, llama, vocab

pytestmark = pytest.mark.slow  # each test compiles a pipeline of a split model

RTOL = 1e-5

LLAMA = models.LlamaConfig(
    vocab_size=32, seq_len=8, num_layers=4, num_heads=4, num_kv_heads=2, d_model=16, d_ff=32
)
GPT = gpt.GPTConfig(vocab_size=32, num_layers=4, d_model=16, num_heads=2, seq_len=8, d_ff=32)


def _with(config, **changes):
    return type(config)(**{**config.__dict__, **changes})


def _weighted(batch):
    keep = np.array([8, 5, 8, 3, 8, 1, 6, 8])[: len(batch["tokens"])]
    weights = (np.arange(batch["tokens"].shape[1])[None, :] < keep[:, None]).astype(np.float32)
    return {**batch, "weights": weights}


def pipelined_against_the_model(name, config, batch, schedule="zb_h1", lowering="spmd"):
    """The loss and every gradient of `config` pipelined over pipe 2 x tensor 2, against
    `jax.value_and_grad` of the plain model (no split, no remat, dense attention)."""
    built = jpipe.get_schedule(schedule, 2, 4)
    stages = built.num_stages
    model = models.build_model(name, models.BuildArgs(config, stages, tensor_axis="tensor"))
    params = model.init(0)
    pipe = jpipe.Pipeline(model.stages, built, jpipe.make_mesh(2, tensor=2), lowering=lowering)
    packed = pipe.pack(params, model.specs(params))
    got = pipe.value_and_grad(packed, jax.device_put(batch, pipe.batch_sharding))
    plain = _with(
        config,
        vocab_split=False,
        sequence_parallel=False,
        attention="xla",
        remat="none",
        remat_logits=False,
        logit_chunks=1,
    )
    whole = models.build_model(name, models.BuildArgs(plain, stages))
    # The plain model's head is dense [D, V]; the split one stores it [V, D].
    want = jpipe.reference_value_and_grad(whole.stages, vocab.head_as_kernel(params), batch)
    _, rel = testing.compare((got[0], vocab.head_as_kernel(pipe.unpack(got[1]))), want)
    assert rel <= RTOL, rel


def test_the_split_lookup_and_cross_entropy_equal_the_whole_ones_with_their_gradients():
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    keys = jax.random.split(jax.random.key(0), 4)
    logits = 3 * jax.random.normal(keys[0], (2, 5, 12))
    targets = jax.random.randint(keys[1], (2, 5), 0, 12)
    table = jax.random.normal(keys[2], (12, 3))
    w = jax.random.normal(keys[3], (2, 5))

    def split(logits, table):
        def body(logits, table, targets):
            losses = vocab.vocab_cross_entropy(logits, targets, "tensor")
            x = vocab.vocab_embed(table, targets, "tensor")
            return (losses * w).sum() + (x * x).sum()

        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(None, None, "tensor"), P("tensor", None), P()),
            out_specs=P(),
        )(logits, table, targets)

    def whole(logits, table):
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        x = jnp.take(table, targets, axis=0)
        return (losses * w).sum() + (x * x).sum()

    got = jax.jit(jax.value_and_grad(split, (0, 1)))(logits, table)
    want = jax.value_and_grad(whole, (0, 1))(logits, table)
    _, rel = testing.compare(got, want)
    assert rel <= RTOL, rel


@pytest.mark.parametrize("module,config", [(llama, LLAMA), (gpt, GPT)], ids=["llama", "gpt"])
def test_specs_split_the_embedding_and_the_head_by_vocabulary_rows(module, config):
    params = module.make_stages(config, (2, 2)).init(0)
    off = module.tensor_specs(config, params)
    assert off[0]["embed"]["token"] == P() and off[1]["head"]["unembed"]["kernel"] == P()
    split = _with(config, vocab_split=True)
    split_params = module.make_stages(split, (2, 2)).init(0)
    table = split_params[0]["embed"]["token"]
    head = split_params[1]["head"]["unembed"]
    assert "kernel" not in head and head["embedding"].shape == table.shape  # stored [V, D]
    specs = module.tensor_specs(split, split_params)
    assert specs[0]["embed"]["token"] == P("tensor", None)
    assert specs[1]["head"]["unembed"]["embedding"] == P("tensor", None)
    rest = lambda s: [x for x in jax.tree.leaves(s) if x != P()]  # noqa: E731
    assert len(rest(specs)) == len(rest(off)) + 2  # the blocks' splits as before
    scanned = _with(config, vocab_split=True, scan_layers=True)
    stacked = module.tensor_specs(scanned, module.make_stages(scanned, (2, 2)).init(0))
    assert stacked[0]["embed"]["token"] == P("tensor", None)  # not stacked


@pytest.mark.parametrize("name,config", [("llama", LLAMA), ("gpt", GPT)])
def test_the_embedding_and_the_head_share_one_bucket_of_the_packed_parameters(name, config):
    # Stored [D, V] split by columns, the head would need a bucket of its
    # own, and the first rank a zero row of it (the last rank one of the
    # embedding's): V * D / T elements of padding each.
    split = _with(config, vocab_split=True)
    model = models.build_model(name, models.BuildArgs(split, 2, tensor_axis="tensor"))
    params = model.init(0)
    pipe = jpipe.Pipeline(
        model.stages, jpipe.get_schedule("1f1b", 2, 4), jpipe.make_mesh(2, tensor=2)
    )
    pipe.pack(params, model.specs(params))
    layout = pipe.layout

    def bucket(stage, *names):
        leaves = jax.tree_util.tree_leaves_with_path(params[stage])
        paths = [jax.tree_util.keystr(p) for p, _ in leaves]
        return layout.leaves[stage][paths.index("".join(f"['{n}']" for n in names))][0]

    assert bucket(0, "embed", "token") == bucket(1, "head", "unembed", "embedding")
    padded = layout.padding["held"] - layout.padding["used"]  # elements, all ranks' rows
    assert padded < split.vocab_size * split.d_model, padded  # it was 2 V D


@pytest.mark.parametrize("lowering", jpipe.LOWERINGS)
def test_llama_split_over_the_vocabulary_with_the_iw_split_equals_the_model(lowering):
    config = _with(
        LLAMA,
        vocab_split=True,
        attention="blockwise",
        attention_block=4,
        remat="dots",
        remat_logits=True,
    )
    pipelined_against_the_model(
        "llama", config, models.example_batch(GPT, 8, seed=3), lowering=lowering
    )


def test_llama_split_over_the_vocabulary_in_logit_chunks_with_token_weights():
    config = _with(LLAMA, vocab_split=True, logit_chunks=2, remat="full")
    batch = _weighted(models.example_batch(GPT, 8, seed=4))
    pipelined_against_the_model("llama", config, batch)


def test_gpt_split_over_the_vocabulary_equals_the_model():
    config = _with(GPT, vocab_split=True, attention="blockwise", attention_block=4, remat="full")
    pipelined_against_the_model("gpt", config, models.example_batch(GPT, 8, seed=5), "zbv", "mpmd")


def test_the_head_keeps_a_vocabulary_slice_of_the_logits():
    # Without remat_logits the head's backward keeps the softmax of its
    # logits: with the split, each device keeps its V/T columns of it.
    batch = models.example_batch(GPT, 8, seed=3)

    def widest(config):
        model = models.build_model("llama", models.BuildArgs(config, 2, tensor_axis="tensor"))
        pipe = jpipe.Pipeline(
            model.stages, jpipe.get_schedule("1f1b", 2, 4), jpipe.make_mesh(2, tensor=2)
        )
        pipe.pack(model.init(0), model.specs(model.init(0)))
        head = pipe.stage_kernels(batch)[-1]
        return max(a.size for a in head.res_avals)

    assert widest(_with(LLAMA, vocab_split=True)) * 2 == widest(LLAMA)


def test_a_vocabulary_the_axis_does_not_divide_is_refused():
    config = _with(LLAMA, vocab_size=33, vocab_split=True)
    model = models.build_model("llama", models.BuildArgs(config, 2, tensor_axis="tensor"))
    params = model.init(0)
    pipe = jpipe.Pipeline(
        model.stages, jpipe.get_schedule("1f1b", 2, 4), jpipe.make_mesh(2, tensor=2)
    )
    with pytest.raises(ValueError, match=r"\['embed'\]\['token'\].* cannot be split 2 ways"):
        pipe.pack(params, model.specs(params))
