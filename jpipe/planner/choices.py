"""Attention and rematerialization: what a layer keeps under the model's memory options.

jpipe's models choose how attention runs (``attention``: ``"xla"`` materializes
the ``heads x L x L`` scores, ``"blockwise"`` and ``"cudnn"`` are flash-style
and never hold them) and what each transformer block keeps for its backward
(``remat``: ``"none"``, ``"full"``, ``"dots"``, ``"attention"``;
`jpipe.models.attention`). A profile measures a layer's residual bytes under
one choice; this pass derives them under another, so the planner can say
which choice makes a cluster fit. It is a model, not a measurement.

**What the published profiles measured.** Sailor's ``act_mem_floats`` is the
growth of ``torch.cuda.memory_allocated()`` across one layer's forward
(``sailor/profiling/profile_utils.py``), in fp32, of one sequence, under
Megatron-DeepSpeed with neither flash attention nor activation checkpointing,
at the sequence lengths of ``third_party/Megatron-DeepSpeed/profile_all.py``
(`SAILOR_SHAPES`). Per transformer block at tensor degree T it is, for every
model and every T in the data, ``R(T) + a s^2 / T`` floats to within 0.2%:
one fp32 copy of the attention probabilities (``a / T`` heads of ``s x s``;
Korthikanti et al. 2022's ``5 a s / h`` term of ``s b h`` bytes is that copy
with fp16 scores, a dropout mask and the dropped-out copy; these runs have no
attention dropout) plus the rest, ``R(T)``: 28 ``s h`` floats at T = 1 for
LLAMA-3-8, 11 for OPT-350 and OPT-30 (Korthikanti's ``34 s b h`` bytes at 2
bytes an element are 17 ``s h`` elements with dropout masks).

**The model** (per block, one sequence, ``e`` bytes an element, ``x = e s h``
the block's input), from the measured ``A(T)``:

- attention ``"xla"``: ``A(T)``, as measured;
- ``"blockwise"``/``"cudnn"``: ``A(T) - e a s^2 / T + e a s / T``: the
  probabilities go, one log-sum-exp per query and head comes;
- remat ``"none"``: the attention's bytes, all kept until the backward;
- ``"full"``: ``x`` kept; the backward re-runs one block's forward, so one
  block's bytes under the attention choice are held once, while it runs
  (Korthikanti: "only the input of each layer", plus one layer's activations);
- ``"attention"``: ``x`` and the attention's output, ``e s h / T``;
- ``"dots"``: ``x`` and the outputs of the projections: queries, keys and
  values ``e s (h + 2 kv h / a) / T``, the attention's output projection and
  the MLP's output ``e s h`` each, the MLP's input projection ``e s f / T``
  (``2 f`` when gated); at most the attention's bytes.

The embedding and the head are not blocks and keep their measured bytes.

**Time.** A flash-style attention is taken to cost what the measured one does
(the same matrix products). ``"full"`` and ``"attention"`` recompute a
block's forward in its backward, so the backward grows by the forward;
``"dots"`` recomputes the attention's two inner products (and the
elementwise ops, left out), the share ``4 s^2 h / (4 s^2 h + 2 s P)`` of the
forward's FLOPs, with P the block's parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

# The choices of `jpipe.models.attention` (IMPLEMENTATIONS, REMAT_POLICIES), named here
# so that the planner runs without importing JAX; a test checks they agree.
ATTENTION = ("xla", "blockwise", "cudnn")
REMAT = ("none", "full", "dots", "attention")
AUTO = "auto"
# The order the search tries remat policies in: the cheaper in time first.
_REMAT_ORDER = ("none", "dots", "attention", "full")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The shape of a profiled model, as far as its activation bytes depend on it.

    Attributes:
      sequence_length: L (tokens per sequence) the profile measured.
      hidden: D, the model width.
      heads: attention (query) heads.
      kv_heads: key/value heads (``heads`` for multi-head attention).
      ffn: the MLP's hidden width.
      gated_mlp: whether the MLP's input projection has two halves (SwiGLU).
      block_layers: the profile layers that are transformer blocks.
      attention, remat: the choices the profile's bytes were measured under.
      element_bytes: bytes of one element of the measured activations.
      source: where these figures come from.
    """

    sequence_length: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    gated_mlp: bool
    block_layers: tuple[int, ...]
    attention: str = "xla"
    remat: str = "none"
    element_bytes: int = 4
    source: str = ""

    def __post_init__(self):
        for name in ("sequence_length", "hidden", "heads", "kv_heads", "ffn", "element_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"model shape {name} is {v!r}; it must be a whole number >= 1")
        if self.attention not in ATTENTION or self.remat not in REMAT:
            raise ValueError(
                f"model shape: measured under attention {self.attention!r}, remat "
                f"{self.remat!r}; the choices are {ATTENTION} and {REMAT}"
            )
        object.__setattr__(self, "block_layers", tuple(int(l) for l in self.block_layers))

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["block_layers"] = list(self.block_layers)
        return d

    @classmethod
    def from_json(cls, d: dict, num_layers: int) -> ModelShape:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"unknown model shape fields {unknown}; the fields are {names}")
        try:
            shape = cls(**d)
        except TypeError as e:
            raise ValueError(f"model shape: {e}") from None
        bad = [l for l in shape.block_layers if not 0 <= l < num_layers]
        if bad:
            raise ValueError(f"model shape block_layers {bad} are not layers 0..{num_layers - 1}")
        return shape


