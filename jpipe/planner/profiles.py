"""Profiles: what a model costs on each kind of device, what it holds, and how fast the links are.

A `Profile` is the planner's input, measured once per model and device type:

- per layer, per device type, per (microbatch size B, tensor-parallel degree
  T): forward, backward, and (where known) input-gradient and weight-gradient
  times, and the optimizer-update time, in seconds (`LayerTimes`);
- per layer and tensor-parallel degree T, *for one sequence*: parameters held
  by one GPU (`params`), residual (activation) bytes one GPU keeps from F to
  the backward (`activation_bytes`); per layer, the bytes of its output sent
  to the next stage (`output_bytes`, the same under every T). A microbatch of
  B sequences holds and sends B times these;
- the runtime's own memory terms (`MemoryTerms`): bytes per parameter
  (weights, gradients, optimizer state, buffers), a fixed per-device
  overhead, the working memory of the running piece as a multiple of its
  stage's residuals, and the fraction of a device's memory the runtime can
  allocate;
- per device type: its memory in bytes;
- links (`Link`): inside a node per device type and GPU count, and between
  nodes per pair of (device type, GPUs per node).

On disk a profile is one JSON object (`save_profile` / `load_profile`, format
``"jpipe-profile/2"``; the earlier ``/1``, whose bytes were keyed by B, is
read and converted). `load_sailor_profile` imports the published Sailor
profiles (vendored in ``jpipe/_data/sailor``): Sailor's ``llm_info.json`` is
keyed by T and gives one sequence's floats, which the importer scales by the
runtime's element size (4 bytes: the measured runs trained in fp32), and the
profile carries Sailor's runtime's memory terms (`SAILOR_RUNTIME`); links the
data repeats from another pair of nodes are read from their own pair's fit
(`Profile.link_notes` says which). `profile_from_stage_times` turns the trainer's measured
per-stage F/I/W times and bytes into the same format.

Missing entries are derived, never invented: `Profile.times` takes an absent
tensor-parallel degree from the nearest present one scaled by the ratio the
profile itself shows between those degrees at other microbatch sizes (ideal
``1/T`` scaling only when the profile has no such pair), and an absent
microbatch size from the nearest present one scaled linearly in B; an absent
T in the bytes is the nearest present one scaled by ``1/T``. What it derived
is listed in `Profile.derived` so a report can say so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Sequence

from jpipe.planner.choices import SAILOR_SHAPES, MemoryChoice, ModelShape
from jpipe.runtime.jsonfile import read_json

FORMAT = "jpipe-profile/2"
OLD_FORMATS = ("jpipe-profile/1",)
SAILOR_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_data", "sailor")

# Memory of the device types in the Sailor data (GiB, as Sailor's own constants give
# them; the data files omit it). Sailor's "RTX-2080" nodes are 11 GiB cards.
GIB = 1024**3
DEVICE_MEMORY = {
    "A100-40": 40 * GIB,
    "A100-80": 80 * GIB,
    "GH-96": 96 * GIB,
    "V100-16": 16 * GIB,
    "RTX-2080": 11 * GIB,
    "RTX-3090": 24 * GIB,
    "Titan-RTX": 24 * GIB,
}
# The element size of Sailor's floats in its runs: 4 bytes. The measured runs trained in
# fp32 (ae_scripts/clariden_scripts/run_opt.slurm and Megatron-DeepSpeed/run.sh, the
# RTX launcher, pass no --fp16/--bf16), and Sailor's validation simulates them so
# (simulations/validation/validate.py passes fp16=False: float_size 4).
SAILOR_ELEMENT_BYTES = 4

# What a figure of a profile may be, per unit: the smallest non-zero value, the largest,
# whether 0 is allowed (an unmeasured figure), and what a figure below or above usually
# is. The ranges are far wider than any device's, so that only a figure in another unit
# (GiB given as bytes, TFLOP as FLOP, milliseconds as seconds) falls outside.
PLAUSIBLE = {
    # one layer's bytes for one sequence (activations, outputs)
    "bytes": (
        1.0,
        2.0**40,
        True,
        "a size in KiB, MiB or GiB given as bytes",
        "bits, or a total rather than one layer's for one sequence",
    ),
    # what one layer passes on for one sequence: a stage that returns the loss passes
    # on 4 bytes a microbatch, a fraction of a byte a sequence
    "output_bytes": (
        1e-6,
        2.0**40,
        True,
        "a size in KiB, MiB or GiB given as bytes",
        "bits, or a total rather than one layer's for one sequence",
    ),
    # a device's memory
    "device_bytes": (
        2.0**20,
        2.0**48,
        False,
        "a memory in GiB or GB given as bytes (write 8e9, not 8)",
        "more than any device has",
    ),
    # parameters of one layer (a count, not bytes)
    "params": (
        1.0,
        1e13,
        True,
        "a count in millions or billions",
        "more than any layer has: bytes rather than a count?",
    ),
    # seconds one layer takes for one microbatch
    "seconds": (
        1e-9,
        3600.0,
        True,
        "hours given as seconds, or a rate rather than a time",
        "milliseconds or microseconds given as seconds",
    ),
    # a link's bandwidth
    "bytes_per_s": (
        1e5,
        1e14,
        False,
        "GB/s or MB/s given as bytes/s",
        "faster than any link: bits/s rather than bytes/s?",
    ),
    # a device's compute rate
    "flops_per_s": (
        1e8,
        1e17,
        False,
        "TFLOP/s or GFLOP/s given as FLOP/s",
        "faster than any device",
    ),
    # the work of one stage or layer for one microbatch
    "flops": (1.0, 1e20, True, "TFLOP or GFLOP given as FLOP", "more than any stage does"),
}


def check_plausible(value, unit: str, field: str, where: str = "") -> float:
    """`value` as a float, refused with one line naming `where` and `field` unless plausible.

    It must be a finite number (not a string or a boolean) at least 0 and,
    where not 0 (0 only for units that allow an unmeasured figure), within
    `PLAUSIBLE` ``[unit]``'s range. ``bytes_per_s`` may also be infinite (a
    link whose transfers are free, as an unmeasured profile writes it).

    Raises:
      ValueError: ``WHERE: FIELD is VALUE; ...`` saying what is accepted.
    """
    lo, hi, zero_ok, low, high = PLAUSIBLE[unit]
    at = f"{where}: {field}" if where else field
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{at} is {value!r}; it must be a number ({unit})")
    if unit == "bytes_per_s" and value == math.inf:
        return math.inf
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{at} is {value!r}; it must be a finite number >= 0 ({unit})")
    if value == 0 and zero_ok:
        return 0.0
    if not lo <= value <= hi:
        raise ValueError(
            f"{at} is {value:g}, outside the plausible {lo:g} to {hi:g} {unit}"
            f"{' (or 0, unmeasured)' if zero_ok else ''}: "
            f"{low if value < lo else high}?"
        )
    return float(value)


@dataclasses.dataclass(frozen=True)
class MemoryTerms:
    """What a training runtime holds on one device besides the model's live values.

    A device's footprint is ``its overhead (`overhead_for`) + bytes_per_param x
    its parameters + its live residuals and carries (the simulator's peak) +
    working_factor x the residual bytes of one microbatch of its largest stage``
    (the working memory of the piece that runs), against ``usable_fraction x``
    its memory.

    Attributes:
      weight_bytes, gradient_bytes, optimizer_bytes, buffer_bytes: bytes per
        parameter for the weights, the gradients, the optimizer state and the
        runtime's other per-parameter buffers (all-reduce buckets, copies).
      overhead_bytes: fixed per device (the runtime's context, communication
        libraries, kernels, the allocator's cache), for a device type not in
        `device_overhead_bytes`.
      working_factor: working memory of the running piece, in units of the
        residual bytes one microbatch of its stage keeps.
      usable_fraction: the share of a device's memory the runtime may allocate
        (XLA preallocates 75% of a GPU by default).
      source: where the figures come from, for reports.
      single_gpu_overhead_bytes: the overhead of a device outside any
        tensor-parallel group (T = 1), where it differs (`None`: the same).
      device_overhead_bytes: ``(device type, bytes)`` pairs: the overhead of
        those types, at every T (a dict is accepted).
    """

    weight_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    buffer_bytes: float
    overhead_bytes: float
    working_factor: float
    usable_fraction: float = 1.0
    source: str = ""
    single_gpu_overhead_bytes: float | None = None
    device_overhead_bytes: tuple[tuple[str, float], ...] = ()

    def __post_init__(self):
        per_device = self.device_overhead_bytes
        if isinstance(per_device, dict):
            per_device = per_device.items()
        per_device = tuple(sorted((str(k), v) for k, v in per_device))
        object.__setattr__(self, "device_overhead_bytes", per_device)
        checks = [
            (f.name, getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name not in ("source", "device_overhead_bytes", "single_gpu_overhead_bytes")
        ]
        if self.single_gpu_overhead_bytes is not None:
            checks.append(("single_gpu_overhead_bytes", self.single_gpu_overhead_bytes))
        checks += [(f"device_overhead_bytes[{k!r}]", v) for k, v in per_device]
        for name, v in checks:
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"memory term {name} is {v!r}; it must be a number >= 0")
        if not 0 < self.usable_fraction <= 1:
            raise ValueError(
                f"memory term usable_fraction is {self.usable_fraction!r}; it must be in (0, 1]"
            )

    @property
    def bytes_per_param(self) -> float:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes + self.buffer_bytes

    def overhead_for(self, kind: str, tensor_parallel: int = 1) -> float:
        """The fixed overhead of one device of type `kind` in a group of `tensor_parallel`."""
        for k, v in self.device_overhead_bytes:
            if k == kind:
                return v
        if tensor_parallel <= 1 and self.single_gpu_overhead_bytes is not None:
            return self.single_gpu_overhead_bytes
        return self.overhead_bytes

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["device_overhead_bytes"] = dict(self.device_overhead_bytes)
        return d

    @classmethod
    def from_json(cls, d: dict) -> MemoryTerms:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"unknown memory terms {unknown}; the terms are {names}")

        def number(k, v):
            if not isinstance(v, int | float) or isinstance(v, bool):
                raise ValueError(f"memory term {k} is {v!r}; it must be a number")
            return float(v)

        def read(k, v):
            if k == "source" or (k == "single_gpu_overhead_bytes" and v is None):
                return v
            if k == "device_overhead_bytes":
                if not isinstance(v, dict):
                    raise ValueError(f"memory term {k} is {v!r}; it must be an object")
                return {str(kind): number(f"{k}[{kind!r}]", b) for kind, b in v.items()}
            return number(k, v)

        return cls(**{k: read(k, v) for k, v in d.items()})


# Sailor's runtime (DeepSpeed's pipeline engine on Megatron-DeepSpeed, fp32 with Adam:
# its launch scripts pass neither --fp16 nor --bf16 and its DeepSpeed config has no
# fp16 section), as Sailor's own memory model counts it: an fp32 copy of the weights
# (4), fp32 gradients (4), Adam's two moments (8), the gradient all-reduce buffer (4)
# and the copy of the model DeepSpeed makes when it starts (4), and no working-memory
# term (a stage holds its residuals for S - s microbatches, nothing more). The fixed
# overhead is the CUDA context, NCCL and the kernels nvidia-smi counts beside torch's
# memory, which Sailor's code says depends on the GPU and platform: its simulator, whose
# memory was validated on GH200 only (ae_scripts/validation/run_gh200_mem.sh), adds
# 4.76 GB of fused kernels and 0.3 GB more; its planner, for every other device, 2.0 GB
# at T = 1 and 3.0 GB at T > 1 (planner_utils.cpp check_stage_fits,
# runtime_simulator.py check_config_fits). docs/planner-validation.md tests both.
SAILOR_RUNTIME = MemoryTerms(
    weight_bytes=4,
    gradient_bytes=4,
    optimizer_bytes=8,
    buffer_bytes=8,
    overhead_bytes=3.0e9,
    working_factor=0.0,
    usable_fraction=1.0,
    source="Sailor's runtime (DeepSpeed, fp32 Adam), from Sailor's memory model",
    single_gpu_overhead_bytes=2.0e9,
    device_overhead_bytes={"GH-96": 4.76e9 + 0.3e9},
)

# What jpipe's own runtime holds when nothing was measured: fp32 weights, gradients
# and Adam's two moments, the step's gradient output (4), 1 GiB per device for the XLA
# runtime and communication, a working memory of 2.4 microbatches of a stage's residuals
# (what train.py --config.profile=True measures on the default GPT at four stages; 1.3
# on one stage of all its blocks, docs/planner-validation.md), and XLA's default
# preallocation of 75% of a GPU. Not validated on a GPU: `config.profile=True` writes
# the measured terms.
JPIPE_RUNTIME = MemoryTerms(
    weight_bytes=4,
    gradient_bytes=4,
    optimizer_bytes=8,
    buffer_bytes=4,
    overhead_bytes=float(GIB),
    working_factor=2.4,
    usable_fraction=0.75,
    source="jpipe's runtime, defaults (not measured)",
)


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """Seconds per layer for one microbatch on one device type at one (B, T).

    ``input_grad``/``weight_grad`` are `None` when only the full backward was
    measured; `split` then assumes half each.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    update: tuple[float, ...]
    input_grad: tuple[float, ...] | None = None
    weight_grad: tuple[float, ...] | None = None

    def split(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(input-gradient, weight-gradient) times; half the backward each if not measured."""
        if self.input_grad is not None and self.weight_grad is not None:
            return self.input_grad, self.weight_grad
        half = tuple(b / 2 for b in self.backward)
        return half, half

    def scaled(self, factor: float) -> LayerTimes:
        f = lambda xs: None if xs is None else tuple(x * factor for x in xs)  # noqa: E731
        return LayerTimes(
            f(self.forward), f(self.backward), self.update, f(self.input_grad), f(self.weight_grad)
        )

    def to_json(self) -> dict:
        out = {"forward": self.forward, "backward": self.backward, "update": self.update}
        if self.input_grad is not None:
            out["input_grad"], out["weight_grad"] = self.input_grad, self.weight_grad
        return {k: list(v) for k, v in out.items()}


@dataclasses.dataclass(frozen=True)
class Link:
    """A link's bandwidth: Sailor's fitted curve, or a flat figure.

    Bandwidth in GB/s is ``poly(log2(bytes / 1e6))`` (coefficients highest
    power first), capped at ``max_bytes_per_s``; with no coefficients it is
    ``max_bytes_per_s`` for every size.
    """

    max_bytes_per_s: float
    coeffs: tuple[float, ...] = ()

    def bytes_per_s(self, nbytes: float) -> float:
        if not self.coeffs or nbytes <= 0:
            return self.max_bytes_per_s
        x = math.log2(nbytes / 1e6)
        gbps = 0.0
        for c in self.coeffs:
            gbps = gbps * x + c
        # The fits are quadratics that turn down outside the measured range; a
        # floor of 1% of the peak keeps a tiny or huge message finite.
        return min(self.max_bytes_per_s, max(gbps * 1e9, 0.01 * self.max_bytes_per_s))

    def seconds(self, nbytes: float) -> float:
        """Time to send `nbytes` over the link."""
        return 0.0 if nbytes <= 0 else nbytes / self.bytes_per_s(nbytes)

    def to_json(self) -> dict:
        return {"max_bytes_per_s": self.max_bytes_per_s, "coeffs": list(self.coeffs)}

    @classmethod
    def from_json(cls, d) -> Link:
        return cls(float(d["max_bytes_per_s"]), tuple(float(c) for c in d.get("coeffs", ())))


@dataclasses.dataclass(frozen=True)
class Profile:
    """A model's costs on several device types (see the module docstring).

    Attributes:
      model: the model's name.
      layer_kinds: ``"embedding"``, ``"block"`` or ``"head"`` per layer.
      params: ``{T: parameters per layer held by one GPU}`` at tensor-parallel degree T.
      activation_bytes: ``{T: residual bytes per layer of one sequence on one GPU}``,
        kept from F to the backward.
      output_bytes: bytes per layer of one sequence's output, sent across a stage cut.
      times: ``{device: {(B, T): LayerTimes}}``.
      memory: ``{device: bytes}``.
      memory_terms: the runtime's own memory terms (`MemoryTerms`).
      intra: ``{device: {gpus: Link}}`` inside one node.
      inter: ``{(device, gpus per node, device, gpus per node): Link}`` between nodes.
      missing: ``{device: why}`` for device files an importer could not use.
      link_notes: ``{(device, gpus per node, device, gpus per node): why}`` for
        links an importer read from another entry than their own (a flaw of the data).
      layer_blocks: transformer blocks per layer when a layer holds several
        (a profile of measured stages); `None` means one per ``"block"`` layer.
      shape: the model's shape (sequence length, width, heads) and the attention
        and remat its bytes were measured under, where known (`ModelShape`); it
        lets `jpipe.planner.choices` derive the bytes under other choices.
      recompute_bytes: ``{T: bytes per layer of one sequence}`` a layer's backward
        holds once while it re-runs its forward (remat); empty when none does.
      memory_choice: the attention and remat choice the bytes and times stand for
        when `jpipe.planner.choices.with_choice` derived them; `None` as measured.
    """

    model: str
    layer_kinds: tuple[str, ...]
    params: dict[int, tuple[float, ...]]
    activation_bytes: dict[int, tuple[float, ...]]
    output_bytes: tuple[float, ...]
    times: dict[str, dict[tuple[int, int], LayerTimes]]
    memory: dict[str, float]
    memory_terms: MemoryTerms = JPIPE_RUNTIME
    intra: dict[str, dict[int, Link]] = dataclasses.field(default_factory=dict)
    inter: dict[tuple[str, int, str, int], Link] = dataclasses.field(default_factory=dict)
    derived: set = dataclasses.field(default_factory=set, compare=False, repr=False)
    _links: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    missing: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)
    link_notes: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    layer_blocks: tuple[int, ...] | None = None
    shape: ModelShape | None = None
    recompute_bytes: dict[int, tuple[float, ...]] = dataclasses.field(default_factory=dict)
    memory_choice: MemoryChoice | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def blocks(self, layer: int) -> int:
        """Transformer blocks in profile layer `layer` (a measured stage may hold several)."""
        if self.layer_blocks is not None:
            return self.layer_blocks[layer]
        return int(self.layer_kinds[layer] == "block")

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(sorted(self.times))

    def _device(self, device: str) -> dict[tuple[int, int], LayerTimes]:
        if device not in self.times:
            why = f" ({self.missing[device]})" if device in self.missing else ""
            raise ValueError(
                f"the {self.model} profile has no device {device!r}{why}; it has "
                f"{', '.join(self.devices)}"
            )
        return self.times[device]

    def layer_times(self, device: str, mbs: int, tp: int) -> LayerTimes:
        """Per-layer times on `device` at microbatch size `mbs` and tensor-parallel `tp`."""
        table = self._device(device)
        if (mbs, tp) in table:
            return table[(mbs, tp)]
        self.derived.add((device, mbs, tp))
        total = lambda t: sum(t.forward) + sum(t.backward)  # noqa: E731
        tps_here = sorted({t for b, t in table if b == mbs})
        if tps_here:
            near = min(tps_here, key=lambda t: (abs(math.log2(t / tp)), t))
            ratios = [
                total(table[(b, tp)]) / total(table[(b, near)])
                for b, t in table
                if t == near and (b, tp) in table and total(table[(b, near)]) > 0
            ]
            factor = statistics.median(ratios) if ratios else near / tp
            return table[(mbs, near)].scaled(factor)
        sizes = sorted({b for b, t in table if t == tp}) or sorted({b for b, _ in table})
        near_b = min(sizes, key=lambda b: (abs(math.log2(b / mbs)), b))
        base = self.layer_times(device, near_b, tp)
        return base.scaled(mbs / near_b)

    def _by_tp(self, table: dict[int, tuple[float, ...]], tp: int, what: str):
        if tp in table:
            return table[tp]
        if not table:
            raise ValueError(f"the {self.model} profile has no {what}")
        near = min(table, key=lambda t: (abs(math.log2(t / tp)), t))
        self.derived.add((what, tp))
        return tuple(x * near / tp for x in table[near])

    def params_per_gpu(self, tp: int) -> tuple[float, ...]:
        """Parameters per layer one GPU holds at tensor-parallel degree `tp`."""
        return self._by_tp(self.params, tp, "parameters")

    def activations(self, mbs: int, tp: int) -> tuple[float, ...]:
        """Residual bytes per layer one GPU keeps for a microbatch of `mbs` sequences."""
        return tuple(x * mbs for x in self._by_tp(self.activation_bytes, tp, "activation bytes"))

    def recomputes(self, mbs: int, tp: int) -> tuple[float, ...]:
        """Bytes per layer a layer's backward holds once, for `mbs` sequences, while it
        re-runs its forward (remat; zeros without)."""
        if not self.recompute_bytes:
            return (0.0,) * self.num_layers
        return tuple(x * mbs for x in self._by_tp(self.recompute_bytes, tp, "recompute bytes"))

    def outputs(self, mbs: int) -> tuple[float, ...]:
        """Output bytes per layer of a microbatch of `mbs` sequences."""
        return tuple(x * mbs for x in self.output_bytes)

    def memory_of(self, device: str) -> float:
        if device not in self.memory:
            raise ValueError(
                f"the {self.model} profile does not say the memory of {device!r}; give it "
                f"(python -m jpipe.plan --memory {device}:BYTES)"
            )
        return self.memory[device]

    def intra_link(self, device: str, gpus: int) -> Link:
        """The link among `gpus` GPUs of one node (the nearest measured count)."""
        links = self.intra.get(device)
        if not links:
            raise ValueError(f"the {self.model} profile has no intra-node link for {device!r}")
        return links[min(links, key=lambda n: (abs(n - gpus), n))]

    def inter_link(self, a: str, na: int, b: str, nb: int) -> Link:
        """The link between a node of `na` GPUs of type `a` and one of `nb` of type `b`.

        Falls back to the nearest measured GPU counts for the pair, then to the
        slower of the two types' own node-to-node links.
        """
        key = (a, na, b, nb)
        if key not in self._links:
            self._links[key] = self._inter_link(a, na, b, nb)
        return self._links[key]

    def _inter_link(self, a: str, na: int, b: str, nb: int) -> Link:
        for key in ((a, na, b, nb), (b, nb, a, na)):
            if key in self.inter:
                return self.inter[key]
        pair = [
            (abs(k[1] - na) + abs(k[3] - nb), v)
            for k, v in self.inter.items()
            if {k[0], k[2]} == {a, b}
        ]
        if pair:
            return min(pair, key=lambda x: x[0])[1]
        own = [v for k, v in self.inter.items() if k[0] == k[2] and k[0] in (a, b)]
        if own:
            return min(own, key=lambda link: link.max_bytes_per_s)
        raise ValueError(f"the {self.model} profile has no link between {a!r} and {b!r} nodes")


def _sailor_json(path: str):
    """One of Sailor's JSON files, or one line naming it."""
    d = read_json(path, "Sailor file")
    if not isinstance(d, dict):
        raise ValueError(f"{path} holds a JSON {type(d).__name__}, not an object")
    return d


def _sailor_link(entry, field: str = "link", where: str = "") -> Link:
    """A ``[coefficients, peak bytes/s]`` pair of Sailor's network files, checked."""
    if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], list):
        raise ValueError(f"{where}: {field} must be [coefficients, peak bytes/s], got {entry!r}")
    coeffs, peak = entry
    for i, c in enumerate(coeffs):
        if not isinstance(c, int | float) or isinstance(c, bool) or not math.isfinite(c):
            raise ValueError(f"{where}: {field} coefficient {i} is {c!r}; it must be a number")
    return Link(
        check_plausible(peak, "bytes_per_s", f"{field} peak", where),
        tuple(float(c) for c in coeffs),
    )


# A flaw of Sailor's network fits: the Titan-RTX <-> RTX-2080 links of nodes using 1 and
# 8 GPUs carry, coefficient for coefficient, the RTX-2080 <-> RTX-3090 fit (the 1 GbE
# link of the RTX-3090 node, 0.11 GB/s), while the same pair of nodes measures 2.86 GB/s
# at 2 and 4 GPUs, as Titan-RTX <-> Titan-RTX and RTX-2080 <-> RTX-2080 do at every count.
_COPIED_LINKS = (("Titan-RTX", "RTX-2080", (1, 8), 4, ("RTX-2080", "RTX-3090")),)


def _repair_sailor_links(inter: dict) -> dict:
    """Reads each link `_COPIED_LINKS` names from its own pair's fit, where the data still
    holds the copy (the same figures as the other pair's); returns ``{key: why}``."""
    notes = {}
    for a, b, counts, own, (ca, cb) in _COPIED_LINKS:
        for n in counts:
            copy = inter.get((ca, n, cb, n)) or inter.get((cb, n, ca, n))
            source = inter.get((a, own, b, own)) or inter.get((b, own, a, own))
            for key in ((a, n, b, n), (b, n, a, n)):
                if key in inter and copy is not None and source is not None and inter[key] == copy:
                    inter[key] = source
                    notes[key] = (
                        f"the {a}<->{b} link at {n} GPUs per node repeats the {ca}<->{cb} fit; "
                        f"read as the pair's own at {own} GPUs"
                    )
    return notes


def load_sailor_profile(
    model: str, directory: str | None = None, *, repair_links: bool = True
) -> Profile:
    """Imports the published Sailor profiles of `model` (see ``jpipe/_data/sailor/README.md``).

    Args:
      model: a model folder under ``profiles/``, such as ``"OPT-350"``.
      directory: a Sailor data folder (``profiles/``, ``llm_info.json``,
        ``network/``); default: the copy inside jpipe.
      repair_links: read the links the data copies from another pair of nodes
        from their own pair's fit (`_COPIED_LINKS`); `False` keeps them as published.
    """
    directory = directory or SAILOR_DIR
    model_dir = os.path.join(directory, "profiles", model)
    if not os.path.isdir(model_dir):
        have = sorted(os.listdir(os.path.join(directory, "profiles")))
        raise ValueError(f"no Sailor profile for model {model!r} in {directory}; have {have}")
    info_path = os.path.join(directory, "llm_info.json")
    info = _sailor_json(info_path)
    if model not in info:
        raise ValueError(f"{info_path} has no model {model!r}")
    # llm_info is keyed by the tensor-parallel degree T, and its values are for one
    # sequence: parameters per GPU halve as T doubles, a layer's output is the same
    # under every T but the head's (never sent), and Sailor's own planner reads it so
    # and multiplies activations by B.
    read = _Reader(info_path)
    try:
        by_tp = {read.whole(t, f"{model} key {t!r}"): layers for t, layers in info[model].items()}
        num_layers = len(next(iter(by_tp.values())))
        order = [str(i) for i in range(num_layers)]

        def floats(t, name, scale=1):  # Sailor's counts of floats (of `scale` bytes each)
            where = f"{model}.{t}.{{}}.{name}"
            return tuple(
                scale * check_plausible(by_tp[t][i][name], "params", where.format(i), info_path)
                for i in order
            )

        params = {t: floats(t, "params_floats") for t in by_tp}
        activation = {t: floats(t, "act_mem_floats", SAILOR_ELEMENT_BYTES) for t in by_tp}
        output = floats(min(by_tp), "act_output_floats", SAILOR_ELEMENT_BYTES)
    except (KeyError, TypeError, AttributeError, StopIteration) as e:
        raise ValueError(
            f"{info_path}: {model} is not in Sailor's llm_info form ({type(e).__name__}: {e})"
        ) from None
    times, missing = {}, {}
    for device in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, device, "profile.json")
        raw, read = _sailor_json(path), _Reader(path)
        table = {}
        for b, by_tp in raw.items():
            read.typed(by_tp, f"{b}", dict)
            for t, layers in by_tp.items():
                if len(read.typed(layers, f"{b}.{t}", dict)) != num_layers:
                    # The known flaw: GPT-Neo-2.7 on GH-96 is the 26-layer OPT-350 profile.
                    missing[device] = (
                        f"its Sailor file has {len(layers)} layers, the model {num_layers}"
                    )
                    continue
                rows = [read.typed(layers.get(i), f"{b}.{t}.{i}", list) for i in order]

                def column(k, rows=rows, b=b, t=t, path=path):  # forward, backward, update s
                    return tuple(
                        check_plausible(
                            r[k] if len(r) > k else None, "seconds", f"{b}.{t}.{i}[{k}]", path
                        )
                        for i, r in zip(order, rows)
                    )

                key = (read.whole(b, f"key {b!r}"), read.whole(t, f"{b} key {t!r}"))
                table[key] = LayerTimes(forward=column(0), backward=column(1), update=column(2))
        if table:
            times[device] = table
            missing.pop(device, None)
    network = os.path.join(directory, "network")
    intra, inter = {}, {}
    path = os.path.join(network, "intra_node_bandwidths.json")
    for device, by_n in _sailor_json(path).items():
        intra[device] = {
            _Reader(path).whole(n, f"{device} key {n!r}"): _sailor_link(e, f"{device}.{n}", path)
            for n, e in by_n.items()
        }
    for name in ("multizone_bandwidths.json", "multizone_bandwidths_het.json"):
        path = os.path.join(network, name)
        raw = _sailor_json(path)
        zone = "us-central1-a"  # every measured plan ran in one zone
        for a, by_na in raw.get(zone, {}).items():
            for na, to in by_na.items():
                for b, by_nb in to.get(zone, {}).items():
                    for nb, e in by_nb.items():
                        key = (a, int(na), b, int(nb))
                        where = f"{zone}.{a}.{na}.{zone}.{b}.{nb}"
                        inter.setdefault(key, _sailor_link(e, where, path))
    link_notes = _repair_sailor_links(inter) if repair_links else {}
    kinds = tuple(
        "embedding" if i == 0 else "head" if i == num_layers - 1 else "block"
        for i in range(num_layers)
    )
    return Profile(
        model=model,
        layer_kinds=kinds,
        params=params,
        activation_bytes=activation,
        output_bytes=output,
        times=times,
        memory={d: DEVICE_MEMORY[d] for d in os.listdir(model_dir) if d in DEVICE_MEMORY},
        memory_terms=SAILOR_RUNTIME,
        intra=intra,
        inter=inter,
        missing=missing,
        link_notes=link_notes,
        shape=_sailor_shape(model, num_layers),
    )


