"""Models cut into pipeline stages, in the form the compiler runs.

A model is a `StagedModel`: an ordered tuple of stage functions
``stage(params, x, inputs) -> y``, an initializer giving one parameter tree per
stage, and the unpipelined reference loss. `split_flax_model` cuts any
embed/blocks/head Flax model by layer counts (`split_layers`); the GPT
(`make_stages`) is one such model. Randomness (dropout) comes with the batch
as per-row keys (`row_keys`, `row_dropout`).
"""

from jpipe.models.gpt import (
    GPTConfig,
    example_batch,
    make_stages,
    num_params,
    weight_decay_mask,
)
from jpipe.models.staged import (
    StagedModel,
    fold_row_keys,
    merge_stage_params,
    row_dropout,
    row_keys,
    split_flax_model,
    split_layers,
    split_stage_params,
)

__all__ = [
    "GPTConfig",
    "StagedModel",
    "example_batch",
    "fold_row_keys",
    "make_stages",
    "merge_stage_params",
    "num_params",
    "row_dropout",
    "row_keys",
    "split_flax_model",
    "split_layers",
    "split_stage_params",
    "weight_decay_mask",
]
