"""Byte-level text, split deterministically, served as batches indexed by step.

The corpus. By default it is the Python standard library's own ``.py`` source
(every file under ``sysconfig.get_paths()["stdlib"]`` outside ``site-packages``
and ``dist-packages``), so there is nothing to download and it is real text.
The files are concatenated as raw bytes and cut off after ``max_bytes``.
``data.path`` replaces them with the user's own files: a comma-separated list of
files and directories, each directory contributing every file under it (hidden
names and ``__pycache__`` skipped). Tokens are bytes: the vocabulary is 256.

The files of a directory are read in the order of the SHA-256 of their paths
relative to it: a fixed shuffle, the same on every machine with the same
files. Alphabetical order would make the first ``max_bytes`` and the held-out
tail each one corner of the tree (for the standard library, the held-out part
would be mostly the generated codec tables of ``encodings/``).

The split. The last ``eval_fraction`` of the corpus's bytes are held out and the
rest is for training. Cutting by bytes rather than by file works for a single
file too, and neither part ever sees a window of the other.

The order. A part is cut into non-overlapping windows of ``L + 1`` bytes
(inputs are the first L, targets the last L). Epoch ``e`` visits every window
once, in an order drawn from ``(seed, e)``, with all window starts moved by a
shift also drawn from ``(seed, e)`` so that different epochs see different
cuts. Sample ``j`` of the run is window ``j mod W`` of epoch ``j div W``, and
the batch of step ``k`` is samples ``k * batch`` to ``(k + 1) * batch - 1``.
So `Batches.batch_at` is a pure function of the step: resuming at step k gives
exactly what a run that never stopped would have seen, and there is no
iterator state to save.

Several processes. ``batch_at(step, process_index, process_count)`` gives only
that process's rows of the global batch: the ``process_count`` equal,
contiguous blocks of rows, block ``process_index``. Each process computes its
own rows without reading the others'.

Memory. The corpus is held once, as ``uint8``; the parts are views of it. An
epoch's order is one int32 per window, ``4 / L`` bytes per corpus byte, and
only the last few epochs' orders are kept.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import numbers
import os
import sysconfig
from typing import Any

import jax
import numpy as np

VOCAB_SIZE = 256
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def corpus_files(path: str = "") -> list[str]:
    """The files a corpus is read from, in reading order.

    Args:
      path: ``""`` for the standard library's ``.py`` files, else a
        comma-separated list of files and directories.

    Returns:
      Absolute file paths.

    Raises:
      ValueError: a path does not exist, or no file was found.
    """
    if not path.strip():
        root = sysconfig.get_paths()["stdlib"]
        files = _walk(root, keep=lambda name: name.endswith(".py"))
        where = f"the standard library ({root})"
    else:
        files = []
        for item in (p.strip() for p in path.split(",")):
            if not item:
                continue
            if os.path.isfile(item):
                files.append(os.path.abspath(item))
            elif os.path.isdir(item):
                files.extend(_walk(item, keep=lambda name: not name.startswith(".")))
            else:
                raise ValueError(
                    f"data.path={path!r}: {item!r} is not a file or directory; give text "
                    f"files or directories, comma-separated, or '' for the standard library"
                )
        where = f"data.path={path!r}"
    if not files:
        raise ValueError(f"no text files found in {where}")
    return files


def _walk(root: str, keep) -> list[str]:
    """Files under `root` whose names pass `keep`, in the order of a hash of their paths."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if keep(name) and os.path.isfile(full):
                found.append(os.path.relpath(full, root).replace(os.sep, "/"))
    found.sort(key=lambda rel: (hashlib.sha256(rel.encode()).digest(), rel))
    return [os.path.abspath(os.path.join(root, rel)) for rel in found]


