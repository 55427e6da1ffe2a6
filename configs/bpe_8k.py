"""The default run on BPE tokens: an 8,192-token vocabulary trained here, no download.

Command line:

  python train.py --config=configs/bpe_8k.py --workdir=runs/bpe_8k

configs/default.py (the same GPT: 8 blocks, width 64; 4-rank 1F1B x 2-way
data on 8 fake CPU devices; the standard library's source, 90/10) with
``data.tokenizer="bpe"``: a byte-level BPE tokenizer of ``model.vocab_size``
= 8,192 tokens is trained on the training 90% (`jpipe.train.tokens`, the
`tokenizers` package, about 2 s), both parts are encoded with it (about 3.8
bytes a token), and Grain serves the windows. The embedding and the head
grow to 8,192 rows, so the model has 1.45M parameters.

Expected result: the held-out loss, in nats per token, falls from 9.02
(uniform over 8,192 tokens: ln 8192 = 9.01) to 5.17 after 300 steps
(9.0242, 6.4185, 5.6941, 5.4640, 5.3169, 5.2110, 5.1745 every 50 steps,
measured on Python 3.11 with jax 0.10.2; docs/bpe_8k.png draws them). A
step's 64 tokens a row hold about 3.8 times the text of the byte model's
64 bytes, and each step costs more (the 8,192-way head): a median step of
1.13 s, 412 s in all, on a 2-core CPU shared with other work.
"""

import pathlib

import ml_collections

from jpipe.train.config import config_from_file

_DEFAULT = pathlib.Path(__file__).with_name("default.py")


def get_config() -> ml_collections.ConfigDict:
    """configs/default.py with BPE tokens."""
    config = config_from_file(_DEFAULT)
    config.data.tokenizer = "bpe"  # a BPE tokenizer of model.vocab_size tokens, trained here
    config.model.vocab_size = 8192  # the BPE vocabulary
    return config