def _sailor_shape(model: str, num_layers: int) -> ModelShape | None:
    """The model's shape as Sailor profiled it, where known and its layers agree."""
    shape = SAILOR_SHAPES.get(model)
    if shape is None or max(shape.block_layers) >= num_layers - 1:
        return None
    return shape


def profile_to_json(profile: Profile) -> dict:
    """The profile as one JSON-ready object (format ``"jpipe-profile/2"``).

    A profile whose bytes a memory choice derived (`Profile.memory_choice`) is
    refused: the file holds what was measured, and the choice is the planner's.
    """
    if profile.memory_choice is not None:
        raise ValueError(
            f"this profile's bytes stand for {profile.memory_choice}, derived by the planner; "
            "save the profile as measured"
        )
    return {
        "format": FORMAT,
        "model": profile.model,
        "layer_kinds": list(profile.layer_kinds),
        **({} if profile.layer_blocks is None else {"layer_blocks": list(profile.layer_blocks)}),
        "params": {str(t): list(v) for t, v in profile.params.items()},
        "activation_bytes": {str(t): list(v) for t, v in profile.activation_bytes.items()},
        "output_bytes": list(profile.output_bytes),
        "memory_terms": profile.memory_terms.to_json(),
        **({} if profile.shape is None else {"model_shape": profile.shape.to_json()}),
        "devices": {
            d: {
                "memory_bytes": profile.memory.get(d),
                "times": [
                    {"microbatch_size": b, "tensor_parallel": t, **lt.to_json()}
                    for (b, t), lt in sorted(table.items())
                ],
            }
            for d, table in profile.times.items()
        },
        "intra_node": [
            {"device": d, "gpus": n, **link.to_json()}
            for d, links in profile.intra.items()
            for n, link in sorted(links.items())
        ],
        "inter_node": [
            {"device_a": a, "gpus_a": na, "device_b": b, "gpus_b": nb, **link.to_json()}
            for (a, na, b, nb), link in profile.inter.items()
        ],
    }