def read_corpus(path: str = "", max_bytes: int = 0) -> np.ndarray:
    """Reads the corpus as one ``uint8`` array.

    Args:
      path: ``""`` for the standard library's ``.py`` files, else a
        comma-separated list of files and directories (see `corpus_files`).
      max_bytes: keep only the first this many bytes; 0 keeps everything.

    Returns:
      The bytes of the files in order, concatenated, at most `max_bytes` long.

    Raises:
      ValueError: bad `path` or `max_bytes`, or the files are empty.
    """
    if not isinstance(max_bytes, numbers.Integral) or max_bytes < 0:
        raise ValueError(f"data.max_bytes must be a non-negative int (0 = all), got {max_bytes!r}")
    files = corpus_files(path)
    total = sum(os.path.getsize(f) for f in files)
    if max_bytes:
        total = min(total, int(max_bytes))
    corpus = np.empty(total, np.uint8)
    filled = 0
    for name in files:
        if filled == total:
            break
        with open(name, "rb") as f:
            # readinto straight into the array: no second copy of the corpus.
            while filled < total:
                read = f.readinto(memoryview(corpus)[filled:])
                if not read:
                    break
                filled += read
    if filled == 0:
        raise ValueError(f"the corpus from data.path={path!r} is empty")
    return corpus[:filled]


def split_corpus(corpus: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Holds out the last `eval_fraction` of the bytes.

    Returns:
      ``(train, eval)``, views of `corpus`.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(
            f"data.eval_fraction must be strictly between 0 and 1, got {eval_fraction!r}"
        )
    cut = len(corpus) - int(len(corpus) * eval_fraction)
    return corpus[:cut], corpus[cut:]


@dataclasses.dataclass(frozen=True, eq=False)
class Batches:
    """Batches of byte windows from one part of the corpus, indexed by step.

    Attributes:
      data: the part's bytes, ``uint8``.
      seq_len: L, tokens per row.
      batch_size: rows in the global batch.
      seed: fixes the order of every epoch.
      name: what the part is called in error messages.
    """

    data: np.ndarray
    seq_len: int
    batch_size: int
    seed: int
    name: str = "train"

    def __post_init__(self):
        for field in ("seq_len", "batch_size"):
            value = getattr(self, field)
            if not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.num_windows < self.batch_size:
            need = (self.batch_size + 1) * self.seq_len
            raise ValueError(
                f"the {self.name} part of the corpus has {len(self.data):,} bytes: "
                f"{max(self.num_windows, 0)} windows of seq_len={self.seq_len}, but "
                f"batch_size={self.batch_size} needs {self.batch_size} windows, at least "
                f"{need:,} bytes. Raise data.max_bytes (or data.eval_fraction for the "
                f"eval part), point data.path at more text, or lower batch_size or seq_len"
            )

    @property
    def num_windows(self) -> int:
        """W: windows per epoch (one window is L + 1 bytes, starts L apart)."""
        # Room for a shift of up to L - 1 plus the window's extra target byte.
        return (len(self.data) - self.seq_len) // self.seq_len

    def batch_at(
        self, step: int, process_index: int = 0, process_count: int = 1
    ) -> dict[str, np.ndarray]:
        """This process's rows of the global batch of `step`.

        Args:
          step: the training (or eval) step, from 0.
          process_index: which process is asking, from 0.
          process_count: how many processes share the batch; must divide
            `batch_size`.

        Returns:
          ``{"tokens": int32[rows, L], "targets": int32[rows, L]}`` with
          ``rows = batch_size // process_count``; targets are tokens shifted
          by one.
        """
        if not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if process_count < 1 or self.batch_size % process_count:
            raise ValueError(
                f"batch_size={self.batch_size} must be divisible by the number of "
                f"processes ({process_count})"
            )
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} not in [0, {process_count})")
        rows = self.batch_size // process_count
        first = int(step) * self.batch_size + process_index * rows
        samples = np.arange(first, first + rows, dtype=np.int64)
        epochs, windows = np.divmod(samples, self.num_windows)
        starts = np.empty(rows, np.int64)
        for epoch in np.unique(epochs):
            shift, order = _epoch_order(self.seed, int(epoch), self.num_windows, self.seq_len)
            here = epochs == epoch
            starts[here] = shift + order[windows[here]].astype(np.int64) * self.seq_len
        rows_Rx1pL = self.data[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return {"tokens": rows_Rx1pL[:, :-1], "targets": rows_Rx1pL[:, 1:]}


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, num_windows: int, seq_len: int) -> tuple[int, np.ndarray]:
    """The shift of every window start and the order of the windows in `epoch`."""
    rng = np.random.default_rng([seed, epoch])
    shift = int(rng.integers(seq_len))
    order = rng.permutation(num_windows)
    order = order.astype(np.int32 if num_windows < 2**31 else np.int64)
    order.flags.writeable = False
    return shift, order


