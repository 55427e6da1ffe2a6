"""jpipe: write, check, see and run pipeline-parallel training schedules in JAX.

The data flows one way: a schedule (Python or PyTorch CSV) -> `validate` ->
`simulate` and charts -> `make_plan` (lock-step ticks and buffer slots) -> a
program lowered onto a device mesh -> a train step.
Everything before the lowering is pure Python and needs no devices.

Glossary for shapes and sizes, used throughout: S stages, R ranks (devices on
the ``pipe`` mesh axis), V chunks (stages) per rank, M microbatches, B
microbatch size, L sequence length, D model width.

Names are imported when first used (PEP 562 `__getattr__`), so ``import
jpipe`` and the schedule language (`F`, `B`, `register_schedule`, `validate`,
`simulate`) do not import JAX: ``python -m jpipe.show`` starts in a fraction
of a second. The subpackages `jpipe.testing`, `jpipe.models`, `jpipe.train`
and `jpipe.planner` (also as `jpipe.planning`) are reachable the same way after ``import jpipe``.
"""

from __future__ import annotations

import importlib

# Each public name: (module, attribute in it).
_EXPORTS = {
    "Action": ("jpipe.schedule.actions", "Action"),
    "B": ("jpipe.schedule.actions", "B"),
    "ClusterPlan": ("jpipe.planner.plans", "ClusterPlan"),
    "Costs": ("jpipe.schedule.simulate", "Costs"),
    "LOAD": ("jpipe.schedule.actions", "LOAD"),
    "LOWERINGS": ("jpipe.lower.pipeline", "LOWERINGS"),
    "MEMORY_KINDS": ("jpipe.schedule.actions", "MEMORY_KINDS"),
    "OFFLOAD_END": ("jpipe.schedule.actions", "OFFLOAD_END"),
    "OFFLOAD_START": ("jpipe.schedule.actions", "OFFLOAD_START"),
    "DeviceGroup": ("jpipe.planner.plans", "DeviceGroup"),
    "EVICT": ("jpipe.schedule.actions", "EVICT"),
    "F": ("jpipe.schedule.actions", "F"),
    "FC": ("jpipe.schedule.actions", "FC"),
    "I": ("jpipe.schedule.actions", "I"),
    "Overlap": ("jpipe.schedule.actions", "Overlap"),
    "Pipeline": ("jpipe.lower.pipeline", "Pipeline"),
    "Plan": ("jpipe.lower.spmd.ticks", "Plan"),
    "Program": ("jpipe.lower.spmd.program", "Program"),
    "RECOMPUTE": ("jpipe.schedule.actions", "RECOMPUTE"),
    "RELOAD_END": ("jpipe.schedule.actions", "RELOAD_END"),
    "RELOAD_START": ("jpipe.schedule.actions", "RELOAD_START"),
    "RankPrograms": ("jpipe.lower.mpmd.programs", "RankPrograms"),
    "Schedule": ("jpipe.schedule.actions", "Schedule"),
    "ScheduleError": ("jpipe.schedule.validate", "ScheduleError"),
    "ScheduleSearch": ("jpipe.search.engine", "ScheduleSearch"),
    "Simulation": ("jpipe.schedule.simulate", "Simulation"),
    "Sizes": ("jpipe.schedule.simulate", "Sizes"),
    "StageFigures": ("jpipe.search.engine", "StageFigures"),
    "StageKernels": ("jpipe.stage.pieces", "StageKernels"),
    "LayerProfile": ("jpipe.search.engine", "LayerProfile"),
    "StageProfile": ("jpipe.search.engine", "StageProfile"),
    "TICK_LAYOUTS": ("jpipe.lower.spmd.ticks", "LAYOUTS"),
    "Transfers": ("jpipe.lower.spmd.ticks", "Transfers"),
    "W": ("jpipe.schedule.actions", "W"),
    "WeightedLoss": ("jpipe.stage.pieces", "WeightedLoss"),
    "describe_devices": ("jpipe.runtime.devices", "describe_devices"),
    "evaluate_plan": ("jpipe.planner.plans", "evaluate"),
    "exit_distributed": ("jpipe.runtime.distributed", "exit_now"),
    "get_schedule": ("jpipe.schedule.registry", "get_schedule"),
    "initialize_distributed": ("jpipe.runtime.distributed", "initialize"),
    "launch_local": ("jpipe.runtime.launch", "launch"),
    "load_sailor_profile": ("jpipe.planner.profiles", "load_sailor_profile"),
    "load_stage_profile": ("jpipe.search.engine", "load_stage_profile"),
    "make_mesh": ("jpipe.lower.pipeline", "make_mesh"),
    "make_rank_meshes": ("jpipe.lower.pipeline", "make_rank_meshes"),
    "make_plan": ("jpipe.lower.spmd.ticks", "make_plan"),
    "microbatches": ("jpipe.lower.microbatch", "microbatches"),
    "pack_lifetimes": ("jpipe.lower.spmd.ticks", "pack_lifetimes"),
    "partition_layers": ("jpipe.planner.partition", "partition"),
    "plan_cluster": ("jpipe.planner.plans", "plan"),
    "read_plan_file": ("jpipe.planner.plans", "read_plan_file"),
    "reference_value_and_grad": ("jpipe.lower.pipeline", "reference_value_and_grad"),
    "register_schedule": ("jpipe.schedule.registry", "register_schedule"),
    "registered_schedules": ("jpipe.schedule.registry", "registered_schedules"),
    "run_stages": ("jpipe.lower.pipeline", "run_stages"),
    "search_schedule": ("jpipe.search.engine", "search_schedule"),
    "simulate": ("jpipe.schedule.simulate", "simulate"),
    "split_microbatches": ("jpipe.lower.microbatch", "split_microbatches"),
    "stage_pieces": ("jpipe.stage.pieces", "stage_pieces"),
    "use_cpu_devices": ("jpipe.runtime.devices", "use_cpu_devices"),
    "validate": ("jpipe.schedule.validate", "validate"),
}
_SUBPACKAGES = ("models", "planner", "planning", "testing", "train")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attr)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"jpipe.{name}")
    else:
        raise AttributeError(f"module 'jpipe' has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBPACKAGES))
