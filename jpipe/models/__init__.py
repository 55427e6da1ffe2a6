"""Models cut into pipeline stages, in the form the compiler runs.

A model is a `StagedModel`: an ordered tuple of stage functions
``stage(params, x, inputs) -> y``, an initializer giving one parameter tree per
stage, and the unpipelined reference loss. `split_flax_model` cuts any
embed/blocks/head Flax model by layer counts (`split_layers`), and
`split_nnx_model` the same shape written with Flax NNX; the GPT
(`make_stages`) and the Llama-style decoder (`llama.make_stages`) are two
such models. Randomness (dropout) comes with the batch
as per-row keys (`row_keys`, `row_dropout`). The trainer builds a model by
name (`register_model`, `build_model`: ``"gpt"``, ``"llama"``, or
``"path/to/file.py:function"`` returning a `StagedModel` from `BuildArgs`).
"""

from jpipe.models.gpt import (
    GPTConfig,
    example_batch,
    make_stages,
    num_params,
    weight_decay_mask,
)
from jpipe.models.llama import LlamaConfig
from jpipe.models.registry import (
    BuildArgs,
    build_model,
    register_model,
    registered_models,
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
from jpipe.models.staged_nnx import split_nnx_model

__all__ = [
    "BuildArgs",
    "GPTConfig",
    "LlamaConfig",
    "StagedModel",
    "build_model",
    "example_batch",
    "fold_row_keys",
    "make_stages",
    "merge_stage_params",
    "num_params",
    "register_model",
    "registered_models",
    "row_dropout",
    "row_keys",
    "split_flax_model",
    "split_layers",
    "split_nnx_model",
    "split_stage_params",
    "weight_decay_mask",
]
