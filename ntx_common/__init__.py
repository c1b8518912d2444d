"""Pieces every ntx package shares: the error hierarchy and the CLI console/boundary.

It imports nothing from the other ntx packages, so `ntx_setup` keeps working when CUDA
or the engine is broken.
"""

from ntx_common.errors import NtxError

__all__ = ["NtxError"]
