"""Installs jpipe; the metadata is in pyproject.toml.

The packages are listed here: jpipe's own, the data folders under
``jpipe/_data`` (the Sailor profiles) as namespace packages so that
setuptools installs them without warning, and the built-in schedules in
``schedules/`` as ``jpipe.schedules``.
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=find_namespace_packages(include=["jpipe", "jpipe.*"], exclude=["*.__pycache__"])
    + ["jpipe.schedules"]
)
