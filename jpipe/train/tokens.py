"""Text as BPE tokens: a tokenizer trained locally, batches loaded with Grain.

``config.data.tokenizer = "bpe"`` trains a byte-level BPE tokenizer (the
`tokenizers` package; nothing is downloaded) on the training part of the
corpus that `jpipe.train.data` reads (the standard library's source, or
``config.data.path``), with ``config.model.vocab_size`` tokens, and encodes
both parts with it. The held-out part never takes part in the training of
the tokenizer. Training is deterministic, so every process (and every run
on the same text) gets the same merges without passing a file around;
`train_bpe` returns a `tokenizers.Tokenizer` to save (``.save(path)``) or
look at.

The batches. A part's tokens are cut into non-overlapping windows of
``L + 1`` tokens (inputs the first L, targets the last L), served by a Grain
``MapDataset``: the windows, shuffled with the seed, repeated epoch after
epoch (each epoch in another order). Sample ``j`` of the run is the
dataset's element ``j``, and the batch of step ``k`` holds samples
``k * batch`` to ``(k + 1) * batch - 1``, each process reading only its
contiguous block of rows by random access. So `GrainBatches.batch_at` is a
pure function of the step, like `data.Batches.batch_at`: a resumed run sees
the batches an unbroken one saw, whatever the number of processes.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator

import numpy as np

_CHUNK = 1 << 16  # bytes of text handed to the tokenizer at a time


def _text_chunks(data: np.ndarray) -> Iterator[str]:
    """The bytes as text, in pieces cut after a newline (so no word or character is split)."""
    raw = memoryview(data)
    start = 0
    while start < len(data):
        stop = min(start + _CHUNK, len(data))
        if stop < len(data):
            newline = bytes(raw[start:stop]).rfind(b"\n")
            stop = start + newline + 1 if newline >= 0 else stop
        yield bytes(raw[start:stop]).decode("utf-8", errors="replace")
        start = stop


def train_bpe(data: np.ndarray, vocab_size: int):
    """A byte-level BPE tokenizer with `vocab_size` tokens, trained on the bytes `data`.

    Byte-level: the 256 byte values are the initial alphabet, so any text
    encodes without an unknown token.

    Returns:
      A `tokenizers.Tokenizer`.

    Raises:
      ValueError: `vocab_size` is below 256 + 1.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, numbers.Integral) or vocab_size <= 256:
        raise ValueError(
            f"model.vocab_size={vocab_size!r}: a byte-level BPE needs more than the 256 byte "
            "tokens, e.g. 8192"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_text_chunks(data), trainer)
    return tokenizer


def encode(tokenizer, data: np.ndarray) -> np.ndarray:
    """The token ids of the bytes `data`, as one ``int32`` array."""
    encoded = tokenizer.encode_batch(list(_text_chunks(data)))
    if not encoded:
        return np.zeros(0, np.int32)
    return np.concatenate([np.asarray(e.ids, np.int32) for e in encoded])


class _Windows:
    """Window `i` of a token array: tokens ``i * L`` to ``i * L + L`` (L + 1 of them)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(i) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


class GrainBatches:
    """Batches of token windows from one part of the corpus, indexed by step.

    Args:
      tokens: the part's token ids.
      seq_len: L.
      batch_size: rows of the global batch.
      seed: the order of the windows.
      name: what the part is called in error messages.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, name: str):
        import grain

        self.seq_len, self.batch_size, self.name = seq_len, batch_size, name
        windows = _Windows(tokens, seq_len)
        if len(windows) < batch_size:
            raise ValueError(
                f"the {name} part of the corpus has {len(tokens):,} tokens: {len(windows)} "
                f"windows of seq_len={seq_len}, but batch_size={batch_size} needs {batch_size}. "
                "Raise data.max_bytes (or data.eval_fraction for the eval part), point "
                "data.path at more text, or lower batch_size or seq_len"
            )
        self.num_windows = len(windows)
        self.dataset = grain.MapDataset.source(windows).shuffle(seed=seed).repeat(None)

    def batch_at(
        self, step: int, process_index: int = 0, process_count: int = 1
    ) -> dict[str, np.ndarray]:
        """This process's rows of the global batch of `step` (see the module docstring)."""
        if not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if process_count < 1 or self.batch_size % process_count:
            raise ValueError(
                f"batch_size={self.batch_size} must be divisible by the number of "
                f"processes ({process_count})"
            )
        rows = self.batch_size // process_count
        first = int(step) * self.batch_size + process_index * rows
        windows_Rx1pL = np.stack([self.dataset[j] for j in range(first, first + rows)])
        return {"tokens": windows_Rx1pL[:, :-1], "targets": windows_Rx1pL[:, 1:]}


def make_datasets(
    *,
    path: str,
    max_bytes: int,
    eval_fraction: float,
    vocab_size: int,
    seq_len: int,
    batch_size: int,
    seed: int,
) -> tuple[GrainBatches, GrainBatches]:
    """Reads and splits the corpus, trains the tokenizer on the training part, serves both.

    Arguments as `jpipe.train.data.make_datasets`'s, and `vocab_size` for
    the tokenizer (``config.model.vocab_size``).

    Returns:
      ``(train, eval)`` `GrainBatches`.
    """
    from jpipe.train import data as data_lib

    train, held_out = data_lib.split_corpus(data_lib.read_corpus(path, max_bytes), eval_fraction)
    tokenizer = train_bpe(train, vocab_size)
    return (
        GrainBatches(encode(tokenizer, train), seq_len, batch_size, seed, "train"),
        GrainBatches(encode(tokenizer, held_out), seq_len, batch_size, seed, "eval"),
    )