def _floats(xs, what: str, n: int | None = None) -> tuple[float, ...]:
    out = tuple(float(x) for x in xs)
    if n is not None and len(out) != n:
        raise ValueError(
            f"profile field {what} has {len(out)} values, expected {n} (one per layer)"
        )
    for x in out:
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"profile field {what} has {x!r}; values must be non-negative")
    return out


_PROFILE_FIELDS = (
    "format",
    "model",
    "layer_kinds",
    "layer_blocks",
    "params",
    "activation_bytes",
    "output_bytes",
    "memory_terms",
    "model_shape",
    "devices",
    "intra_node",
    "inter_node",
)
_TIMES_FIELDS = (
    "microbatch_size",
    "tensor_parallel",
    "forward",
    "backward",
    "update",
    "input_grad",
    "weight_grad",
)
_LAYER_KINDS = ("embedding", "block", "head")


class _Reader:
    """Strict reads of one profile's fields; every error is one line naming file and field."""

    def __init__(self, where: str):
        self.where = where

    def error(self, field: str, problem: str) -> ValueError:
        return ValueError(f"{self.where}: {field} {problem}")

    def get(self, d: dict, key: str, field: str, kind: type):
        if key not in d:
            raise ValueError(f"{self.where}: the profile is missing the field {field!r}")
        return self.typed(d[key], field, kind)

    def typed(self, value, field: str, kind: type):
        if not isinstance(value, kind) or isinstance(value, bool):
            names = {dict: "an object", list: "a list", str: "a string", int: "an integer"}
            name = names.get(kind, "a number")
            raise self.error(field, f"must be {name}, got {value!r}")
        return value

    def known(self, d: dict, fields, field: str) -> None:
        for key in d:
            if key not in fields:
                name = f"{field}.{key}" if field else key
                raise self.error(
                    name, f"is not a field of a jpipe profile (the fields: {', '.join(fields)})"
                )

    def whole(self, value, field: str, minimum: int = 1) -> int:
        if isinstance(value, str) and value.strip().isdigit():  # a JSON object's key
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.error(field, f"must be a whole number of at least {minimum}, got {value!r}")
        return value

    def figures(self, xs, field: str, unit: str, n: int) -> tuple[float, ...]:
        self.typed(xs, field, list)
        if len(xs) != n:
            raise self.error(field, f"has {len(xs)} values, expected {n} (one per layer)")
        return tuple(
            check_plausible(x, unit, f"{field}[{i}]", self.where) for i, x in enumerate(xs)
        )

    def by_tp(self, d: dict, key: str, unit: str, n: int) -> dict[int, tuple[float, ...]]:
        table = self.get(d, key, key, dict)
        if not table:
            raise self.error(key, "is empty; it needs the figures at some tensor degree T")
        return {
            self.whole(t, f"{key} key {t!r}"): self.figures(v, f"{key}[{t}]", unit, n)
            for t, v in table.items()
        }

    def link(self, e, field: str, fields) -> Link:
        self.typed(e, field, dict)
        self.known(e, fields, field)
        peak = check_plausible(
            self.get(e, "max_bytes_per_s", f"{field}.max_bytes_per_s", float | int),
            "bytes_per_s",
            f"{field}.max_bytes_per_s",
            self.where,
        )
        coeffs = self.typed(e.get("coeffs", []), f"{field}.coeffs", list)
        for i, c in enumerate(coeffs):
            if not isinstance(c, int | float) or isinstance(c, bool) or not math.isfinite(c):
                raise self.error(f"{field}.coeffs[{i}]", f"must be a finite number, got {c!r}")
        return Link(peak, tuple(float(c) for c in coeffs))


