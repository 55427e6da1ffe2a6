"""Before compiling: every process of a run checks that it runs process 0's run.

The processes of a multi-host job are started one by one, each with its own
command line (``JAX_PROCESS_ID=1 python train.py --config.seed=1 ...``), and
nothing in JAX compares them: two processes whose configs differ in a seed or
a learning rate train together, silently, to a result neither config gives,
and a difference in the number of microbatches crashes inside gloo with
"Received data size doesn't match expected size". `check_agreement` runs
once the processes have joined and the config is prepared, before anything
is compiled, and refuses such a run on every process with one line naming
the fields that differ and the processes they differ in.

What is compared (`run_record`): every field of the resolved `TrainConfig`
(after a plan file's settings are applied; ``cpu_devices`` aside, as each
host fakes its own devices), the layer split, a fingerprint of the
schedule's action lists, one of the model's parameters (tree paths, shapes
and dtypes from `jax.eval_shape`: a ``file.py:build`` that differs between
hosts shows here even where the config does not), and the versions of jpipe
and JAX.

How: through the coordination service's key-value store, not a collective.
Process 0 publishes its record (JSON); every other process reads it, and
publishes the fields it disagrees on, if any, under its own key; after a
barrier every process lists those keys and, if there are any, raises the
same `ConfigError`. Why not `multihost_utils.broadcast_one_to_all` of a hash:
that is an XLA collective, so it compiles a program and runs it over gloo or
NCCL between processes that may disagree on exactly the things that make
such programs fail; a fixed-size hash only says *that* something differs,
where the record says *what*; and every process would have to start its
backend first. The store takes strings of any size over the RPC channel the
processes have already joined, and each process's reads are O(1) (process
0's record, then one directory listing), so it scales with the job.

A peer that dies before it publishes is not waited for forever: the waits
end after `WAIT_SECONDS` naming the processes that did not answer, and
sooner when the coordination service notices a lost peer (see
`jpipe.runtime.distributed`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _package_version

import jax

from jpipe.train.config import ConfigError
from jpipe.train.prepare import Prepared

__all__ = ["check_agreement", "differences", "run_record"]

# Longest wait for the others to publish: they may still be preparing (a BPE
# tokenizer trained on the corpus takes a minute or more on a small host).
WAIT_SECONDS = 600
# Fields each process may set for itself.
_OWN_FIELDS = ("cpu_devices",)
# The keys of one call of `check_agreement`: every process calls it as often
# (once per `train`), so the n-th calls of all processes meet under one key.
_calls = itertools.count()


def _flatten(value, prefix: str, out: dict[str, str]) -> None:
    """Dotted field names -> each leaf's JSON text (of dataclasses, Mappings, ConfigDicts)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif hasattr(value, "to_dict") and callable(value.to_dict):  # (Frozen)ConfigDict
        items = list(value.to_dict().items())
    elif isinstance(value, Mapping):
        items = list(value.items())
    else:
        out[prefix] = json.dumps(value, sort_keys=True, default=repr)
        return
    if not items and prefix:
        out[prefix] = "{}"
    for key, item in items:
        _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_record(prepared: Prepared) -> dict[str, str]:
    """What must be the same in every process, as ``{field: JSON text}``.

    Config fields keep their dotted names (``optimizer.learning_rate``); the
    fingerprints are named in angle brackets (``<schedule actions>``).
    """
    record: dict[str, str] = {}
    _flatten(prepared.config, "", record)
    for field in _OWN_FIELDS:
        record.pop(field, None)
    schedule = prepared.schedule
    record["<layers per stage>"] = json.dumps(list(prepared.layers_per_stage))
    record["<schedule actions>"] = _digest(
        repr((schedule.ranks, getattr(schedule, "stage_to_rank", None)))
    )
    model = prepared.model
    if model is not None:
        shapes = jax.eval_shape(model.init, jax.random.key(prepared.config.seed))
        leaves = jax.tree_util.tree_leaves_with_path(shapes)
        record["<model parameters>"] = _digest(
            repr([(jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype)) for p, x in leaves])
        )
    record["<jpipe version>"] = json.dumps(_version("jpipe"))
    record["<jax version>"] = json.dumps(jax.__version__)
    return record


def differences(lead: Mapping[str, str], mine: Mapping[str, str], process: int) -> list[str]:
    """Each field where `mine` (process `process`'s record) differs from process 0's `lead`."""
    out = []
    for field in sorted(set(lead) | set(mine)):
        a, b = lead.get(field, "(absent)"), mine.get(field, "(absent)")
        if a != b:
            out.append(f"{field}: {a} in process 0, {b} in process {process}")
    return out


def check_agreement(prepared: Prepared, *, timeout_seconds: float = WAIT_SECONDS) -> None:
    """Refuses, on every process, a run whose processes were given different runs.

    A no-op in a single-process run. Call it in every process, after
    `prepare` and before anything is compiled.

    Raises:
      ConfigError: naming each field that differs from process 0's, with both
        values and the process (the same message on every process); or
        naming the processes that did not publish within `timeout_seconds`.
    """
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return
    me, n = jax.process_index(), jax.process_count()
    base = f"jpipe/agreement/{next(_calls)}"
    ms = int(timeout_seconds * 1000)
    mine = run_record(prepared)
    if me == 0:
        client.key_value_set(f"{base}/record", json.dumps(mine))
    else:
        try:
            lead = json.loads(client.blocking_key_value_get(f"{base}/record", ms))
        except Exception as e:  # noqa: BLE001 (a timeout, or the service is gone)
            raise ConfigError(
                f"process 0 did not publish its config within {timeout_seconds:.0f} s of process "
                f"{me} ({_first_line(e)}); is it running the same train.py?"
            ) from None
        found = differences(lead, mine, me)
        if found:
            client.key_value_set(f"{base}/differs/{me}", json.dumps(found))
    try:
        client.wait_at_barrier(f"{base}/compared", ms)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"not every one of the {n} processes compared its config with process 0's within "
            f"{timeout_seconds:.0f} s ({_first_line(e)})"
        ) from None
    reports = sorted(
        (int(key.rsplit("/", 1)[1]), json.loads(value))
        for key, value in client.key_value_dir_get(f"{base}/differs/")
    )
    if reports:
        from jpipe.runtime import distributed as _distributed

        _distributed.failing_together()  # process 0 exits last, so that every process says it
        shown = "; ".join(item for _, found in reports[:3] for item in found[:8])
        more = f" (and {len(reports) - 3} more processes)" if len(reports) > 3 else ""
        who = ", ".join(str(p) for p, _ in reports[:10]) + (", ..." if len(reports) > 10 else "")
        raise ConfigError(
            f"the processes of this run were started with different runs: process(es) {who} "
            f"differ from process 0 in {shown}{more}; give every process the same config, "
            "flags and files"
        )


def _version(package: str) -> str:
    try:
        return _package_version(package)
    except PackageNotFoundError:  # run from a checkout that is not installed
        return ""


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
