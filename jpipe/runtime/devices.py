"""Devices: faking CPU devices for a mesh, and describing the devices a run uses.

JAX fixes its device count when its backend starts, so faking CPU devices must
happen before any JAX computation. `use_cpu_devices` is the one place jpipe
does it (the trainer, the checker, the benchmarks and the tests all call it).
Asking for CPU devices only shapes the CPU backend: on a machine with a GPU or
TPU the mesh is built from the accelerators and the CPU devices go unused.
"""

from __future__ import annotations

import jax


def use_cpu_devices(count: int, *, required: bool = False) -> int | None:
    """Asks JAX for at least `count` CPU devices, if its backend has not started yet.

    Args:
      count: the CPU devices wanted.
      required: raise, with what to do, when fewer than `count` CPU devices
        exist after the attempt (the backend had already started).

    Returns:
      `count` when it was set, or None when nothing changed: as many were
      configured already, or the backend had started and it could not change.

    Raises:
      RuntimeError: `required` and fewer than `count` CPU devices.
    """
    configured = None
    if jax.config.jax_num_cpu_devices < count:  # never fewer than asked for before
        try:
            jax.config.update("jax_num_cpu_devices", count)
            configured = count
        except RuntimeError:  # the backend has started: keep what it has
            pass
    if required:
        have = len(jax.devices("cpu"))
        if have < count:
            raise RuntimeError(
                f"this needs {count} CPU devices but JAX has {have}. JAX fixes the count when "
                f"it starts: call jax.config.update('jax_num_cpu_devices', {count}) (or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={count}) before any JAX "
                "work, e.g. at the top of your conftest.py"
            )
    return configured


def describe_devices(devices) -> str:
    """``"4 cpu devices (faked ...)"``: what a run is about to use, for people."""
    kinds = sorted({d.platform for d in devices})
    text = f"{len(devices)} {'/'.join(kinds)} device{'s' if len(devices) != 1 else ''}"
    if kinds == ["cpu"] and len(devices) > 1:
        text += " (faked on the host's CPU cores: wall time shows no pipeline overlap)"
    return text