def profile_from_json(d: dict, where: str = "the profile") -> Profile:
    """Reads a profile written by `profile_to_json`; errors name `where` and the bad field.

    Strict: fields of a JSON type other than the format's, numbers that are
    not finite, negative, or outside `PLAUSIBLE` (a figure in another unit),
    zero microbatch sizes, degrees or device memories, and fields the format
    does not have are refused, each in one line.

    A ``"jpipe-profile/1"`` file (bytes keyed by the microbatch size, parameters
    as the bytes of all tensor-parallel shards in fp32, no memory terms) is
    converted: its bytes are divided by their microbatch size and taken at
    T = 1, its parameters are its bytes over 4, and its memory terms are
    `JPIPE_RUNTIME`'s.
    """
    if not isinstance(d, dict):
        raise ValueError(f"{where} is not a jpipe profile: it holds a JSON {type(d).__name__}")
    if d.get("format") in OLD_FORMATS:
        d = _from_format_1(d, where)
    if d.get("format") != FORMAT:
        raise ValueError(
            f"{where} is not a jpipe profile: 'format' is {d.get('format')!r}, not {FORMAT!r}"
        )
    read = _Reader(where)
    read.known(d, _PROFILE_FIELDS, "")
    kinds = tuple(read.get(d, "layer_kinds", "layer_kinds", list))
    for i, k in enumerate(kinds):
        if k not in _LAYER_KINDS:
            raise read.error(f"layer_kinds[{i}]", f"is {k!r}; accepted: {', '.join(_LAYER_KINDS)}")
    n = len(kinds)
    if not n:
        raise read.error("layer_kinds", "is empty; a profile has at least one layer")
    times, memory = {}, {}
    for device, dev in read.get(d, "devices", "devices", dict).items():
        field = f"devices.{device}"
        read.typed(dev, field, dict)
        read.known(dev, ("memory_bytes", "times"), field)
        table = {}
        for i, e in enumerate(read.get(dev, "times", f"{field}.times", list)):
            at = f"{field}.times[{i}]"
            read.typed(e, at, dict)
            read.known(e, _TIMES_FIELDS, at)
            key = (
                read.whole(
                    read.get(e, "microbatch_size", f"{at}.microbatch_size", int),
                    f"{at}.microbatch_size",
                ),
                read.whole(
                    read.get(e, "tensor_parallel", f"{at}.tensor_parallel", int),
                    f"{at}.tensor_parallel",
                ),
            )
            if key in table:
                raise read.error(at, f"repeats B={key[0]}, T={key[1]}")
            at = f"{field}.times[B={key[0]}, T={key[1]}]"
            split = e.get("input_grad") is not None

            def row(name, at=at, e=e):
                return read.figures(
                    read.get(e, name, f"{at}.{name}", list), f"{at}.{name}", "seconds", n
                )

            table[key] = LayerTimes(
                forward=row("forward"),
                backward=row("backward"),
                update=row("update"),
                input_grad=row("input_grad") if split else None,
                weight_grad=row("weight_grad") if split else None,
            )
        times[device] = table
        if dev.get("memory_bytes") is not None:
            memory[device] = check_plausible(
                dev["memory_bytes"], "device_bytes", f"{field}.memory_bytes", where
            )
    blocks = d.get("layer_blocks")
    if blocks is not None:
        read.typed(blocks, "layer_blocks", list)
        if len(blocks) != n:
            raise read.error("layer_blocks", f"has {len(blocks)} values, expected {n}")
        blocks = tuple(read.whole(b, f"layer_blocks[{i}]", 0) for i, b in enumerate(blocks))
    terms = read.get(d, "memory_terms", "memory_terms", dict)
    try:
        memory_terms = MemoryTerms.from_json(terms)
    except (TypeError, ValueError) as e:
        raise read.error("memory_terms", f"cannot be read: {e}") from None
    shape = None
    if d.get("model_shape") is not None:
        try:
            shape = ModelShape.from_json(read.typed(d["model_shape"], "model_shape", dict), n)
        except (TypeError, ValueError) as e:
            raise read.error("model_shape", f"cannot be read: {e}") from None
    intra: dict[str, dict[int, Link]] = {}
    for i, e in enumerate(read.typed(d.get("intra_node", []), "intra_node", list)):
        at = f"intra_node[{i}]"
        link = read.link(e, at, ("device", "gpus", "max_bytes_per_s", "coeffs"))
        device = read.get(e, "device", f"{at}.device", str)
        intra.setdefault(device, {})[read.whole(e.get("gpus"), f"{at}.gpus")] = link
    inter = {}
    for i, e in enumerate(read.typed(d.get("inter_node", []), "inter_node", list)):
        at = f"inter_node[{i}]"
        link = read.link(
            e, at, ("device_a", "gpus_a", "device_b", "gpus_b", "max_bytes_per_s", "coeffs")
        )
        key = (
            read.get(e, "device_a", f"{at}.device_a", str),
            read.whole(e.get("gpus_a"), f"{at}.gpus_a"),
            read.get(e, "device_b", f"{at}.device_b", str),
            read.whole(e.get("gpus_b"), f"{at}.gpus_b"),
        )
        inter[key] = link
    return Profile(
        model=read.get(d, "model", "model", str),
        layer_kinds=kinds,
        params=read.by_tp(d, "params", "params", n),
        activation_bytes=read.by_tp(d, "activation_bytes", "bytes", n),
        output_bytes=read.figures(
            read.get(d, "output_bytes", "output_bytes", list), "output_bytes", "output_bytes", n
        ),
        times=times,
        memory=memory,
        memory_terms=memory_terms,
        intra=intra,
        layer_blocks=blocks,
        inter=inter,
        shape=shape,
    )


