"""The SPMD lowering behind `jpipe.Pipeline`: the whole step as one jitted program.

`jpipe.lower.spmd.program.build_step` lowers a tick plan (`jpipe.lower.spmd.ticks`) to one
program over the whole mesh; this module is what `Pipeline` asks of it
(`jpipe.lower.interface.Lowering`): the step and the forward-only loss, each
built and jitted once per batch shape, their compilation, and the
program itself for inspection. It is the one place that jits the SPMD step.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe.lower.interface import SPMD, Lowering
from jpipe.lower.microbatch import split_microbatches
from jpipe.lower.spmd.program import Program, build_step
from jpipe.lower.spmd.ticks import make_forward_tick_plan, make_tick_plan


class SpmdLowering(Lowering):
    """One program over the mesh, every device in lock step (``lowering="spmd"``).

    The tick plan lays out the schedule's memory actions too
    (`jpipe.lower.spmd.ticks`), so it is made from the schedule as written.
    """

    kind = SPMD

    def __init__(self, pipeline, tick_layout: str):
        super().__init__(pipeline, tick_layout)
        self._plan = make_tick_plan(pipeline.schedule, tick_layout)
        self._forward_plan = make_forward_tick_plan(pipeline.schedule)
        # Built once per batch shape (`Pipeline._key`): the jitted training step
        # with its program, the jitted forward-only loss.
        self._train_steps: dict[tuple, tuple[Callable, Program]] = {}
        self._loss_steps: dict[tuple, Callable] = {}

    @property
    def tick_plan(self):
        return self._plan

    @property
    def forward_tick_plan(self):
        return self._forward_plan

    def _program(self, batch, plan, **options) -> Program:
        p = self.pipeline
        return build_step(
            p.stages,
            plan,
            p.layout,
            p.mesh,
            p._microbatch_shapes(batch),
            p.pipe_axis,
            p.data_axis,
            kernels=p._kernels(batch),
            idle=p.all_idle,
            control=p.control,
            **options,
        )

    def _build(self, batch) -> tuple[Callable, Program]:
        """The jitted training step and its `Program`, built once per batch shape."""
        p = self.pipeline
        p.check_batch(batch)
        key = p._key(batch)
        if key not in self._train_steps:
            program = self._program(batch, self._plan)
            M = p.num_microbatches

            def value_and_grad(packed, batch):
                return program.run(packed, split_microbatches(batch, M))

            jitted = jax.jit(
                value_and_grad,
                in_shardings=(p.param_sharding, p.batch_sharding),
                out_shardings=(NamedSharding(p.mesh, P()), p.param_sharding),
            )
            self._train_steps[key] = (jitted, program)
        return self._train_steps[key]

    def value_and_grad(self, packed, batch):
        jitted, _ = self._build(batch)
        return jitted(packed, batch)

    def loss(self, packed, batch):
        p = self.pipeline
        p.check_batch(batch)
        key = p._key(batch)
        if key not in self._loss_steps:
            program = self._program(batch, self._forward_plan, forward_only=True)
            M = p.num_microbatches
            self._loss_steps[key] = jax.jit(
                lambda packed, batch: program.run(packed, split_microbatches(batch, M))[0],
                in_shardings=(p.param_sharding, p.batch_sharding),
                out_shardings=NamedSharding(p.mesh, P()),
            )
        return self._loss_steps[key](packed, batch)

    def step_fn(self, batch):
        _, program = self._build(batch)
        M = self.pipeline.num_microbatches
        return lambda packed, batch: program.run(packed, split_microbatches(batch, M))

    def program(self, batch) -> Program:
        _, program = self._build(batch)
        return program

    def lower(self, packed, batch):
        jitted, _ = self._build(batch)
        return jitted.lower(packed, batch)

    def compile(self, packed, batch):
        return self.lower(packed, batch).compile()

    def compiled_memory(self, compiled) -> tuple[int, int]:
        memory = compiled.memory_analysis()
        return memory.temp_size_in_bytes, memory.argument_size_in_bytes

    def stage_kernels(self, batch) -> list:
        return list(self.program(batch).kernels)
