"""One error hierarchy for all of ntx.

Libraries raise these; only the CLI boundary (`ntx_common.console.run_app`) prints them.
Every message names the object that failed and the likely fix.
"""


class NtxError(Exception):
    """Root of every error ntx raises on purpose."""

    exit_code = 1


class UsageError(NtxError):
    """The user asked for something inconsistent (bad option combination, bad value)."""

    exit_code = 2


class SetupError(NtxError):
    """A machine-setup step was refused or failed (`ntx-setup`)."""


class PermissionNeeded(SetupError):
    """The step needs root or a capability the process lacks."""


class NtxIOError(NtxError):
    """Reading model bytes from storage failed (readers, staging, buffers)."""


class NvmeError(NtxIOError):
    """The userspace NVMe driver failed; carries the NVMe status or -errno when known."""


class GGUFError(NtxError):
    """A GGUF file is malformed, truncated or uses something we do not support."""


class UnsupportedQuantError(GGUFError):
    """A tensor uses a GGML type this backend cannot decode."""


class ModelError(NtxError):
    """The model cannot be loaded or run (missing file, unsupported architecture, bad config)."""


class TokenizerError(NtxError):
    """The tokenizer or chat template in a GGUF cannot be built or applied."""


class CudaError(NtxError):
    """A CUDA driver, runtime or NVRTC call failed; the message names the call."""


class CpuKernelError(NtxError):
    """A native CPU kernel call (`native/cpu`) failed; the message names the op and the errno."""
