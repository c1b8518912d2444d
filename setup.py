"""Build hook for the native NVMe driver and CPU kernels; all other metadata lives in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["native/nvme/nvme_build.py:ffibuilder", "native/cpu/cpu_build.py:ffibuilder"])
