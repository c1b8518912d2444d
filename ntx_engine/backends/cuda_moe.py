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
from ntx_engine.backends.cuda_driver import DeviceArray, LaunchConfig, Module, launch_ex, upload
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


def check_experts(where: Any) -> None:
    """The CUDA MoE kernels can multiply this expert tensor, or a typed error says why not."""
    t = quants.ggml_type_of(int(where.ggml_type), where.name)
    if t not in KERNEL_TYPES:
        raise UnsupportedQuantError(f"expert tensor {where.name!r} is {t.name}, which the CUDA MoE kernels "
                                    f"cannot multiply; re-quantize the model")
    if where.k % BLOCK_ELEMENTS[t]:
        raise UnsupportedQuantError(f"expert tensor {where.name!r}: rows of {where.k} elements are not whole "
                                    f"{BLOCK_ELEMENTS[t]}-element units for the CUDA kernels")
    if where.n_expert > MAX_EXPERTS:
        raise ModelError(f"{where.name}: {where.n_expert} experts; the CUDA router handles at most {MAX_EXPERTS}")


class CudaMoe:
    def __init__(self, backend: Any) -> None:
        self.b = backend
        self.module = Module(cuda_nvrtc.cached_cubin("moe.cu", backend.device.arch), "moe.cu")

    def _go(self, name: str, grid: tuple, block: tuple, args: tuple) -> None:
        self.b.flush()  # a residual add the backend holds back for fusion must land first
        cfg = LaunchConfig(tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block)))
        launch_ex(self.module.function(name), cfg, args, self.b.stream, name, pdl=self.b.k.pdl)

    def experts(self, raw: np.ndarray, where: Any) -> CudaExperts:
        check_experts(where)
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

    def routed(self, w: Any, x: DeviceArray, ids: DeviceArray, out: DeviceArray | None = None) -> DeviceArray:
        """y (n, k_used, rows); x (n, k) shared by the slots, or (n, k_used, k) one per slot.
        With `out`, entries whose id is negative are left as they are (expert cache groups)."""
        ex: CudaExperts = w if isinstance(w, CudaExperts) else w.data  # expert cache slots, or resident
        n, used = ids.shape
        rows, k = ex.where.rows, ex.where.k
        per_slot = len(x.shape) == 3
        x2 = x.reshape(n * used, k) if per_slot else x  # gate/up pass h itself: its quantization is reused
        xq, s = self.b._activations(ex, x2)
        y = self.b._new(n, used, rows) if out is None else out
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


class CudaExpertSlots:
    """The VRAM expert cache's storage: per projection one (n_slots, rows, k) tensor of GGUF
    blocks, so `moe_matvec_<type>` reads cache slot j where it would read expert j. A fill is
    copied on its own stream; compute waits for the fill's event, and the next fill of a slot
    waits for the compute that last read it."""

    def __init__(self, backend: Any, n_slots: int, wheres: tuple) -> None:
        from ntx_engine.backends.cuda_driver import Event, Stream

        for w in wheres:
            check_experts(w)
        self.b, self.n_slots = backend, n_slots
        self.wheres = [_slot_where(w, n_slots) for w in wheres]
        self.arrays = [DeviceArray(backend.pool, (n_slots * w.expert_nbytes,), np.uint8) for w in self.wheres]
        self.experts = [CudaExperts(a, w) for a, w in zip(self.arrays, self.wheres)]
        self.copy_stream = Stream()
        self.copied = [Event() for _ in range(n_slots)]
        self.freed = [Event() for _ in range(n_slots)]
        self._filled: set[int] = set()

    def fill(self, slot: int, parts: tuple) -> None:
        """parts: the expert's gate, up, down bytes (pinned host views)."""
        from ntx_engine.backends.cuda_driver import check, driver

        drv, cs = driver(), self.copy_stream.handle
        check(drv.cuStreamWaitEvent(cs, self.freed[slot].handle, 0), "cuStreamWaitEvent(expert slot free)")
        for arr, where, src in zip(self.arrays, self.wheres, parts):
            n = where.expert_nbytes
            if src.nbytes != n:
                raise ModelError(f"{where.name}: expert of {src.nbytes} bytes for a {n}-byte cache slot")
            check(drv.cuMemcpyHtoDAsync(arr.ptr + slot * n, src.ctypes.data, n, cs),
                  f"cuMemcpyHtoDAsync(expert slot {slot}, {n} bytes)")
        self.copied[slot].record(self.copy_stream)
        self._filled.add(slot)

    def before_compute(self, slots) -> None:
        from ntx_engine.backends.cuda_driver import check, driver

        for s in slots:
            if s in self._filled:  # wait once for each fill
                check(driver().cuStreamWaitEvent(self.b.stream.handle, self.copied[s].handle, 0),
                      "cuStreamWaitEvent(expert slot copied)")
                self._filled.discard(s)

    def after_compute(self, slots) -> None:
        self.b.flush()
        for s in slots:
            self.freed[s].record(self.b.stream)

    def wait_copies(self) -> None:
        """The host may reuse a staging buffer only after the copies out of it have finished."""
        self.copy_stream.synchronize()

    def ids(self, slot_ids: np.ndarray) -> DeviceArray:
        return upload(self.b.pool, np.ascontiguousarray(slot_ids, np.int32), self.b.stream)

    def close(self) -> None:
        self.copy_stream.synchronize()
        self.b.stream.synchronize()
        self.arrays, self.experts = [], []


def _slot_where(where: Any, n_slots: int) -> Any:
    """The ExpertTensor of a slot array: the file tensor's type and shape, n_slots experts."""
    import dataclasses

    return dataclasses.replace(where, n_expert=n_slots, offset=0)
