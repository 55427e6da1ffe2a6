"""A GPT-2-small-sized byte-level model, for accelerators.

Command line (8 accelerators, 4-rank pipeline x 2-way data):

  python train.py --config=configs/gpt2_small.py --workdir=/tmp/jpipe_gpt2_small

Sizes are GPT-2 small's (12 layers, 12 heads, D = 768, L = 1024) except the
vocabulary: 256 bytes instead of GPT-2's 50,257 BPE tokens, so there is no
tokenizer to download (``--config.data.tokenizer=bpe
--config.model.vocab_size=50257`` trains one here instead, on the training
text, `jpipe.train.tokens`); that makes 86.2M parameters (21-22M per stage with the
balanced 3,3,3,3 split). Computes in bfloat16, parameters and loss in float32.

Expected result: not yet measured on accelerators. Each step sees 131,072
tokens, so 2,000 steps are about 9 passes over the 30 MiB standard library
corpus (Python 3.11): expect the held-out loss to fall well below the default
run's and then flatten or turn up as the model memorizes. Point
``--config.data.path`` at a larger text collection for a longer run.
"""

import pathlib

import ml_collections

from jpipe.train.config import config_from_file

_DEFAULT = pathlib.Path(__file__).with_name("default.py")


def get_config() -> ml_collections.ConfigDict:
    """The GPT-2-small config: configs/default.py with these fields changed."""
    config = config_from_file(_DEFAULT)

    config.num_microbatches = 16  # M; must divide batch_size / mesh.data

    # Run length and reporting.
    config.steps = 2000  # optimizer steps
    config.eval_every = 200  # steps between held-out evaluations (and one at the end)
    config.checkpoint_every = 500  # steps between checkpoints (and one at the end)

    # Data: bytes, so the vocabulary is 256.
    config.batch_size = 128  # global batch, in sequences of model.seq_len tokens
    config.data.max_bytes = 0  # read at most this much of the corpus; 0 = all of it
    config.data.eval_fraction = 0.05  # the last this share of the corpus's bytes is held out

    # Model: GPT-2 small's sizes (GPT-2 itself has 50,257 BPE tokens).
    config.model.seq_len = 1024  # L, tokens per sequence
    config.model.num_layers = 12  # transformer blocks over all stages
    config.model.num_heads = 12  # attention heads; must divide d_model
    config.model.d_model = 768  # D, model width
    config.model.d_ff = 3072  # MLP hidden width, 4 D
    config.model.dtype = "bfloat16"  # compute dtype: "float32", "bfloat16" or "float16"

    # Optimizer.
    config.optimizer.learning_rate = 6e-4  # peak learning rate, reached after warm-up
    config.optimizer.warmup_steps = 200  # linear warm-up from 0

    return config
