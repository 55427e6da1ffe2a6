"""The seam between `jpipe.Pipeline` and a lowering, and what each lowering is.

A *lowering* turns a validated schedule, the stages' traced pieces
(`jpipe.StageKernels`) and the packed parameters into the computation of a
training step. jpipe has two:

- ``"spmd"`` (`jpipe.lower.spmd.lowering`): the whole step is one program that every
  device runs in lock step, choosing its piece each tick through
  conditionals (`jpipe.lower.spmd.program.build_step`). It can sit inside a user's own
  `jax.jit` and be differentiated through; every device allocates the
  busiest rank's buffers, since one program has one buffer of each kind.
- ``"mpmd"``, the per-rank lowering (`jpipe.lower.mpmd.programs`): each piece is a small
  program of its own on its rank's devices, issued from the host in the
  schedule's order; each rank holds only its own values, and ranks may have
  meshes of their own shapes (mixed devices).

`Pipeline` does what both share once (validates the schedule, places the
parameters, checks batches, traces the pieces, enforces the stage contract
through the kernels) and hands the step to its `Lowering`. Code that must
know what a lowering can do or how it holds memory asks its `LoweringKind`,
a plain frozen record, and never compares names: the trainer asks whether
the step is one program; the search, the planner and the compile-only
report ask its byte model (`LoweringKind.byte_model`, the contract in
`jpipe.lower.bytes`) what a device holds of what the simulator says each
rank needs. A third lowering is one more `LoweringKind` in `KINDS`, one
more `Lowering` subclass and one more byte model; `Pipeline` and the
trainer do not change. Which memory actions a lowering runs is declared
here too (`LoweringKind.memory_actions`), and a test holds each declaration
to what the lowering's own pass accepts (tests/test_schedule_search.py).

This module imports no JAX, so the pure-Python layers (the search and the
planner) read it freely.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from typing import Any

from jpipe.schedule.actions import MEMORY_KINDS


@dataclasses.dataclass(frozen=True)
class LoweringKind:
    """What a lowering is, as the rest of jpipe needs to know it.

    Attributes:
      name: the name `jpipe.Pipeline`'s ``lowering`` takes.
      title: how figures and messages name it.
      layout: the name of its memory layout in the schedule search and the
        cluster planner (``--layout``, ``--memory-layout``, plan files).
      one_program: the whole step is one traceable program: `Pipeline.step_fn`,
        `Pipeline.lower` and `Pipeline.program` exist, the step may sit inside
        a user's own `jax.jit` and be profiled as one program.
      meshes_per_rank: ranks may have meshes of their own shapes
        (`jpipe.make_rank_meshes`).
      every_device_holds_busiest: every device allocates what the busiest rank
        needs (one program, one buffer of each kind), rather than its own
        rank's need: the rule its byte model (`byte_model`) applies, which
        reports read to say how a device's terms were counted.
      memory_actions: the kinds of memory action (`jpipe.MEMORY_KINDS`:
        recompute, evict, offload, ...) it runs; the schedule search and
        the planner take candidates with these only
        (`jpipe.search.engine.lowering_runs`).
      runtime: ``"module:Class"`` of its `Lowering`, imported when a
        `Pipeline` is built (so this module needs no JAX).
      bytes_model: ``"module:Class"`` of its `jpipe.lower.bytes.ByteModel`
        (pure Python), what each device allocates of what its rank needs
        (`byte_model`).
    """

    name: str
    title: str
    layout: str
    one_program: bool
    meshes_per_rank: bool
    every_device_holds_busiest: bool
    memory_actions: frozenset[str]
    runtime: str
    bytes_model: str

    def runtime_class(self) -> type[Lowering]:
        """The `Lowering` subclass that runs this kind."""
        module, cls = self.runtime.split(":")
        return getattr(importlib.import_module(module), cls)

    def byte_model(self):
        """Its `jpipe.lower.bytes.ByteModel`: bytes per device under this lowering."""
        model = _BYTE_MODELS.get(self.bytes_model)
        if model is None:
            module, cls = self.bytes_model.split(":")
            model = _BYTE_MODELS[self.bytes_model] = getattr(importlib.import_module(module), cls)()
        return model


_BYTE_MODELS: dict = {}  # "module:Class" -> the one instance (they hold no state)


SPMD = LoweringKind(
    name="spmd",
    title="SPMD",
    layout="spmd",
    one_program=True,
    meshes_per_rank=False,
    every_device_holds_busiest=True,
    memory_actions=frozenset(MEMORY_KINDS),  # every kind, in its tick plan (docs/design.md)
    runtime="jpipe.lower.spmd.lowering:SpmdLowering",
    bytes_model="jpipe.lower.spmd.bytes:SpmdBytes",
)
MPMD = LoweringKind(
    name="mpmd",
    title="per-rank",
    layout="mpmd",
    one_program=False,
    meshes_per_rank=True,
    every_device_holds_busiest=False,
    memory_actions=frozenset(MEMORY_KINDS),  # every kind, as ops of its rank's list
    runtime="jpipe.lower.mpmd.programs:MpmdLowering",
    bytes_model="jpipe.lower.mpmd.bytes:PerRankBytes",
)
KINDS: dict[str, LoweringKind] = {k.name: k for k in (SPMD, MPMD)}
"""Every lowering, by the name `Pipeline` takes."""


def lowering_kind(name: str) -> LoweringKind:
    """The `LoweringKind` of a lowering's name (``"spmd"`` or ``"mpmd"``)."""
    kind = KINDS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"lowering must be one of {', '.join(map(repr, KINDS))}; got {name!r}")
    return kind


