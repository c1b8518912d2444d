"""Build hook for the native NVMe driver; all other metadata lives in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["native/nvme/nvme_build.py:ffibuilder"])
