"""The few cuBLAS calls the prefill GEMM needs, through ctypes on the `nvidia-cublas` wheel's
libcublas (found by cuda-pathfinder, the way cuda-python finds NVRTC). cuBLAS runs on the
primary context the driver-API backend already uses, on the backend's own stream, with a
workspace taken from the backend's memory pool (so the planner's workspace reserve covers it).
"""

from __future__ import annotations

import ctypes

from ntx_common.errors import CudaError

# cublasOperation_t, cudaDataType, cublasComputeType_t, cublasGemmAlgo_t (cublas_api.h, library_types.h)
OP_N, OP_T = 0, 1
R_32F, R_16F = 0, 2
COMPUTE_32F = 68
GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20  # cuBLAS's own recommendation for Hopper


def load_library() -> ctypes.CDLL:
    """libcublas from the nvidia-cublas wheel or the CUDA toolkit; CudaError naming the fix if absent."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        found = load_nvidia_dynamic_lib("cublas")
        if found.abs_path is None:
            raise OSError("cuda-pathfinder found libcublas but not its path")
        lib = ctypes.CDLL(found.abs_path)
    except Exception as exc:  # pathfinder raises its own not-found types; any failure means the same fix
        raise CudaError(f"cuBLAS is not available ({exc}); install it with `pip install 'ntx[cuda]'` "
                        f"(the nvidia-cublas wheel), or set NTX_CUDA_GEMM=0 to prefill without it") from exc
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasDestroy_v2.argtypes = [vp]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    lib.cublasGetStatusString.argtypes = [i32]
    lib.cublasGetStatusString.restype = ctypes.c_char_p
    lib.cublasGemmEx.argtypes = [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32, vp, vp, i32, i32,
                                 i32, i32]
    for fn in (lib.cublasCreate_v2, lib.cublasDestroy_v2, lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2,
               lib.cublasGemmEx):
        fn.restype = i32
    return lib


class Cublas:
    """One cuBLAS handle bound to a stream and a workspace of device memory."""

    def __init__(self, stream_handle: int, workspace_ptr: int, workspace_bytes: int) -> None:
        self.lib = load_library()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream_handle)), "cublasSetStream")
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(workspace_ptr), workspace_bytes),
                    "cublasSetWorkspace")
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            text = self.lib.cublasGetStatusString(status)
            raise CudaError(f"{call} failed: {text.decode() if text else 'status ' + str(status)}")

    def gemm_f16(self, w_ptr: int, x_ptr: int, y_ptr: int, rows: int, n: int, k: int, ldy: int) -> None:
        """y (n, ldy) row-major float32, columns [0, rows) = x (n, k) fp16 . w (rows, k)^T fp16, fp32
        accumulation. In cuBLAS's column-major terms: Y^T (rows x n, ld ldy) = W^T' (op T) . X^T."""
        self._check(self.lib.cublasGemmEx(self.handle, OP_T, OP_N, rows, n, k, ctypes.byref(self._one),
                                          ctypes.c_void_p(w_ptr), R_16F, k, ctypes.c_void_p(x_ptr), R_16F, k,
                                          ctypes.byref(self._zero), ctypes.c_void_p(y_ptr), R_32F, ldy,
                                          COMPUTE_32F, GEMM_DEFAULT),
                    f"cublasGemmEx({rows}x{k} by {n} tokens)")

    def close(self) -> None:
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()
