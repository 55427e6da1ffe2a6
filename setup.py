"""Installs jpipe. The built-in schedules in ``schedules/`` install as ``jpipe.schedules``."""

from setuptools import setup

setup(
    name="jpipe",
    version="0.1.0",
    description="Pipeline-parallel training schedules for JAX: write, check, see and run them.",
    python_requires=">=3.11",
    packages=["jpipe", "jpipe.models", "jpipe.schedules"],
    package_dir={"jpipe": "jpipe", "jpipe.schedules": "schedules"},
    # The published Sailor GPU profiles and measured plans the planner defaults to.
    package_data={"jpipe": ["_data/sailor/*", "_data/sailor/*/*", "_data/sailor/*/*/*",
                            "_data/sailor/*/*/*/*", "_data/sailor/*/*/*/*/*"]},
    install_requires=[
        "jax>=0.10",
        "numpy",
        "flax",
        "optax",
        "orbax-checkpoint",
        "ml_collections",
        "absl-py",
        "matplotlib",
        "tqdm",
    ],
    extras_require={"test": ["pytest", "hypothesis", "chex", "tensorboardX"]},
)
