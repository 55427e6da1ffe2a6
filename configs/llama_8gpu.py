"""A Llama-style decoder of 1.11B parameters for one host of 8 GPUs: pipe 2 x fsdp 2 x tensor 2.

Command line (one host, 8 accelerators):

  python train.py --config=configs/llama_8gpu.py --workdir=/tmp/jpipe_llama

Sizes are Llama 3.2 1B's (16 blocks, D = 2,048, 32 query heads of 64 and 8
key/value heads, SwiGLU of width 8,192, rotary base 500,000) with an untied
head and a 32,768-token BPE vocabulary trained here on the training text
(`jpipe.train.tokens`; Llama 3's own 128K tokenizer would be a download).
That makes 1,107,363,840 parameters: 16 blocks of 60.82M (attention
2 x 4.19M for the query and output projections and 2 x 1.05M for keys and
values; the MLP 3 x 16.78M; two norms), the embedding and the head 67.1M
each, the final norm 2,048. L = 2,048 tokens per sequence. Computes in
bfloat16; parameters, gradients, Adam moments, the norms and the loss stay
in float32.

Where the 8 devices go, as for configs/gpt_1b_8gpu.py (which says why):
``tensor`` = 2 innermost (each block split by heads, 16 query and 4
key/value heads a device, the same groups, and the MLP by its width: one
all-reduce after attention and one after the MLP), ``fsdp`` = 2 (the batch
and every array split, ZeRO-3), ``pipe`` = 2 outermost (8 blocks a stage).

Batch: 16 microbatches of 2 sequences per fsdp shard, 64 sequences =
131,072 tokens a step; 1F1B's bubble on 2 ranks is 1/17.

Expected result: not yet measured on accelerators; the stages are checked
exact against the unpipelined model on CPU at small sizes
(tests/test_llama.py), and tests/test_llama.py checks this config's
parameter count from its shapes.
"""

import pathlib

import ml_collections

from jpipe.train.config import config_from_file

_DEFAULT = pathlib.Path(__file__).with_name("default.py")


def get_config() -> ml_collections.ConfigDict:
    """The 8-GPU Llama config: configs/default.py with these fields changed."""
    config = config_from_file(_DEFAULT)

    # Pipeline.
    config.schedule = "1f1b"
    config.num_microbatches = 16  # M; must divide batch_size / (mesh.data * mesh.fsdp)

    # Devices: 2 x 1 x 2 x 2 = 8 (configs/gpt_1b_8gpu.py says why this order).
    config.mesh.pipe = 2
    config.mesh.data = 1
    config.mesh.fsdp = 2
    config.mesh.tensor = 2

    # Run length and reporting.
    config.steps = 2000  # optimizer steps
    config.eval_every = 200  # steps between held-out evaluations (and one at the end)
    config.checkpoint_every = 500  # steps between checkpoints (and one at the end)

    # Data: BPE tokens of the whole standard library's source.
    config.batch_size = 64  # sequences: 16 microbatches x 2 fsdp shards x 2
    config.data.max_bytes = 0  # read at most this much of the corpus; 0 = all of it
    config.data.eval_fraction = 0.05  # the last this share of the corpus's bytes is held out
    config.data.tokenizer = "bpe"  # a BPE tokenizer of model.vocab_size tokens, trained here

    # Model: Llama 3.2 1B's sizes (jpipe.models.LlamaConfig).
    config.model = ml_collections.ConfigDict()
    config.model.name = "llama"
    config.model.vocab_size = 32768  # the BPE vocabulary
    config.model.seq_len = 2048  # L, tokens per sequence
    config.model.num_layers = 16  # decoder blocks over all stages
    config.model.num_heads = 32  # query heads; must divide d_model (and by mesh.tensor)
    config.model.num_kv_heads = 8  # key/value heads; must divide num_heads (and by mesh.tensor)
    config.model.d_model = 2048  # D, model width
    config.model.d_ff = 8192  # SwiGLU hidden width
    config.model.rope_theta = 500000.0  # rotary base (Llama 3's)
    config.model.norm_eps = 1e-5  # RMSNorm's epsilon
    config.model.dtype = "bfloat16"  # compute dtype: "float32", "bfloat16" or "float16"
    config.model.scan_layers = False  # run each stage's blocks in one nn.scan
    # Recompute the head's logits in the backward: [2, 2048, 32768] float32 logits are
    # 0.5 GiB a microbatch otherwise.
    config.model.remat_logits = True

    # Optimizer (Llama 3's peak rate for its 1B size, warm-up scaled to this run).
    config.optimizer.learning_rate = 3e-4  # peak learning rate, reached after warm-up
    config.optimizer.warmup_steps = 200  # linear warm-up from 0

    return config
