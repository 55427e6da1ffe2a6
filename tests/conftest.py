"""Every multi-device test runs on 8 fake CPU devices, set up once here."""

import gc
import os
import shutil
import tempfile

# The suite compiles hundreds of small programs and runs each once or twice,
# so LLVM's optimisation of XLA:CPU's machine code is most of its time and
# buys nothing: level 0 cuts the suite's CPU time by about a third. It changes
# the generated code only, not the optimised HLO program, so buffer sizes
# (`memory_analysis`), conditionals, collectives and dots read the same as at
# the default level (checked on the memory suite's rows); the exactness tests
# compare programs compiled alike. Subprocesses that start their own devices
# keep it (tests/test_multiprocess.py); the benchmarks and compile timings run
# at the default level.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}")

# Many tests compile the same programs again: every `train()` call and every
# `train.py` a test starts jits its step afresh, and each test file ends by
# dropping JAX's caches (below). JAX's persistent compilation cache, one
# folder per run of the suite shared by its workers and by the processes
# tests start (they inherit the environment), serves those from disk: five
# of test_train.py's runs took 67 s without it and 43 s with it, cold. Every
# program is kept (a minimum compile time of 0), since the suite's are small.
# A program read back from the cache is the same executable (the same
# optimized HLO and `memory_analysis()`; only its source-location tables
# differ, checked on jax 0.10.2 and 0.12.1). Set JAX_COMPILATION_CACHE_DIR
# yourself to choose the folder, or to "" to compile everything afresh.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ  # made here, removed at the end
if _OWN_CACHE:  # the first process of the run (xdist's workers inherit its environment)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jpipe-tests-compile-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

import jpipe  # noqa: E402

jpipe.use_cpu_devices(8)

# Each program XLA:CPU compiles keeps its machine code in memory maps of its
# own until it is freed, and JAX's caches keep every program a test file
# compiled. One test worker runs about half the suite's files, and Linux
# allows a process 65,530 maps (vm.max_map_count). Two runs of the suite had
# a worker die in test_train.py ("Fatal Python error: Aborted") after it had
# run other files; with the limit set to 16,000, test_compiler.py dies too
# (a segfault in a compile). Measured (jax 0.10.2): test_compiler.py alone
# peaks at 18,400 maps, and eight of the heaviest files in one process at
# 43,000; the worker that died was not measured, so the limit is the one
# cause reproduced, not a proven one. Each file's programs are released when
# it ends (18,400 maps -> 630), and a file that alone comes near the limit
# fails here by name instead of taking a later file down.
MAPS = "/proc/self/maps"
MAPS_PER_FILE = 40_000


def _memory_maps() -> int | None:
    try:
        with open(MAPS) as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs(request):
    yield
    held = _memory_maps()
    jax.clear_caches()
    gc.collect()
    if held is not None and held > MAPS_PER_FILE:
        pytest.fail(
            f"{request.module.__name__} ended holding {held} memory maps (XLA's compiled "
            f"programs); past {MAPS_PER_FILE} a worker nears Linux's 65,530 and dies. "
            "Split the file or release its programs (jax.clear_caches()) as it goes."
        )


def pytest_sessionfinish(session, exitstatus):
    """The run's compile cache goes when the run ends (in the process that started it)."""
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# The longest files first. pytest-xdist (`--dist loadfile`, pyproject.toml)
# hands whole files to its workers in collection order (with
# --no-loadscope-reorder: by default it queues them by their number of tests
# instead, which ignored this order), so a long file that sorts late keeps
# one worker busy alone at the end: test_train.py began near the end and ran
# about 10 of the suite's last 13 minutes by itself (stop 42), and with the
# files queued by test count test_readme.py (4 tests, one a 300-step
# train.py), test_lost_peers.py and test_interrupt.py were among the last
# nine queued: the likely cause of the about 5 minutes one worker still ran
# alone in stop 43's rehearsal (the queue order read from xdist 3.8's code;
# that run logged no per-worker times). Measured per file in one run of the
# whole suite (`pytest --durations=0`, 2 workers, a loaded machine), the
# heaviest in order; the rest keep their order after them.
LONGEST_FIRST = (
    "test_train.py",
    "test_sharded.py",
    "test_compiler.py",
    "test_gpt.py",
    "test_examples.py",
    "test_mpmd.py",
    "test_sequence_parallel.py",
    "test_multiprocess.py",
    "test_readme.py",
    "test_attention_remat.py",
    "test_vocab_split.py",
    "test_llama.py",
    "test_compiler_properties.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


@pytest.fixture(scope="session")
def mixed_plan(tmp_path_factory):
    """A per-rank plan file over three hosts: ranks of tensor 1, 2 and 1, one per host (with
    1, 2 and 1 devices), three one-block stages, 1F1B over 4 microbatches of 1 sequence."""
    import json
    import types

    from jpipe.planner import (
        ClusterPlan,
        DeviceGroup,
        evaluate,
        plan_file,
        profile_from_stage_times,
    )

    times = types.SimpleNamespace(F=(1.0,) * 3, I=(1.0,) * 3, W=(1.0,) * 3, B=(2.0,) * 3)
    prof = profile_from_stage_times(times, "cpu", microbatch_size=1, blocks_per_stage=[1, 1, 1])
    ranks = tuple((DeviceGroup("cpu", tensor_parallel=t, node=n),) for n, t in enumerate((1, 2, 1)))
    plan = ClusterPlan(ranks, ((0,), (1,), (2,)), 1, 4, "1f1b", memory_layout="mpmd")
    path = tmp_path_factory.mktemp("plan") / "mixed.json"
    path.write_text(json.dumps(plan_file(evaluate(plan, prof), prof)))
    return path
