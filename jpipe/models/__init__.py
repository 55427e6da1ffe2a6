"""Models cut into pipeline stages, in the form the compiler runs.

A model is a `StagedModel`: an ordered tuple of stage functions
``stage(params, x, inputs) -> y``, an initializer giving one parameter tree per
stage, and the unpipelined reference loss.
"""

from jpipe.models.gpt import (
    GPTConfig,
    StagedModel,
    example_batch,
    make_stages,
    merge_stage_params,
    num_params,
    small_test_model,
    split_layers,
    split_stage_params,
    weight_decay_mask,
)
from jpipe.models.staged import FlaxStages, split_flax_model

__all__ = [
    "FlaxStages",
    "split_flax_model",
    "GPTConfig",
    "StagedModel",
    "example_batch",
    "make_stages",
    "merge_stage_params",
    "num_params",
    "small_test_model",
    "split_layers",
    "split_stage_params",
    "weight_decay_mask",
]
