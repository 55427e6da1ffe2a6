"""Llama-3-8B at its real sizes on 8 devices of 80 GB: pipe 4 x tensor 2, sequence 8,192.

Command lines (one host of 8 accelerators; compile-only on any machine):

  python train.py --config=configs/llama3_8b.py --workdir=/tmp/jpipe_llama3_8b
  python train.py --config=configs/llama3_8b.py --config.compile_only=True
  python train.py --config=configs/llama3_8b.py --config.compile_only=True --config.lowering=mpmd

Sizes are Llama-3-8B's: 32 blocks, D = 4,096, 32 query heads of 128 and 8
key/value heads, SwiGLU of width 14,336, rotary base 500,000, the
128,256-token vocabulary (its size: the tokenizer is a BPE of as many tokens
trained here on the training text, `jpipe.train.tokens`; Llama 3's own
would be a download), an untied head. Computes in bfloat16; parameters,
gradients, AdamW's moments, the norms and the loss stay in float32. What
makes it fit: blockwise (flash-style) attention that never holds the
8,192 x 8,192 scores, each block recomputed in the backward from its input
(``remat="full"``), the head's logits recomputed (``remat_logits``), the
embedding and the head split by vocabulary rows over ``tensor``
(``vocab_split``) and the activations between the split matmuls split along
the sequence (``sequence_parallel``).

Mesh: ``tensor`` = 2 innermost (each block split by heads, 16 query and 4
key/value heads a device, and the MLP by its width), ``pipe`` = 4 (8 blocks
a stage; the embedding on the first, the head on the last). 1F1B, 16
microbatches of one 8,192-token sequence: 131,072 tokens a step; the bubble
on 4 ranks is 3/19.

Measured with ``--config.compile_only=True`` (the step compiled from shapes on
8 fake CPU devices, XLA:CPU's buffer assignment, jax 0.10.2, 2026-12-06;
docs/scale.md): 47.42 GB a device (44.2 GiB: 13.62 GB of arguments, 33.80 GB
of temp) under the SPMD lowering, which fits 80 GB; jpipe's byte model
predicts 48.00 GB. With ``--config.lowering=mpmd`` (each rank on a mesh of
its own, 2026-12-07): 43.17 GB on the fullest rank (the last; 13.62 GB of
arguments, 29.55 GB of its account), 34.9 to 39.1 GB on the others (ranks 1
and 2 hold only their own 10.47 GB of arguments); predicted 43.17 GB.

Not yet run on accelerators. ``--config.model.num_layers=4
--config.model.d_model=64 ...`` shrinks it to a model that compiles and
trains on a CPU in seconds with the same options (tests/test_compile_only.py).
"""

import pathlib

import ml_collections

from jpipe.train.config import config_from_file

_DEFAULT = pathlib.Path(__file__).with_name("default.py")


def get_config() -> ml_collections.ConfigDict:
    """Llama-3-8B: configs/default.py with these fields changed."""
    config = config_from_file(_DEFAULT)

    # Pipeline.
    config.schedule = "1f1b"
    config.num_microbatches = 16  # M; must divide batch_size / (mesh.data * mesh.fsdp)

    # Devices: 4 x 1 x 1 x 2 = 8.
    config.mesh.pipe = 4
    config.mesh.data = 1
    config.mesh.fsdp = 1
    config.mesh.tensor = 2

    # Run length and reporting.
    config.steps = 2000  # optimizer steps
    config.eval_every = 200  # steps between held-out evaluations (and one at the end)
    config.eval_batches = 2  # global batches per held-out evaluation
    config.checkpoint_every = 500  # steps between checkpoints (and one at the end)

    # Data: BPE tokens of the whole standard library's source.
    config.batch_size = 16  # sequences: 16 microbatches of one
    config.data.max_bytes = 0  # read at most this much of the corpus; 0 = all of it
    config.data.eval_fraction = 0.05  # the last this share of the corpus's bytes is held out
    config.data.tokenizer = "bpe"  # a BPE tokenizer of model.vocab_size tokens, trained here

    # Model: Llama-3-8B's sizes (jpipe.models.LlamaConfig).
    config.model = ml_collections.ConfigDict()
    config.model.name = "llama"
    config.model.vocab_size = 128256  # Llama 3's vocabulary size
    config.model.seq_len = 8192  # L, tokens per sequence (Llama 3's context)
    config.model.num_layers = 32  # decoder blocks over all stages
    config.model.num_heads = 32  # query heads; must divide d_model (and by mesh.tensor)
    config.model.num_kv_heads = 8  # key/value heads; must divide num_heads (and by mesh.tensor)
    config.model.d_model = 4096  # D, model width
    config.model.d_ff = 14336  # SwiGLU hidden width
    config.model.rope_theta = 500000.0  # rotary base (Llama 3's)
    config.model.norm_eps = 1e-5  # RMSNorm's epsilon
    config.model.dtype = "bfloat16"  # compute dtype: "float32", "bfloat16" or "float16"
    config.model.scan_layers = False  # run each stage's blocks in one nn.scan
    # Recompute the head's logits in the backward: [1, 8192, 128256] float32 logits are
    # 4.2 GB a microbatch otherwise.
    config.model.remat_logits = True
    config.model.attention = "blockwise"  # flash-style in plain JAX: no L x L scores
    config.model.attention_block = 512  # its tile (a divisor of seq_len)
    config.model.remat = "full"  # keep only each block's input; recompute the rest
    # Over tensor: the embedding and the head split by vocabulary rows (a cross-entropy
    # that never gathers the logits), and the activations between the split matmuls split
    # along the sequence (jpipe.models.vocab, jpipe.models.sequence).
    config.model.vocab_split = True
    config.model.sequence_parallel = True

    # Optimizer (Llama 3's peak rate for 8B, warm-up scaled to this run).
    config.optimizer.learning_rate = 3e-4  # peak learning rate, reached after warm-up
    config.optimizer.warmup_steps = 200  # linear warm-up from 0

    return config
