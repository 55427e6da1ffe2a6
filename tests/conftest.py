"""Every multi-device test runs on 8 fake CPU devices, set up once here."""

import os

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

import jpipe  # noqa: E402

jpipe.use_cpu_devices(8)
