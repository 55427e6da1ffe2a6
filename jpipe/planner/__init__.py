"""Planning for mixed devices: profiles, exact layer splits, plans scored by simulation.

The public face of the planner (see ``python -m jpipe.plan`` and
docs/planner-validation.md). Its passes, one module each:

- `jpipe.planner.profiles`: the profile format (per-layer forward, backward and update
  times per device type, microbatch size and tensor-parallel degree; bytes;
  links), the importer of the published Sailor profiles, and profiles made
  from the trainer's measured stage times;
- `jpipe.planner.choices`: a profile's activation bytes and times under the
  model's attention and remat options (flash-style attention, rematerialization),
  derived from what it measured by a first-principles model;
- `jpipe.planner.partition`: the contiguous split of layers over stages of given
  speeds that minimises the slowest stage, exactly (with a brute-force
  reference and the uniform and speed-proportional baselines);
- `jpipe.planner.plans`: a plan's step time and memory by simulating the schedule
  that will run, the search over device orders, degrees (one for all, or one per
  device type for the per-rank lowering), microbatches and schedules, and plan
  files the trainer reads (``config.plan``);
- `jpipe.planner.validation`: the measured Sailor plans against jpipe's prediction
  and the closed form.
"""

from jpipe.planner.choices import (
    MemoryChoice,
    ModelShape,
    with_choice,
)
from jpipe.planner.partition import (
    Partition,
    brute_force_partition,
    partition,
    proportional_partition,
    speed_costs,
    uniform_partition,
)
from jpipe.planner.plans import (
    LAYOUTS,
    MEMORY_MARGIN,
    ClusterPlan,
    DeviceGroup,
    DeviceMemory,
    Evaluation,
    MemoryFootprint,
    NoPlanFits,
    TrainerSettings,
    evaluate,
    load_sailor_plan,
    median_abs_error,
    memory_footprint,
    parse_devices,
    plan,
    plan_file,
    plan_from_sailor,
    plan_processes,
    read_plan_file,
    spmd_values,
)
from jpipe.planner.profiles import (
    JPIPE_RUNTIME,
    SAILOR_DIR,
    SAILOR_RUNTIME,
    LayerTimes,
    Link,
    MemoryTerms,
    Profile,
    load_profile,
    load_sailor_profile,
    monotone_in_batch,
    profile_from_json,
    profile_from_stage_times,
    profile_to_json,
    save_profile,
)
from jpipe.planner.validation import markdown as validation_markdown
from jpipe.planner.validation import (
    medians,
    memory_medians,
    picks,
    repair_layers,
    validate_directory,
)

__all__ = [
    "JPIPE_RUNTIME",
    "LAYOUTS",
    "MEMORY_MARGIN",
    "SAILOR_DIR",
    "SAILOR_RUNTIME",
    "DeviceMemory",
    "MemoryChoice",
    "MemoryFootprint",
    "MemoryTerms",
    "ModelShape",
    "NoPlanFits",
    "ClusterPlan",
    "DeviceGroup",
    "Evaluation",
    "LayerTimes",
    "Link",
    "Partition",
    "Profile",
    "TrainerSettings",
    "brute_force_partition",
    "evaluate",
    "load_profile",
    "load_sailor_plan",
    "load_sailor_profile",
    "median_abs_error",
    "medians",
    "memory_footprint",
    "memory_medians",
    "monotone_in_batch",
    "parse_devices",
    "partition",
    "picks",
    "plan",
    "plan_file",
    "plan_from_sailor",
    "plan_processes",
    "profile_from_json",
    "profile_from_stage_times",
    "profile_to_json",
    "proportional_partition",
    "read_plan_file",
    "repair_layers",
    "save_profile",
    "speed_costs",
    "spmd_values",
    "uniform_partition",
    "validate_directory",
    "validation_markdown",
    "with_choice",
]