def _from_format_1(d: dict, where: str = "the profile") -> dict:
    """A ``jpipe-profile/1`` object in the ``/2`` form (see `profile_from_json`)."""
    try:
        per_b = {int(b): v for b, v in d["activation_bytes"].items()}
        out_b = {int(b): v for b, v in d["output_bytes"].items()}
        b_act, b_out = min(per_b), min(out_b)
        if b_act < 1 or b_out < 1:
            raise ValueError(f"a microbatch size key {min(b_act, b_out)} below 1")
        for field, xs in (
            ("params_bytes", d["params_bytes"]),
            ("activation_bytes", per_b[b_act]),
            ("output_bytes", out_b[b_out]),
        ):
            unit = "output_bytes" if field == "output_bytes" else "bytes"
            for i, x in enumerate(xs):
                check_plausible(x, unit, f"{field}[{i}]", where)
        return {
            **{k: v for k, v in d.items() if k != "params_bytes"},
            "format": FORMAT,
            "params": {"1": [float(x) / 4 for x in d["params_bytes"]]},
            "activation_bytes": {"1": [float(x) / b_act for x in per_b[b_act]]},
            "output_bytes": [float(x) / b_out for x in out_b[b_out]],
            "memory_terms": JPIPE_RUNTIME.to_json(),
        }
    except KeyError as e:
        raise ValueError(f"{where}: this jpipe-profile/1 file has no field {e.args[0]!r}") from None
    except (TypeError, AttributeError, ValueError) as e:
        raise ValueError(f"{where}: cannot read this jpipe-profile/1 file: {e}") from None


