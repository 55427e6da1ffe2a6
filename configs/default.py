"""The default run: a tiny byte-level GPT on the standard library, on CPU.

Command line (``python train.py`` with no flags runs exactly this):

  python train.py --config=configs/default.py --workdir=runs/default

On a CPU-only machine this fakes 8 CPU devices for a 4-rank pipeline x 2-way
data mesh and runs 1F1B.

Expected result: the held-out loss (8 batches from the held-out 10% of a 4 MiB
sample of the running Python's standard library source) falls from 5.52 nats
(uniform over bytes is ln 256 = 5.55) to about 2.4 after 300 steps (5.5212 ->
2.4107 measured on Python 3.11 with jax 0.10.2, 5.5248 -> 2.3866 on Python
3.13 with jax 0.12.0; each Python's library is other text; the README's table
has every evaluation). 0.44M parameters, 300 steps of 32 x 64 tokens: on a
2-core CPU `python train.py` takes 67 s in all on a quiet machine (compiles,
7 evaluations and 3 checkpoints included; a median step of 163 ms, 12,600
tokens/s, Python 3.11) and about 2 minutes on a loaded one (270-300 ms).
The 8 fake devices share the 2 cores, so this shows no pipeline speed-up; the
same config with ``--config.mesh.pipe=1`` gives the same losses to float32
precision (tests/test_train.py).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    """The default config."""
    config = ml_collections.ConfigDict()

    # Pipeline.
    config.schedule = "1f1b"  # built-in name, a CSV file, or "path/to/file.py:function"
    config.num_microbatches = 8  # M; must divide batch_size / (mesh.data * mesh.fsdp)
    config.chunks = 0  # stages per rank V; 0 = the schedule's own (interleaved_1f1b, zbv: 2)
    config.tick_layout = "auto"  # "unit", "packed", or "auto": packed where no slower
    # "spmd": the step is one program every device runs in lock step (TPUs, one jit);
    # "mpmd": one program per piece on its rank's devices, no conditionals (GPUs).
    config.lowering = "spmd"
    config.layers_per_stage = ""  # blocks per stage, e.g. "3,4,4,3"; "" = balanced
    # A plan file from `python -m jpipe.plan ... --save FILE`; "" = none. When set, it
    # sets mesh, layers_per_stage, schedule, chunks, num_microbatches and batch_size.
    config.plan = ""
    # Whether the plan file may name code (a schedule "file.py:fn", which train.py would
    # import and run); False refuses such a plan unless config.schedule names the same
    # spec. A plan file is data: set True only for one you trust (docs/trust.md).
    config.trust_plan = False
    # Start from trained parameters instead of fresh ones: a run directory (its newest
    # checkpoint) or a .npz file from jpipe.train.save_params; "" = model.init
    # (docs/checkpoints.md).
    config.init_from = ""
    # Compile only: build the train step of this config from shapes (nothing of the model
    # made, no data read, no checkpoint or --workdir touched; fake CPU devices stand in for
    # the mesh's), compile it, print each device's bytes (a table, then one JSON line) and
    # exit 0 if every device fits compile_only_device_memory, 1 if not
    # (jpipe.train.compile_only; docs/scale.md).
    config.compile_only = False
    # A device's memory for that check: bytes as a string ("80GB", "72GiB", "8e10") or a
    # device kind jpipe's planner knows ("A100-80", "A100-40", "GH-96", "V100-16", ...).
    config.compile_only_device_memory = "80GB"
    # Beside the compiled bytes, jpipe's byte model's prediction (predicted_bytes); under
    # lowering="spmd" it compiles each stage's pieces alone, about as long again as the step.
    config.compile_only_predict = True

    # Devices.
    config.mesh = ml_collections.ConfigDict()
    config.mesh.pipe = 4  # ranks on the pipeline axis
    config.mesh.data = 2  # data-parallel replicas
    config.mesh.fsdp = 1  # replicas that also split parameters and optimizer state (ZeRO-3)
    config.mesh.tensor = 1  # devices splitting each block Megatron-style (heads, MLP width)
    config.mesh.pipe_hosts = 0  # hosts (processes) the pipe axis spans; 0 = the default order
    config.mesh.data_hosts = 0  # hosts the data axis spans (docs/multihost.md says which)
    # Each rank's own tensor degree, e.g. "1,2,2" (lowering="mpmd" only, which gives each
    # rank a mesh of its own); "" gives every rank mesh.tensor.
    config.mesh.tensor_per_rank = ""
    config.cpu_devices = 0  # fake CPU devices per process on a CPU-only host; 0 = as the mesh needs

    # Run length and reporting.
    config.steps = 300  # optimizer steps
    config.log_every = 10  # steps between progress-bar / metrics.jsonl updates
    config.eval_every = 50  # steps between held-out evaluations (and one at the end)
    config.eval_batches = 8  # global batches per held-out evaluation
    config.checkpoint_every = 100  # steps between checkpoints (and one at the end)
    # Figures of your own at each evaluation: "path/to/file.py:function", called as
    # fn(params, batch) -> {name: float} with the model's per-stage parameters (as its
    # init makes them) and each held-out batch; the means go to metrics as eval_NAME.
    config.eval_fn = ""
    config.profile = False  # measure per-stage F/B/I/W times and predict the step time
    config.seed = 0  # fixes the initial weights and the order of the data

    # Data: bytes by default, so the vocabulary is 256 (data.tokenizer="bpe" for BPE tokens).
    config.batch_size = 32  # global batch, in sequences of model.seq_len tokens
    config.data = ml_collections.ConfigDict()
    # "" = the text corpus below; or a function giving batches, path/to/file.py:function
    # or a registered name (jpipe.train.sources); the section's other fields are its options.
    config.data.source = ""
    config.data.path = ""  # text files / directories, comma-separated; "" = Python's stdlib source
    config.data.max_bytes = 4 * 2**20  # read at most this much of the corpus; 0 = all of it
    config.data.eval_fraction = 0.1  # the last this share of the corpus's bytes is held out
    # "bytes" (vocabulary 256) or "bpe": a BPE tokenizer of model.vocab_size tokens trained
    # here on the training text (jpipe.train.tokens; configs/bpe_8k.py), loaded with Grain.
    config.data.tokenizer = "bytes"
    # Tokens in one row of a batch, for the tokens/s figure; 0 = not stated: the text
    # corpus states model.seq_len, and a source's batches are counted in rows/s.
    config.data.tokens_per_row = 0

    # Model (jpipe.models.GPTConfig).
    config.model = ml_collections.ConfigDict()
    # "gpt", or path/to/file.py:function building a jpipe.models.StagedModel from
    # jpipe.models.BuildArgs (the fields below are then that model's own).
    config.model.name = "gpt"
    config.model.vocab_size = 256  # bytes
    config.model.seq_len = 64  # L, tokens per sequence
    config.model.num_layers = 8  # transformer blocks over all stages
    config.model.num_heads = 4  # attention heads; must divide d_model
    config.model.d_model = 64  # D, model width
    config.model.d_ff = 256  # MLP hidden width
    config.model.dtype = "float32"  # compute dtype: "float32", "bfloat16" or "float16"
    # Run each stage's blocks in one nn.scan (stacked per-stage block weights; the
    # same model and initial weights as unrolled, one traced block per stage).
    config.model.scan_layers = False
    # Recompute the head's logits in the backward instead of keeping them: with a
    # real vocabulary they are most of what a microbatch keeps (GPT-2 small: 3.2 GiB
    # of the head's residuals per 4 x 1,024 tokens), for one more head matmul.
    config.model.remat_logits = False
    # Compute the head's logits over this many slices of the sequence in turn, each
    # recomputed in the backward, so that the head's working memory holds one slice's
    # float32 logits (GPT-2 small at 4 x 1,024 tokens: 0.77 GiB, and as much for their
    # gradient); 1 = all at once. Must divide seq_len.
    config.model.logit_chunks = 1
    # Dropout rate on the embeddings and each block's attention and MLP outputs (GPT-2's
    # places); 0 = none. Each row's masks come from (seed, step, row), so a resumed run
    # or another mesh draws the same ones; evaluation runs without dropout.
    config.model.dropout = 0.0
    # How attention is computed: "xla" (the L x L scores materialized), "blockwise"
    # (flash-style in plain JAX, never holding the scores; any platform) or "cudnn"
    # (the GPU's fused kernel). Llama-3-8B at 4,096 tokens on pipe 4 x tensor 2:
    # 113.4 GB of temp per device with "xla", 26.3 GB with "blockwise" and remat="full"
    # (python -m bench.scale).
    config.model.attention = "xla"
    config.model.attention_block = 512  # "blockwise"'s tile (a divisor of seq_len)
    # Per-block rematerialization: "none", "full" (keep only each block's input),
    # "dots" (keep the matmul outputs) or "attention" (keep the attention's output).
    config.model.remat = "none"
    # Over mesh.tensor > 1 (jpipe.models.vocab, jpipe.models.sequence): the embedding and
    # the head split by vocabulary rows, with a cross-entropy that never gathers the
    # logits; and the activations between the split matmuls split along the sequence
    # (all-gather before, reduce-scatter after). Llama-3-8B at 8,192 tokens on pipe 4 x
    # tensor 2 (configs/llama3_8b.py, which turns both on), SPMD: 58.32 GB a device without
    # them, 47.42 GB with both (python -m bench.scale --seq 8192 --microbatches 16).
    config.model.vocab_split = False
    config.model.sequence_parallel = False

    # Optimizer: AdamW, linear warm-up then cosine decay, global-norm clipping.
    config.optimizer = ml_collections.ConfigDict()
    # "adamw", "adam" (weight decay added to the gradient, as L2), "sgd" (with momentum
    # below; decay as L2) or "lion" (b1, b2; decoupled decay); jpipe.train.optimizer.
    config.optimizer.name = "adamw"
    # "warmup_cosine" (linear warm-up, cosine decay to min_lr_ratio), "warmup_linear"
    # (linear warm-up, linear decay to min_lr_ratio) or "constant" (after the warm-up).
    config.optimizer.lr_schedule = "warmup_cosine"
    config.optimizer.momentum = 0.9  # sgd's momentum; 0 = plain SGD
    config.optimizer.learning_rate = 3e-3  # peak learning rate, reached after warm-up
    config.optimizer.warmup_steps = 30  # linear warm-up from 0
    config.optimizer.min_lr_ratio = 0.1  # final learning rate, as a share of the peak
    config.optimizer.weight_decay = 0.1  # decoupled; not applied to norms and biases
    config.optimizer.b1 = 0.9  # Adam first-moment decay
    config.optimizer.b2 = 0.95  # Adam second-moment decay
    config.optimizer.grad_clip_norm = 1.0  # clip the norm taken over all stages' gradients
    # ZeRO-1: split the optimizer state over mesh.data too (bytes per device / data),
    # for one all-gather of the parameters over data a step.
    config.optimizer.shard_over_data = False

    return config
