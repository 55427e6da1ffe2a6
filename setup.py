"""Installs jpipe; the metadata is in pyproject.toml.

The built-in schedules in ``schedules/`` install as ``jpipe.schedules``.
"""

from setuptools import setup

setup()