# The models of Sailor's profiles as its profiler ran them
# (third_party/Megatron-DeepSpeed/profile_all.py: layers, width, heads, sequence length;
# Megatron's default MLP width 4 D; multi-head attention, as no --num-key-value-heads is
# passed). Its "LLAMA-3-8" is Llama-like (SwiGLU, 4 D wide, with biases: llm_info's
# 268,496,896 parameters a block), not Llama-3-8B's grouped-query attention and 14,336.
def _sailor(s, h, a, blocks, gated=False, what=""):
    return ModelShape(
        sequence_length=s,
        hidden=h,
        heads=a,
        kv_heads=a,
        ffn=4 * h,
        gated_mlp=gated,
        block_layers=tuple(range(1, blocks + 1)),
        source=f"Sailor's Megatron-DeepSpeed profiling runs (profile_all.py){what}",
    )


SAILOR_SHAPES = {
    "OPT-350": _sailor(2048, 1024, 16, 24),
    "GPT-Neo-2.7": _sailor(2048, 2560, 20, 32),
    "OPT-30": _sailor(2048, 7168, 56, 48),
    "LLAMA-3-8": _sailor(8192, 4096, 32, 32, gated=True, what="; SwiGLU MLP"),
}


@dataclasses.dataclass(frozen=True)
class MemoryChoice:
    """An attention implementation and a remat policy (`jpipe.models.attention`)."""

    attention: str = "xla"
    remat: str = "none"

    def __str__(self) -> str:
        remat = "no remat" if self.remat == "none" else f"{self.remat} remat"
        return f"{self.attention} attention, {remat}"

    def to_json(self) -> dict:
        return {"attention": self.attention, "remat": self.remat}


def _check(attention: str, remat: str) -> None:
    if attention != AUTO and attention not in ATTENTION:
        raise ValueError(
            f"attention (--attention) must be auto or one of {', '.join(ATTENTION)}, "
            f"got {attention!r}"
        )
    if remat != AUTO and remat not in REMAT:
        raise ValueError(
            f"remat (--remat) must be auto or one of {', '.join(REMAT)}, got {remat!r}"
        )


def choices_to_try(profile, attention: str = AUTO, remat: str = AUTO) -> list[MemoryChoice]:
    """The choices a search tries, in order: the one the profile measured first, then
    the others by their time cost (`_REMAT_ORDER`), the flash-style attention before
    the materialized one under a remat (it holds less at the same cost); ``"auto"``
    leaves a field to the search, which tries ``xla`` and ``blockwise`` and the remat
    policies ``none``, ``dots`` and ``full`` (``attention`` remat holds nearly what
    ``full`` does at its cost). `[None]` for a profile without a model shape: its
    bytes stand as measured, whatever the choice."""
    _check(attention, remat)
    shape = getattr(profile, "shape", None)
    derived = profile.memory_choice
    if derived is not None:  # already derived: planned as it stands
        asked = (attention, remat)
        if any(x not in (AUTO, y) for x, y in zip(asked, (derived.attention, derived.remat))):
            raise ValueError(
                f"the profile's bytes already stand for {derived}; derive them from the "
                "profile as measured"
            )
        return [None]
    if shape is None:
        if (attention, remat) != (AUTO, AUTO):
            raise ValueError(
                f"the {profile.model} profile does not give the model's shape (sequence "
                "length, width, heads), so its bytes cannot be taken to another attention or "
                "remat choice (--attention/--remat); profile the model under the choice "
                "(train.py --config.profile=True)"
            )
        return [None]
    measured = MemoryChoice(shape.attention, shape.remat)
    attns = [attention] if attention != AUTO else ["xla", "blockwise"]
    remats = [remat] if remat != AUTO else ["none", "dots", "full"]
    out = [MemoryChoice(a, r) for a in attns for r in remats]
    out.sort(key=lambda c: (c != measured, _REMAT_ORDER.index(c.remat), c.attention == "xla"))
    if attention == AUTO:  # under a remat, xla costs what blockwise does and holds more
        out = [c for c in out if c.remat == "none" or c.attention != "xla"]
    return out


