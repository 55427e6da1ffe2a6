"""A GPT-2-small-sized byte-level model, for accelerators.

Command line (8 accelerators, 4-rank pipeline x 2-way data):

  python train.py --config=configs/gpt2_small.py --workdir=/tmp/jpipe_gpt2_small

Sizes are GPT-2 small's (12 layers, 12 heads, D = 768, L = 1024) except the
vocabulary: 256 bytes instead of GPT-2's 50,257 BPE tokens, so there is no
tokenizer to download; that makes 86.2M parameters (21-22M per stage with the
balanced 3,3,3,3 split). Computes in bfloat16, parameters and loss in float32.

Expected result: not yet measured on accelerators. Each step sees 131,072
tokens, so 2,000 steps are about 9 passes over the 30 MiB standard library
corpus (Python 3.11): expect the held-out loss to fall well below the default
run's and then flatten or turn up as the model memorizes. Point
``--config.data.path`` at a larger text collection for a longer run.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    """The GPT-2-small config."""
    config = ml_collections.ConfigDict()

    # Pipeline.
    config.schedule = "1f1b"  # built-in name, a CSV file, or "path/to/file.py:function"
    config.num_microbatches = 16  # M; must divide batch_size / mesh.data
    config.chunks = 0  # stages per rank V; 0 = the schedule's own (interleaved_1f1b, zbv: 2)
    config.tick_layout = "auto"  # "unit", "packed", or "auto": packed where no slower
    config.layers_per_stage = ""  # blocks per stage, e.g. "2,4,4,2"; "" = balanced

    # Devices.
    config.mesh = ml_collections.ConfigDict()
    config.mesh.pipe = 4  # ranks on the pipeline axis
    config.mesh.data = 2  # data-parallel replicas
    config.mesh.pipe_hosts = 0  # hosts (processes) the pipe axis spans; 0 = the default order
    config.mesh.data_hosts = 0  # hosts the data axis spans (docs/multihost.md says which)
    config.cpu_devices = 0  # fake CPU devices per process on a CPU-only host; 0 = as the mesh needs

    # Run length and reporting.
    config.steps = 2000  # optimizer steps
    config.log_every = 10  # steps between progress-bar / metrics.jsonl updates
    config.eval_every = 200  # steps between held-out evaluations (and one at the end)
    config.eval_batches = 8  # global batches per held-out evaluation
    config.checkpoint_every = 500  # steps between checkpoints (and one at the end)
    config.profile = False  # measure per-stage F/B/I/W times and predict the step time
    config.seed = 0  # fixes the initial weights and the order of the data

    # Data: bytes, so the vocabulary is 256.
    config.batch_size = 128  # global batch, in sequences of model.seq_len tokens
    config.data = ml_collections.ConfigDict()
    config.data.path = ""  # text files / directories, comma-separated; "" = Python's stdlib source
    config.data.max_bytes = 0  # read at most this much of the corpus; 0 = all of it
    config.data.eval_fraction = 0.05  # the last this share of the corpus's bytes is held out

    # Model (jpipe.models.GPTConfig).
    config.model = ml_collections.ConfigDict()
    config.model.vocab_size = 256  # bytes (GPT-2 itself has 50,257 BPE tokens)
    config.model.seq_len = 1024  # L, tokens per sequence
    config.model.num_layers = 12  # transformer blocks over all stages
    config.model.num_heads = 12  # attention heads; must divide d_model
    config.model.d_model = 768  # D, model width
    config.model.d_ff = 3072  # MLP hidden width, 4 D
    config.model.dtype = "bfloat16"  # compute dtype: "float32", "bfloat16" or "float16"

    # Optimizer: AdamW, linear warm-up then cosine decay, global-norm clipping.
    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.learning_rate = 6e-4  # peak learning rate, reached after warm-up
    config.optimizer.warmup_steps = 200  # linear warm-up from 0
    config.optimizer.min_lr_ratio = 0.1  # final learning rate, as a share of the peak
    config.optimizer.weight_decay = 0.1  # decoupled; not applied to norms and biases
    config.optimizer.b1 = 0.9  # Adam first-moment decay
    config.optimizer.b2 = 0.95  # Adam second-moment decay
    config.optimizer.grad_clip_norm = 1.0  # clip the norm taken over all stages' gradients

    return config
