"""Data sources: any function that gives batches, served to the loop by step.

``config.data.source`` names where the batches come from: ``""`` (the
default) for the text corpus of `jpipe.train.data` (bytes, or BPE tokens
with ``config.data.tokenizer="bpe"``), or a function, registered here
(`register_source`) or in a file (``"path/to/file.py:function"``). The
function is called as ``fn(args: DataArgs)`` and returns either

- an iterable of batches that starts at ``args.start_step``: each batch a
  dict of arrays whose leading axis is this process's ``args.rows`` rows of
  the global batch (all of it in a one-process run), the same keys and
  shapes every step; or
- an object with ``batch_at(step, process_index, process_count)`` that
  returns the same for any step (random access, like `data.Batches` or a
  Grain ``MapDataset`` batched by step).

Throughput. The trainer counts tokens per second only where the data says
how many tokens a row holds: the object the function returns may carry a
``tokens_per_row`` attribute (a positive int), or the config may state
``config.data.tokens_per_row``; otherwise it reports rows per second
(``rows_per_s``), never guessing from the batch's keys or shapes.

The loop asks for step after step; `SourceBatches` keeps the iterable's
iterator and calls the function again with a new ``start_step`` only when
asked for another step than the next one: when a run resumes from a
checkpoint (so the source must give, from ``start_step``, the batches an
unbroken run would have seen: a pure function of the seed and the step) and
at each evaluation, which reads the ``"eval"`` split from step 0.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from jpipe.models.registry import is_file_spec, load_function


class DataArgs(NamedTuple):
    """What a data source function gets.

    Attributes:
      config: ``config.data``'s fields (a `ml_collections.FrozenConfigDict`),
        the source's own options included.
      split: ``"train"`` or ``"eval"`` (held out: the loop reads its first
        ``config.eval_batches`` steps at every evaluation).
      batch_size: rows of the global batch.
      seed: ``config.seed``.
      start_step: the step the batches must start at (0, or where a run resumes).
      process_index, process_count: this process and how many share the batch.
      seq_len: the model's ``seq_len`` when its config has one, else None.
    """

    config: Any
    split: str
    batch_size: int
    seed: int
    start_step: int = 0
    process_index: int = 0
    process_count: int = 1
    seq_len: int | None = None

    @property
    def rows(self) -> int:
        """This process's rows of each batch: ``batch_size // process_count``."""
        return self.batch_size // self.process_count


Source = Callable[[DataArgs], Any]

_SOURCES: dict[str, Source] = {}


def register_source(name: str):
    """Registers ``fn(args: DataArgs)`` as ``config.data.source=name`` (a decorator)."""

    def register(fn: Source) -> Source:
        if name in _SOURCES and _SOURCES[name] is not fn:
            raise ValueError(f"a data source named {name!r} is already registered")
        _SOURCES[name] = fn
        return fn

    return register


def get_source(spec: str) -> Source:
    """The function `spec` names: a registered name or ``path/to/file.py:function``.

    Raises:
      ValueError: no such name, file or function.
    """
    if is_file_spec(spec):
        return load_function(spec, "config.data.source")
    if spec not in _SOURCES:
        names = ", ".join(sorted(_SOURCES)) or "none registered"
        raise ValueError(
            f"unknown data source {spec!r}: give path/to/file.py:function (a function of "
            f"jpipe.train.sources.DataArgs returning batches) or a registered name ({names})"
        )
    return _SOURCES[spec]


class SourceBatches:
    """A source function's batches, served by step (`batch_at`) as `data.Batches` are.

    Args:
      fn: the source function.
      args: its arguments, but for the step and the process (set per call).
      name: the source's name, for error messages.
    """

    def __init__(self, fn: Source, args: DataArgs, name: str):
        self.fn, self.args, self.name = fn, args, name
        self.batch_size = args.batch_size
        self._random_access = None  # the object with batch_at, once known
        self._stream: Iterator | None = None
        self._next = None  # (step, process_index, process_count) the stream gives next
        self.tokens_per_row: int | None = None  # as the returned object states, once opened

    def _open(self, step: int, process_index: int, process_count: int):
        args = self.args._replace(
            start_step=step, process_index=process_index, process_count=process_count
        )
        made = self.fn(args)
        stated = getattr(made, "tokens_per_row", None)
        if stated is not None:
            if not isinstance(stated, numbers.Integral) or isinstance(stated, bool) or stated < 1:
                raise ValueError(
                    f"config.data.source={self.name!r} returned an object whose tokens_per_row "
                    f"is {stated!r}; it must be a positive int (or absent: rows/s are reported)"
                )
            self.tokens_per_row = int(stated)
        if hasattr(made, "batch_at"):
            self._random_access = made
            return
        try:
            self._stream = iter(made)
        except TypeError:
            raise ValueError(
                f"config.data.source={self.name!r} returned a {type(made).__name__}; it must "
                "return an iterable of batches (dicts of arrays) or an object with "
                "batch_at(step, process_index, process_count)"
            ) from None
        self._next = (step, process_index, process_count)

    def batch_at(
        self, step: int, process_index: int = 0, process_count: int = 1
    ) -> dict[str, np.ndarray]:
        """This process's rows of the batch of `step`."""
        if self._random_access is None and self._next != (step, process_index, process_count):
            self._open(step, process_index, process_count)
        if self._random_access is not None:
            batch = self._random_access.batch_at(step, process_index, process_count)
        else:
            try:
                batch = next(self._stream)
            except StopIteration:
                self._next = None
                raise ValueError(
                    f"config.data.source={self.name!r} ({self.args.split}) ran out of batches "
                    f"at step {step}; give an endless iterable (itertools.count, "
                    "grain's repeat()) or lower config.steps"
                ) from None
            self._next = (step + 1, process_index, process_count)
        return self._check(batch, step, self.batch_size // process_count)

    def _check(self, batch, step: int, rows: int) -> dict[str, np.ndarray]:
        if not isinstance(batch, Mapping) or not batch:
            raise ValueError(
                f"config.data.source={self.name!r} gave a {type(batch).__name__} at step {step}; "
                "each batch must be a dict of arrays"
            )
        out = {}
        for key, value in batch.items():
            array = np.asarray(value)
            if array.ndim == 0 or array.shape[0] != rows:
                raise ValueError(
                    f"config.data.source={self.name!r}: batch[{key!r}] at step {step} has shape "
                    f"{array.shape}; its leading axis must be this process's {rows} rows "
                    f"(batch_size / process_count)"
                )
            out[key] = array
        return out