def block_bytes(shape: ModelShape, measured: float, tp: int, choice: MemoryChoice):
    """``(kept, recompute)`` bytes of one block for one sequence at tensor degree `tp`
    under `choice`, from its `measured` bytes (module docstring): what it keeps until
    its backward, and what its backward holds once while it re-runs the forward."""
    e, s, h, a = shape.element_bytes, shape.sequence_length, shape.hidden, shape.heads
    scores = e * a * s * s / tp
    if shape.attention == "xla":  # the measured bytes hold the probabilities
        rest = measured - scores
        if rest <= 0:
            raise ValueError(
                f"a block's measured {measured:.4g} bytes at T={tp} do not hold the "
                f"{scores:.4g} bytes of attention probabilities the model shape implies "
                f"(L={s}, {a} heads): the shape does not describe this profile"
            )
    else:
        rest = measured - e * a * s / tp
    attended = rest + scores if choice.attention == "xla" else rest + e * a * s / tp
    x = e * s * h
    if choice.remat == "none":
        return attended, 0.0
    if choice.remat == "full":
        kept = x
    elif choice.remat == "attention":
        kept = x + e * s * h / tp
    else:  # dots: the block's input and the outputs of its projections
        qkv = h + 2 * shape.kv_heads * (h // a)
        mlp_in = shape.ffn * (2 if shape.gated_mlp else 1)
        kept = min(attended, x + e * s * ((qkv + mlp_in) / tp + 2 * h))
    return kept, attended


def recompute_share(shape: ModelShape, block_params: float, remat: str) -> float:
    """The share of a block's forward its backward runs again under `remat`."""
    if remat == "none" or remat == shape.remat:
        return 0.0
    if remat in ("full", "attention"):
        return 1.0
    s, h = shape.sequence_length, shape.hidden
    inner = 4.0 * s * s * h  # q k^T and p v, for one sequence
    return inner / (inner + 2.0 * s * block_params)


def with_choice(profile, choice: MemoryChoice | None):
    """`profile` with its block bytes and times under `choice` (module docstring).

    `None`, or the choice the profile measured, returns it unchanged; otherwise the
    result's `memory_choice` names the choice; its ``recompute_bytes`` give what a block's
    backward holds once while it re-runs the forward.
    """
    shape = profile.shape
    if choice is None or shape is None:
        return profile
    if profile.memory_choice is not None:
        raise ValueError(
            f"the profile's bytes already stand for {profile.memory_choice}; adjust the "
            "profile as measured"
        )
    if choice == MemoryChoice(shape.attention, shape.remat):
        return profile
    if shape.remat != "none":
        raise ValueError(
            f"the {profile.model} profile was measured with {shape.remat} remat; its bytes "
            "hold what that policy keeps, not a block's own, so they cannot be taken to "
            "another choice"
        )
    blocks = set(shape.block_layers)
    activation, recompute = {}, {}
    for t, row in profile.activation_bytes.items():
        pairs = [
            block_bytes(shape, x, t, choice) if l in blocks else (x, 0.0) for l, x in enumerate(row)
        ]
        activation[t] = tuple(k for k, _ in pairs)
        recompute[t] = tuple(r for _, r in pairs)
    t0 = min(profile.params)
    params = [p * t0 for p in profile.params[t0]]  # a block's parameters at T = 1
    share = [
        recompute_share(shape, params[l], choice.remat) if l in blocks else 0.0
        for l in range(profile.num_layers)
    ]
    times = {d: {k: _recomputing(lt, share) for k, lt in table.items()}
             for d, table in profile.times.items()}  # fmt: skip
    return dataclasses.replace(
        profile,
        activation_bytes=activation,
        recompute_bytes=recompute if choice.remat != "none" else {},
        times=times,
        memory_choice=choice,
        derived=set(),
        _links={},
    )


def _recomputing(lt, share: Sequence[float]):
    """`lt` with each layer's backward (and input gradient) grown by `share` of its forward."""
    if not any(share):
        return lt
    more = [f * k for f, k in zip(lt.forward, share, strict=True)]
    grow = lambda xs: None if xs is None else tuple(x + m for x, m in zip(xs, more))  # noqa: E731
    return dataclasses.replace(lt, backward=grow(lt.backward), input_grad=grow(lt.input_grad))
