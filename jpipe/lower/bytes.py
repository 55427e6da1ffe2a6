"""Bytes per device: the one contract every lowering's byte model keeps.

A schedule's timeline says what each rank needs: its stages' parameters, the
most live values it holds at once (`jpipe.simulate`'s events), the working
memory of its largest piece. How much of that a *device* allocates is the
lowering's own rule: one SPMD program allocates the busiest rank's terms on
every device; per-rank programs allocate each rank its own. Each lowering
says it once, in a `ByteModel` beside its programs
(`jpipe.lower.spmd.bytes.SpmdBytes`, `jpipe.lower.mpmd.bytes.PerRankBytes`),
found through its `LoweringKind` (`LoweringKind.byte_model`). The
simulator gives what each rank needs (its live values in time,
`jpipe.schedule.simulate.live_peaks`; the search reads its events as curves),
which is lowering-free; the schedule search (`jpipe.search.engine.device_bytes`),
the cluster planner (`jpipe.planner.memory_footprint`) and, through the
search, the compile-only report hand it to the model as `RankBytes` and read
back one `HeldBytes` per device.

What a caller knows and the others do not stays its own, as an input: the
planner's fixed overhead of a device kind and its tensor degree per rank
(each rank's bytes are per device at its degree); the buffers a model's
program sizes from the schedule (`ByteModel.buffers`: the SPMD program's
tick buffers), which the search asks for and the planner does not (it
holds the SPMD program to the largest rank's peak of live values). Each
model is tested against the compiled program (tests/test_byte_model.py).

Pure Python, no JAX: the search and the planner import it freely.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jpipe.schedule.actions import Schedule


@dataclasses.dataclass(frozen=True)
class RankBytes:
    """What each rank needs, in bytes per device: a byte model's inputs.

    One entry per rank; where data-parallel replicas hold different devices
    (the planner), one per rank of each replica, all of one program.

    Attributes:
      params: its stages' bytes held the whole step (weights, gradients,
        optimizer state).
      values: the most live values it holds at once, from the schedule's
        timeline (residuals, carries, kept inputs, what it holds for a
        partner).
      working: the working memory of its largest piece, on top of its values
        while it runs.
      grads: its stages' gradients, a share of `params`, as the step returns
        them (`jpipe.StageFigures.grad_output`); empty for none.
      overhead: each device's fixed memory (context, libraries, kernels);
        empty for none.
      tick_buffers: ``(residual, carry)`` bytes of the buffers a lock-step
        program sizes from its tick plan, held in place of the values where a
        model allocates buffers (the SPMD one); None to hold the values.
      packed_everywhere: every rank holds the packed parameters and the
        optimizer state built on them whole (the per-rank lowering on one
        mesh), not its own stages' alone (one mesh per rank).
      busy: where known, the most it holds while a piece runs: the values
        held when each piece starts plus that piece's own working memory
        (or its peak of values, where more), in place of `values` plus the
        largest `working` where a model holds working memory only while a
        piece runs (the per-rank one); empty for not known.
    """

    params: tuple[float, ...]
    values: tuple[float, ...]
    working: tuple[float, ...]
    grads: tuple[float, ...] = ()
    overhead: tuple[float, ...] = ()
    tick_buffers: tuple[float, float] | None = None
    packed_everywhere: bool = False
    busy: tuple[float, ...] = ()

    def __post_init__(self):
        n = len(self.params)
        object.__setattr__(self, "params", tuple(self.params))
        for name in ("values", "working", "grads", "overhead", "busy"):
            value = tuple(getattr(self, name))
            object.__setattr__(self, name, value)
            if value and len(value) != n:
                raise ValueError(
                    f"{name} has {len(value)} entries and params {n}; give one per rank"
                )
            if not value and n and name in ("values", "working"):  # the others: optional
                raise ValueError(f"{name} has no entry per rank (params has {n})")

    @property
    def num_ranks(self) -> int:
        return len(self.params)

    def grads_or_zeros(self) -> tuple[float, ...]:
        return self.grads or (0.0,) * self.num_ranks

    def overhead_or_zeros(self) -> tuple[float, ...]:
        return self.overhead or (0.0,) * self.num_ranks


@dataclasses.dataclass(frozen=True)
class HeldBytes:
    """What one device allocates under a lowering, term by term.

    Attributes:
      overhead: its fixed memory.
      params: the parameter bytes it holds (weights, gradients, optimizer state).
      grad_output: one more copy of the gradients, where the step returns them
        beside its accumulator (the SPMD program).
      values: the live values it holds: a rank's peak, or the tick buffers' sum.
      working: the working memory of the piece running on top of them.
      buffers: ``(residual, carry)``, where `values` are tick buffers.
    """

    overhead: float
    params: float
    grad_output: float
    values: float
    working: float
    buffers: tuple[float, float] | None = None

    @property
    def total(self) -> float:
        return self.overhead + self.params + self.grad_output + self.values + self.working

    def room(self, budget: float) -> float:
        """What of `budget` is left for live values beside every other term."""
        return budget - self.overhead - self.params - self.grad_output - self.working

    def parts(self) -> dict[str, float]:
        """The terms by name, for reports (a zero overhead or gradient output left out)."""
        out = {"overhead": self.overhead} if self.overhead else {}
        out["params"] = self.params
        if self.grad_output:
            out["gradient output"] = self.grad_output
        if self.buffers is not None:
            out["residual buffer"], out["carry buffer"] = self.buffers
        else:
            out["values"] = self.values
        return out | {"working": self.working}


class ByteModel(abc.ABC):
    """One lowering's rule for what each device allocates of what its rank needs."""

    @abc.abstractmethod
    def device_bytes(self, need: RankBytes) -> tuple[HeldBytes, ...]:
        """What each device holds, one `HeldBytes` per entry of `need`."""

    def buffers(
        self, schedule: Schedule, activation: Sequence[float], carry: Sequence[float]
    ) -> tuple[float, float] | None:
        """``(residual, carry)`` bytes of the buffers the lowering's program sizes for
        `schedule` (`activation` and `carry` each stage's per microbatch), held in place
        of the live values (`RankBytes.tick_buffers`); None where it holds the values as
        they live, as this default does."""
        return None

    @abc.abstractmethod
    def stage_room(
        self, device_room: Sequence[Sequence[float]], stage_ranks: Sequence[Sequence[int]]
    ) -> list[float]:
        """What each stage's own bytes may take when one stage is checked at a time (the
        planner's layer split), given each rank's devices' room (``device_room[r]``) and
        the ranks that hold each stage (`Schedule.stage_ranks`)."""
