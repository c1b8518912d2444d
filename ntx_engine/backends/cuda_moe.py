"""The routed-expert ops of `moe.py` on the CUDA backend (kernels in native/cuda/moe.cu).

Each 3-D expert tensor sits in VRAM as its raw GGUF blocks, experts back to back. Per MoE layer:
the router logits come from the backend's ordinary matmul (`ffn_gate_inp` is F32), `moe_route`
turns them into expert ids and weights on the device, and `moe_matvec_<type>` computes one
projection (gate, up or down) for every selected expert of every token in one launch.
Nothing goes back to the host, so a decode step stays capturable as a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ntx_common.errors import ModelError, UnsupportedQuantError
from ntx_engine import quants
from ntx_engine.backends import cuda_nvrtc
from ntx_engine.backends.cuda_driver import DeviceArray, LaunchConfig, Module, launch, launch_pdl, upload
from ntx_engine.backends.cuda_kernels import BLOCK_ELEMENTS, KERNEL_TYPES

SOURCES = ("moe.cu",)
WARPS = 4  # NTX_MOE_WARPS in moe.cu
MAX_EXPERTS = 1024  # NTX_MOE_MAX_EXPERTS
COMBINE_THREADS = 256


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CudaExperts:
    """One 3-D expert tensor (n_expert, rows, k) in VRAM as its GGUF blocks."""

    def __init__(self, data: DeviceArray, where: Any) -> None:
        self.data, self.where = data, where
        self.ggml_type = where.ggml_type
        qt = quants.quant_type(where.ggml_type, where.name)
        self.vec_dot_type, self.has_min = qt.vec_dot_type, qt.has_block_min  # read by the backend's _quantize


class CudaMoe:
    def __init__(self, backend: Any) -> None:
        self.b = backend
        self.module = Module(cuda_nvrtc.cached_cubin("moe.cu", backend.device.arch), "moe.cu")

    def _go(self, name: str, grid: tuple, block: tuple, args: tuple) -> None:
        self.b.flush()  # a residual add the backend holds back for fusion must land first
        cfg = LaunchConfig(tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block)))
        (launch_pdl if self.b.k.pdl else launch)(self.module.function(name), cfg, args, self.b.stream, name)

    def experts(self, raw: np.ndarray, where: Any) -> CudaExperts:
        t = quants.ggml_type_of(int(where.ggml_type), where.name)
        if t not in KERNEL_TYPES:
            raise UnsupportedQuantError(f"expert tensor {where.name!r} is {t.name}, which the CUDA MoE kernels "
                                        f"cannot multiply; re-quantize the model")
        if where.k % BLOCK_ELEMENTS[t]:
            raise UnsupportedQuantError(f"expert tensor {where.name!r}: rows of {where.k} elements are not whole "
                                        f"{BLOCK_ELEMENTS[t]}-element units for the CUDA kernels")
        if where.n_expert > MAX_EXPERTS:
            raise ModelError(f"{where.name}: {where.n_expert} experts; the CUDA router handles at most {MAX_EXPERTS}")
        host = np.asarray(raw).reshape(-1).view(np.uint8)
        if host.size != where.n_expert * where.expert_nbytes:
            raise ModelError(f"expert tensor {where.name!r}: {host.size} bytes, expected "
                             f"{where.n_expert} x {where.expert_nbytes}")
        return CudaExperts(upload(self.b.pool, host, self.b.stream), where)

    def route(self, logits: DeviceArray, k: int, norm: bool) -> tuple[DeviceArray, DeviceArray]:
        n, n_expert = logits.shape
        ids, w = self.b._new(n, k, dtype=np.int32), self.b._new(n, k)
        self._go("moe_route", (n,), (32,), (logits, ids, w, n_expert, k, int(norm)))
        return ids, w

    def routed(self, w: Any, x: DeviceArray, ids: DeviceArray) -> DeviceArray:
        """y (n, k_used, rows); x (n, k) shared by the slots, or (n, k_used, k) one per slot."""
        ex: CudaExperts = w.data
        n, used = ids.shape
        rows, k = ex.where.rows, ex.where.k
        per_slot = len(x.shape) == 3
        x2 = x.reshape(n * used, k) if per_slot else x  # gate/up pass h itself: its quantization is reused
        xq, s = self.b._activations(ex, x2)
        y = self.b._new(n, used, rows)
        self._go(f"moe_matvec_{KERNEL_TYPES[ex.ggml_type]}", (_cdiv(rows, WARPS), used, n), (32 * WARPS,),
                 (ex.data, xq, s, ids, y, rows, k, used, int(per_slot)))
        return y

    def combine(self, y: DeviceArray, weights: DeviceArray, shared: DeviceArray | None = None,
                shared_gate: DeviceArray | None = None) -> DeviceArray:
        n, used, d = y.shape
        out = self.b._new(n, d)
        self._go("moe_combine", (_cdiv(d, COMBINE_THREADS), n), (COMBINE_THREADS,),
                 (y, weights, shared, shared_gate, out, used, d))
        return out
