"""Llama-3-70B at its real sizes on 64 devices of 80 GB: pipe 8 x tensor 8, sequence 8,192.

Command lines (8 hosts of 8 accelerators, docs/multihost.md; compile-only on any machine):

  python train.py --config=configs/llama3_70b.py --workdir=/shared/jpipe_llama3_70b \\
      --coordinator_address=HOST:PORT --num_processes=8 --process_id=I
  python train.py --config=configs/llama3_70b.py --config.compile_only=True

Sizes are Llama-3-70B's: 80 blocks, D = 8,192, 64 query heads of 128 and 8
key/value heads, SwiGLU of width 28,672, rotary base 500,000, the
128,256-token vocabulary (a BPE of as many tokens trained here, as
configs/llama3_8b.py says), an untied head. Computes in bfloat16;
parameters, gradients, AdamW's moments, the norms and the loss stay in
float32. The 8B's memory options: blockwise attention, each block
recomputed in the backward (``remat="full"``), the head's logits
recomputed, the embedding and the head split by vocabulary rows over
``tensor`` (``vocab_split``) and the activations between the split matmuls
split along the sequence (``sequence_parallel``).

Mesh: ``tensor`` = 8 innermost (a host's 8 devices: each block split by
heads, 8 query heads and 1 key/value head a device, and the MLP by its
width), ``pipe`` = 8 across the hosts (10 blocks a stage; the embedding on
the first, the head on the last). 1F1B, 32 microbatches of one 8,192-token
sequence: 262,144 tokens a step; the bubble on 8 ranks is 7/39.

Measured with ``--config.compile_only=True`` (the step compiled from shapes on
64 fake CPU devices, XLA:CPU's buffer assignment, jax 0.10.2, 2026-12-06;
docs/scale.md): 48.89 GB a device (45.5 GiB: 14.41 GB of arguments, 34.48
GB of temp) under the SPMD lowering, which fits 80 GB; jpipe's byte model
predicts 48.58 GB. With ``--config.lowering=mpmd`` (each rank on a mesh of
its own, 2026-12-07): 45.92 GB on the fullest rank (the last, the head's;
14.41 GB of arguments, 31.51 GB of its account), 40.8 to 43.4 GB on the
others (ranks 1 to 6 hold only their own 12.84 GB of arguments); predicted
45.92 GB (40.63 to 43.26 on the others). Without the two splits it did
not fit: 96.39 GB (SPMD) and 81.10 GB (per rank).

Not yet run on accelerators.
"""

import pathlib

import ml_collections

from jpipe.train.config import config_from_file

_LLAMA3_8B = pathlib.Path(__file__).with_name("llama3_8b.py")


def get_config() -> ml_collections.ConfigDict:
    """Llama-3-70B: configs/llama3_8b.py with these fields changed."""
    config = config_from_file(_LLAMA3_8B)

    # Pipeline.
    config.num_microbatches = 32  # M; must divide batch_size / (mesh.data * mesh.fsdp)

    # Devices: 8 x 1 x 1 x 8 = 64; pipe across the 8 hosts, tensor within each.
    config.mesh.pipe = 8
    config.mesh.tensor = 8

    # Data.
    config.batch_size = 32  # sequences: 32 microbatches of one

    # Model: Llama-3-70B's sizes (jpipe.models.LlamaConfig); the rest as the 8B's.
    config.model.num_layers = 80  # decoder blocks over all stages
    config.model.num_heads = 64  # query heads; must divide d_model (and by mesh.tensor)
    config.model.num_kv_heads = 8  # key/value heads; must divide num_heads (and by mesh.tensor)
    config.model.d_model = 8192  # D, model width
    config.model.d_ff = 28672  # SwiGLU hidden width

    # Optimizer (Llama 2 70B's peak rate; the 8B config's warm-up).
    config.optimizer.learning_rate = 1.5e-4  # peak learning rate, reached after warm-up

    return config
