"""A GPT-3 XL-sized model (1.42B parameters) for one host of 8 GPUs: pipe 2 x fsdp 2 x tensor 2.

Command line (one host, 8 accelerators):

  python train.py --config=configs/gpt_1b_8gpu.py --workdir=/tmp/jpipe_gpt_1b

Sizes are GPT-3 XL's (Brown et al. 2020, table 2.1): 24 blocks, D = 2,048,
16 heads of 128, d_ff = 8,192 (4 D), L = 1,024 tokens per sequence, with
GPT-2's real 50,257-token vocabulary. That makes 1,416,552,448 parameters
(1.42B: 24 blocks of 50.36M = 1,208.6M, the token embedding and the untied
head, no bias, 102.9M each, positions 2.1M, the final LayerNorm 4,096; GPT-3's
"1.3B" has one matrix for both embedding and head). Computes in bfloat16;
parameters, gradients, Adam moments and the loss stay in float32.

The trainer's corpus is bytes (the standard library's source unless
``--config.data.path`` says otherwise), so only 256 of the 50,257 ids ever
occur: the vocabulary is real so that the memory is real (the embedding, the
head and its logits are most of the first and last stages' bytes), not for a
tokenizer, and the held-out loss of this run is a byte-level one.
``--config.data.tokenizer=bpe`` trains a BPE tokenizer of all 50,257 ids on
the training text instead (`jpipe.train.tokens`, no download), and the run
is on those tokens.

Where the 8 devices go (`jpipe.make_mesh`: pipe outermost, tensor innermost):

- ``tensor`` = 2, innermost, so its two devices are NVLink neighbours: each
  block is split Megatron-style (attention by heads, the MLP by its hidden
  width; `jpipe.models.gpt.tensor_specs`), which costs one all-reduce of a
  microbatch's activation after attention and one after the MLP, forward
  and backward: the most frequent collective, so it gets the fastest link.
  The embeddings, the head and the LayerNorms are not split by it.
- ``fsdp`` = 2: splits the batch's rows (like data parallelism) and every
  parameter, gradient and Adam moment (ZeRO-3). A stage's arrays are
  all-gathered just before each of its pieces runs and its weight gradients
  reduce-scattered: more traffic than plain data parallelism, for half the
  bytes held per device.
- ``pipe`` = 2, outermost: 12 blocks per stage; it only sends one
  microbatch's activation (and its gradient) between neighbours, the least
  of the three, so it is the axis that could cross hosts later.

Batch: microbatches of 4 sequences per fsdp shard (8 per microbatch), M = 16
microbatches (1F1B's bubble on 2 ranks is (R - 1) / (M + R - 1) = 1/17), so
a step sees 128 sequences = 131,072 tokens. Four sequences per device keep a
microbatch's activations (its attention scores and, on the last stage, its
[4, 1024, 50257] logits) within bounds; a larger M only lengthens the step
(the residual buffers are sized by the schedule's in-flight microbatches, 2
on the first rank here, not by M: docs/compiler-measurements.md).

Memory: the step compiled, not run, on 8 fake CPU devices (`python -m
bench.mesh_memory`, docs/compiler-measurements.md, "An 8-GPU host") holds
per device 0.76 GiB of parameters, 1.52 GiB of Adam state and 39.58 GiB of
temporaries as XLA's CPU compiler sizes them (the schedule needs 23.19 GiB
on the first rank): about 42 GiB, for 80 GB accelerators.

Expected result: not yet measured on accelerators.
"""

import pathlib

import ml_collections

from jpipe.train.config import config_from_file

_DEFAULT = pathlib.Path(__file__).with_name("default.py")


def get_config() -> ml_collections.ConfigDict:
    """The 8-GPU GPT-3 XL config: configs/default.py with these fields changed."""
    config = config_from_file(_DEFAULT)

    # Pipeline.
    config.schedule = "1f1b"
    config.num_microbatches = 16  # M; must divide batch_size / (mesh.data * mesh.fsdp)

    # Devices: 2 x 1 x 2 x 2 = 8 (see the docstring for why this order).
    config.mesh.pipe = 2
    config.mesh.data = 1
    config.mesh.fsdp = 2
    config.mesh.tensor = 2

    # Run length and reporting.
    config.steps = 2000  # optimizer steps
    config.eval_every = 200  # steps between held-out evaluations (and one at the end)
    config.checkpoint_every = 500  # steps between checkpoints (and one at the end)

    # Data: bytes (256 of the vocabulary's ids).
    config.batch_size = 128  # sequences: 16 microbatches x 2 fsdp shards x 4
    config.data.max_bytes = 0  # read at most this much of the corpus; 0 = all of it
    config.data.eval_fraction = 0.05  # the last this share of the corpus's bytes is held out

    # Model: GPT-3 XL's sizes, GPT-2's vocabulary.
    config.model.vocab_size = 50257  # GPT-2's BPE vocabulary; the byte corpus uses 256 ids
    config.model.seq_len = 1024  # L, tokens per sequence
    config.model.num_layers = 24  # transformer blocks over all stages
    config.model.num_heads = 16  # attention heads; must divide d_model (and by mesh.tensor)
    config.model.d_model = 2048  # D, model width
    config.model.d_ff = 8192  # MLP hidden width, 4 D
    config.model.dtype = "bfloat16"  # compute dtype: "float32", "bfloat16" or "float16"

    # Optimizer (GPT-3 XL's peak rate and warm-up share, scaled to this run's length).
    config.optimizer.learning_rate = 2e-4  # peak learning rate, reached after warm-up
    config.optimizer.warmup_steps = 200  # linear warm-up from 0

    return config