def save_profile(profile: Profile, path: str) -> None:
    with open(path, "w") as f:
        json.dump(profile_to_json(profile), f)


def load_profile(path: str) -> Profile:
    """Reads a jpipe profile file (strictly: `profile_from_json`)."""
    return profile_from_json(read_json(path, "profile"), path)


def profile_from_stage_times(
    stage_times,
    device: str,
    *,
    microbatch_size: int,
    tensor_parallel: int = 1,
    params: Sequence[float] | None = None,
    activation_bytes: Sequence[float] | None = None,
    output_bytes: Sequence[float] | None = None,
    update: Sequence[float] | None = None,
    memory_bytes: float | None = None,
    memory_terms: MemoryTerms | None = None,
    blocks_per_stage: Sequence[int] | None = None,
    link_bytes_per_s: float = math.inf,
    model: str = "measured",
) -> Profile:
    """Turns the trainer's measured per-stage times into a profile.

    Each measured stage becomes one profile "layer" (the finest grain the
    trainer measures), so the planner can re-split or re-place whole stages.

    Args:
      stage_times: anything with per-stage tuples ``F``, ``I``, ``W`` (and
        optionally ``B``), seconds per microbatch, like the trainer's
        ``StageTimes`` from ``measure_stages``.
      device: the device type the times were measured on.
      microbatch_size, tensor_parallel: the (B, T) they were measured at.
      params: parameters per stage on one GPU, if known (default 0).
      activation_bytes, output_bytes: per stage, bytes of one *microbatch*
        (stored per sequence, divided by `microbatch_size`), if known (default 0).
      update: optimizer-update seconds per stage (default 0).
      memory_bytes: the device's memory, if known.
      memory_terms: the runtime's memory terms (default `JPIPE_RUNTIME`).
      blocks_per_stage: transformer blocks in each measured stage (the
        trainer's layers per stage), so a plan counts blocks, not stages.
      link_bytes_per_s: bandwidth between devices, inside and across nodes;
        the default (unmeasured) makes transfers free.
      model: a name for the profile.
    """
    F = _floats(stage_times.F, "F")
    n = len(F)
    I = _floats(stage_times.I, "I", n)
    W = _floats(stage_times.W, "W", n)
    B = getattr(stage_times, "B", None)
    B = _floats(B, "B", n) if B is not None else tuple(i + w for i, w in zip(I, W))
    zeros = (0.0,) * n
    b, t = int(microbatch_size), int(tensor_parallel)
    per_sequence = lambda xs, what: tuple(x / b for x in _floats(xs, what, n))  # noqa: E731
    return Profile(
        model=model,
        layer_kinds=("block",) * n,
        params={t: _floats(params, "params", n) if params else zeros},
        activation_bytes={
            t: per_sequence(activation_bytes, "activation_bytes") if activation_bytes else zeros
        },
        output_bytes=per_sequence(output_bytes, "output_bytes") if output_bytes else zeros,
        times={
            device: {
                (b, t): LayerTimes(
                    forward=F,
                    backward=B,
                    update=_floats(update, "update", n) if update else zeros,
                    input_grad=I,
                    weight_grad=W,
                )
            }
        },
        memory={} if memory_bytes is None else {device: float(memory_bytes)},
        memory_terms=memory_terms or JPIPE_RUNTIME,
        layer_blocks=None if blocks_per_stage is None else tuple(int(b) for b in blocks_per_stage),
        intra={device: {1: Link(link_bytes_per_s)}},
        inter={(device, 1, device, 1): Link(link_bytes_per_s)},
    )