class Lowering(abc.ABC):
    """One `Pipeline`'s step under one lowering: what `Pipeline` delegates.

    Built by `Pipeline` once, with the pipeline itself (its stages,
    schedule, meshes, parameter layout and traced pieces, `Pipeline._kernels`).
    Each method is the `Pipeline` method of the same name; those that need
    the whole step as one program refuse by default, with a message that
    names the way out.
    """

    kind: LoweringKind

    def __init__(self, pipeline: Any, tick_layout: str):
        self.pipeline = pipeline
        self.tick_layout = tick_layout  # how the tick plan lays pieces out (`jpipe.make_tick_plan`)

    @abc.abstractmethod
    def value_and_grad(self, packed, batch):
        """``(loss, packed_grads)`` of one step."""

    @abc.abstractmethod
    def loss(self, packed, batch):
        """The mean loss, forwards only."""

    @abc.abstractmethod
    def compile(self, packed, batch):
        """Compiles the step for these shapes; returns what was compiled."""

    @abc.abstractmethod
    def stage_kernels(self, batch) -> list:
        """The traced pieces the step runs, per stage."""

    @abc.abstractmethod
    def compiled_memory(self, compiled) -> tuple[int, int]:
        """``(temp, arguments)`` bytes per device, from `compile`'s result (`Pipeline`'s)."""

    @property
    @abc.abstractmethod
    def tick_plan(self):
        """The lock-step tick plan (`jpipe.TickPlan`): under SPMD the one its program runs,
        memory actions included; per rank, of the schedule's compute, for figures."""

    @property
    @abc.abstractmethod
    def forward_tick_plan(self):
        """The tick plan of the forwards alone (`jpipe.lower.spmd.ticks.make_forward_tick_plan`)."""

    def step_fn(self, batch):
        """The unjitted step; only a lowering that makes the step one program has it."""
        self.refuse_not_one_program("Pipeline.step_fn")

    def program(self, batch):
        """The SPMD program's `jpipe.Program`; only a one-program lowering has it."""
        self.refuse_not_one_program("Pipeline.program (the SPMD program's tick table)")

    def lower(self, packed, batch):
        """The lowered step; only a one-program lowering has it."""
        self.refuse_not_one_program("Pipeline.lower (one lowered program of the whole step)")

    def rank_programs(self, batch):
        """The per-rank lowering's `jpipe.RankPrograms`; other lowerings refuse."""
        raise ValueError(
            f"rank_programs is the per-rank lowering's; this Pipeline is {self.kind.name!r}"
        )

    def refuse_not_one_program(self, what: str):
        raise ValueError(
            f"{what} needs the whole step as one traceable program, which only the SPMD "
            f"lowering makes; this Pipeline uses the {self.kind.title} lowering "
            f"(lowering={self.kind.name!r}), which runs one program per piece from the host. "
            "Call pipeline.value_and_grad(params, batch) (and apply the optimizer in a jit of "
            "its own), or build the Pipeline with lowering='spmd'"
        )
