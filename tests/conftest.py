"""Every multi-device test runs on 8 fake CPU devices, set up once here."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jpipe  # noqa: E402

jpipe.use_cpu_devices(8)
