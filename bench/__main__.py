"""``python -m bench``: fakes the CPU devices before JAX starts, then runs.

JAX fixes the number of CPU devices when its backend starts, so this peeks at
``--ranks`` and asks for that many before anything touches JAX. On a GPU or
TPU host with enough devices the real ones are used (`bench.run.pick_devices`).
"""

import argparse
import sys

import jax

_peek = argparse.ArgumentParser(add_help=False)
_peek.add_argument("--ranks", type=int, default=4)
jax.config.update("jax_num_cpu_devices", max(1, _peek.parse_known_args()[0].ranks))

from bench.run import main  # noqa: E402  (after the device count is set)

if __name__ == "__main__":
    sys.exit(main())
