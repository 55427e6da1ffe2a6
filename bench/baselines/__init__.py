"""What a JAX user would run instead of jpipe, built for the same workload.

- `unpipelined`: one `jax.jit` of `jax.value_and_grad` on one device (on the
  whole batch, or one microbatch at a time), and the same function
  data-parallel over several devices.
- `lockstep`: diagnostics, not alternatives: every device runs one stage's
  pieces with no pipeline, with and without a lock-step barrier per piece.
- `spmd_pipeline`: the SPMD pipeline of JAX's shard_map documentation and of
  MaxText, Praxis and AXLearn: stacked stage weights, a vmap over stages,
  activations shifted with `ppermute` every iteration, GPipe by autodiff of
  the loop, optionally circular.
"""

from bench.baselines.spmd_pipeline import SpmdPipeline, spmd_pipeline
from bench.baselines.unpipelined import data_parallel, one_device, one_device_microbatched

__all__ = [
    "SpmdPipeline",
    "data_parallel",
    "one_device",
    "one_device_microbatched",
    "spmd_pipeline",
]