def monotone_in_batch(profile: Profile) -> Profile:
    """The profile with every layer time made non-decreasing in microbatch size.

    A layer cannot take longer on B sequences than on 2B; where a profile
    says it does (noise in the measurement, as in Sailor's GH-96 OPT-350 entry
    at B = 1, T = 4, slower than at B = 2), the time at the larger size bounds
    the smaller one. Applied per device, tensor-parallel degree, layer and kind
    of time (forward, backward, input and weight gradient); updates are
    unchanged. Returns a new profile; what changed is not recorded per entry.
    """

    def clean(table):
        out = dict(table)
        for tp in {t for _, t in table}:
            sizes = sorted(b for b, t in table if t == tp)
            bound = None
            for b in reversed(sizes):
                lt = table[(b, tp)]
                if bound is not None:
                    lt = LayerTimes(
                        forward=tuple(map(min, lt.forward, bound.forward)),
                        backward=tuple(map(min, lt.backward, bound.backward)),
                        update=lt.update,
                        input_grad=None
                        if lt.input_grad is None or bound.input_grad is None
                        else tuple(map(min, lt.input_grad, bound.input_grad)),
                        weight_grad=None
                        if lt.weight_grad is None or bound.weight_grad is None
                        else tuple(map(min, lt.weight_grad, bound.weight_grad)),
                    )
                out[(b, tp)] = lt
                bound = lt
        return out

    return dataclasses.replace(
        profile, times={d: clean(t) for d, t in profile.times.items()}, derived=set(), _links={}
    )
