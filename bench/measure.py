"""Compiling, sizing and timing programs, fairly on a shared machine.

Every row is compiled the same way (``lowerable.lower(*args).compile()``,
tracing included) and sized from the compiled program's
`memory_analysis()`, which reports bytes per device.

Timing: the machine is shared and noisy, so rows that are compared are timed
together. After a warm-up call each, the repetitions are interleaved (one call
of every row, then the next round, the order rotating each round), so a burst
of load from elsewhere hits every row alike; the report takes the median.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax


@dataclasses.dataclass
class Compiled:
    """A compiled row and what compiling it cost.

    Attributes:
      name: the row's label.
      fn: the compiled program.
      args: its placed arguments.
      compile_seconds: ``lower(...).compile()`` wall time, tracing included.
      temp_bytes, argument_bytes, output_bytes: per device, from
        `memory_analysis()` (None where the backend does not say).
    """

    name: str
    fn: Any
    args: tuple
    compile_seconds: float
    temp_bytes: int | None
    argument_bytes: int | None
    output_bytes: int | None


def compile_program(name: str, lowerable, args: tuple) -> Compiled:
    """Lowers and compiles ``lowerable`` for `args`, timing both."""
    start = time.perf_counter()
    fn = lowerable.lower(*args).compile()
    seconds = time.perf_counter() - start
    temp = arg = out = None
    analysis = fn.memory_analysis()
    if analysis is not None:
        temp = int(analysis.temp_size_in_bytes)
        arg = int(analysis.argument_size_in_bytes)
        out = int(analysis.output_size_in_bytes)
    return Compiled(name, fn, args, seconds, temp, arg, out)


def run_once(program: Compiled) -> float:
    """Seconds for one call, waiting for every output."""
    start = time.perf_counter()
    jax.block_until_ready(program.fn(*program.args))
    return time.perf_counter() - start


def time_together(
    programs: Sequence[Compiled], reps: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Times `programs` side by side; returns every repetition's seconds by name."""
    for program in programs:
        for _ in range(warmup):
            run_once(program)
    times: dict[str, list[float]] = {p.name: [] for p in programs}
    n = len(programs)
    for rep in range(reps):
        gc.collect()
        for i in range(n):
            program = programs[(i + rep) % n]
            times[program.name].append(run_once(program))
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))
