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
    "Action": ("jpipe._schedule", "Action"),
    "B": ("jpipe._schedule", "B"),
    "ClusterPlan": ("jpipe.planner._search", "ClusterPlan"),
    "Costs": ("jpipe._simulate", "Costs"),
    "LOAD": ("jpipe._schedule", "LOAD"),
    "LOWERINGS": ("jpipe._pipeline", "LOWERINGS"),
    "MEMORY_KINDS": ("jpipe._schedule", "MEMORY_KINDS"),
    "OFFLOAD_END": ("jpipe._schedule", "OFFLOAD_END"),
    "OFFLOAD_START": ("jpipe._schedule", "OFFLOAD_START"),
    "DeviceGroup": ("jpipe.planner._search", "DeviceGroup"),
    "EVICT": ("jpipe._schedule", "EVICT"),
    "F": ("jpipe._schedule", "F"),
    "FC": ("jpipe._schedule", "FC"),
    "I": ("jpipe._schedule", "I"),
    "Overlap": ("jpipe._schedule", "Overlap"),
    "Pipeline": ("jpipe._pipeline", "Pipeline"),
    "Plan": ("jpipe._ticks", "Plan"),
    "Program": ("jpipe._lower", "Program"),
    "RECOMPUTE": ("jpipe._schedule", "RECOMPUTE"),
    "RELOAD_END": ("jpipe._schedule", "RELOAD_END"),
    "RELOAD_START": ("jpipe._schedule", "RELOAD_START"),
    "RankPrograms": ("jpipe._mpmd", "RankPrograms"),
    "Schedule": ("jpipe._schedule", "Schedule"),
    "ScheduleError": ("jpipe._validate", "ScheduleError"),
    "ScheduleSearch": ("jpipe._schedule_search", "ScheduleSearch"),
    "Simulation": ("jpipe._simulate", "Simulation"),
    "Sizes": ("jpipe._simulate", "Sizes"),
    "StageFigures": ("jpipe._schedule_search", "StageFigures"),
    "StageKernels": ("jpipe._stage", "StageKernels"),
    "LayerProfile": ("jpipe._schedule_search", "LayerProfile"),
    "StageProfile": ("jpipe._schedule_search", "StageProfile"),
    "TICK_LAYOUTS": ("jpipe._ticks", "LAYOUTS"),
    "Transfers": ("jpipe._ticks", "Transfers"),
    "W": ("jpipe._schedule", "W"),
    "WeightedLoss": ("jpipe._stage", "WeightedLoss"),
    "describe_devices": ("jpipe._devices", "describe_devices"),
    "evaluate_plan": ("jpipe.planner._search", "evaluate"),
    "exit_distributed": ("jpipe._distributed", "exit_now"),
    "get_schedule": ("jpipe._registry", "get_schedule"),
    "initialize_distributed": ("jpipe._distributed", "initialize"),
    "launch_local": ("jpipe._launch", "launch"),
    "load_sailor_profile": ("jpipe.planner._profiles", "load_sailor_profile"),
    "load_stage_profile": ("jpipe._schedule_search", "load_stage_profile"),
    "make_mesh": ("jpipe._pipeline", "make_mesh"),
    "make_rank_meshes": ("jpipe._pipeline", "make_rank_meshes"),
    "make_plan": ("jpipe._ticks", "make_plan"),
    "microbatches": ("jpipe._microbatch", "microbatches"),
    "pack_lifetimes": ("jpipe._ticks", "pack_lifetimes"),
    "partition_layers": ("jpipe.planner._partition", "partition"),
    "plan_cluster": ("jpipe.planner._search", "plan"),
    "read_plan_file": ("jpipe.planner._search", "read_plan_file"),
    "reference_value_and_grad": ("jpipe._pipeline", "reference_value_and_grad"),
    "register_schedule": ("jpipe._registry", "register_schedule"),
    "registered_schedules": ("jpipe._registry", "registered_schedules"),
    "run_stages": ("jpipe._pipeline", "run_stages"),
    "search_schedule": ("jpipe._schedule_search", "search_schedule"),
    "simulate": ("jpipe._simulate", "simulate"),
    "split_microbatches": ("jpipe._microbatch", "split_microbatches"),
    "stage_pieces": ("jpipe._stage", "stage_pieces"),
    "use_cpu_devices": ("jpipe._devices", "use_cpu_devices"),
    "validate": ("jpipe._validate", "validate"),
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