def make_datasets(
    *,
    path: str,
    max_bytes: int,
    eval_fraction: float,
    seq_len: int,
    batch_size: int,
    seed: int,
) -> tuple[Batches, Batches]:
    """Reads and splits the corpus, and serves both parts.

    Args:
      path: ``config.data.path`` (``""`` = the standard library).
      max_bytes: ``config.data.max_bytes`` (0 = everything).
      eval_fraction: ``config.data.eval_fraction``, the share held out.
      seq_len: L.
      batch_size: the global batch.
      seed: fixes the order of the batches.

    Returns:
      ``(train, eval)``. Evaluate on ``eval.batch_at(i)`` for ``i`` in
      ``range(eval_batches)``: the same rows at every evaluation.
    """
    train, held_out = split_corpus(read_corpus(path, max_bytes), eval_fraction)
    return (
        Batches(train, seq_len, batch_size, seed, name="train"),
        Batches(held_out, seq_len, batch_size, seed, name="eval"),
    )


# ---------------------------------------------------------------------------
# Batches on devices.


def _process_rows(sharding, batch_size: int) -> tuple[int, int]:
    """Which block of the batch's rows this process's devices hold: ``(index, count)``."""
    shape = (batch_size, 1)
    spans = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows = index[0]
        spans.add((rows.start or 0, batch_size if rows.stop is None else rows.stop))
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    reached = lo
    for start, stop in sorted(spans):
        if start > reached:
            break
        reached = max(reached, stop)
    size = hi - lo
    if reached < hi or batch_size % size or lo % size:
        raise ValueError(
            f"this process's devices hold rows {sorted(spans)} of {batch_size}, which are not "
            "one of equal blocks; order the devices so each process's share of the data "
            "axis is contiguous"
        )
    return lo // size, batch_size // size


@dataclasses.dataclass(frozen=True)
class WithPositions:
    """`batches` with a ``positions`` leaf: each row's token positions, ``0 .. L-1``.

    For a sliced schedule (Seq1F1B): the pipeline hands each slice its own
    tokens of every leaf, and a model's stages read the slice's place in its
    sequence from its positions (`jpipe.models.StagedModel.carries`).
    """

    batches: Any

    @property
    def batch_size(self) -> int:
        return self.batches.batch_size

    def __getattr__(self, name):  # the rest is the wrapped batches'
        if name == "batches":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.batches, name)

    def batch_at(self, step: int, index: int = 0, count: int = 1) -> dict:
        out = self.batches.batch_at(step, index, count)
        rows, length = next(iter(out.values())).shape[:2]
        positions = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
        return {**out, "positions": np.array(positions)}


def device_batch(batches: Batches, step: int, sharding) -> dict:
    """The global batch of `step` on the devices, each process loading only its rows."""
    index, count = _process_rows(sharding, batches.batch_size)
    local = batches.batch_at(step, index, count)
    return {
        name: jax.make_array_from_process_local_data(
            sharding, rows, (batches.batch_size,) + rows.shape[1:]
        )
        for name, rows in local.items()
    }
