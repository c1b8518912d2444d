"""The engine reading a model staged on an emulated NVMe through the userspace VFIO driver
(`--model nvme:<bdf>`), in a QEMU guest with the VT-d IOMMU: the tokens equal those of the
same GGUF read as a file, with every layer resident (loaded through the driver) and with every
layer in the storage tier (read through the driver on every token)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ntx_engine.config import ModelConfig
from ntx_engine.gguf import GGUFFile
from ntx_engine.layout import layer_spans, resident_bytes
from ntx_engine.planner import Budgets, Links, PlanError, make_plan
from ntx_io.stage import apply_stage, plan_stage

from .harness import run_guest

pytestmark = pytest.mark.vm
N_CTX = 64
DISK_MB = 192
N_LAYERS = 8  # enough layers that a 2-slot ring is smaller than the model: storage-only plans exist
RUN = "ntx-run --device cpu --raw --temperature 0 -n 6 --ctx 64 --json"


def storage_only_budget(path) -> int:
    """The smallest VRAM budget (KiB steps) that plans: every layer then streams from storage."""
    with GGUFFile.open(path) as gf:
        cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
        spans, head = layer_spans(gf, cfg), resident_bytes(gf, cfg)
    links = Links(vram=1e10, h2d=1e10, storage=1e9)
    for kib in range(1024, 1 << 20, 64):
        try:
            plan = make_plan(spans, head, cfg, N_CTX, Budgets(vram=kib << 10, ram=0), links)
        except PlanError:
            continue
        assert {p.tier for p in plan.placements} == {"storage"}
        return kib << 10
    raise AssertionError("no budget plans")


def test_nvme_model_tokens_equal_file_tokens(tmp_path):
    import tiny_models
    from ntx_engine.modelfile import default_model

    model = tmp_path / "tiny8.gguf"
    tiny_models.write_tiny(model, default_model(), "llama", seed=7, n_layers=N_LAYERS)
    disk = tmp_path / "nvme.img"
    with open(disk, "wb") as f:
        f.write(os.urandom(DISK_MB << 20))
    apply_stage(plan_stage(model, disk))
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(model, out / "tiny.gguf")  # the guest reads the file path from the shared dir
    budget = storage_only_budget(model)
    prompt = "'Once upon a time'"
    command = "; ".join([
        "echo 64 > /proc/sys/vm/nr_hugepages",
        f"{RUN} -m $NTX_VM_OUT/tiny.gguf {prompt} > $NTX_VM_OUT/file.json 2> $NTX_VM_OUT/file.err",
        f"{RUN} -m nvme:$NTX_VM_BDF {prompt} > $NTX_VM_OUT/nvme.json 2> $NTX_VM_OUT/nvme.err",
        f"{RUN} -m nvme:$NTX_VM_BDF --vram-budget {budget} --ram-budget 0 {prompt} "
        "> $NTX_VM_OUT/stream.json 2> $NTX_VM_OUT/stream.err",
    ])
    result = run_guest(command, disk=disk, mode="iommu", bind_vfio=True, mem_mb=1024, timeout=1200, out_dir=out)
    runs = {}
    for name in ("file", "nvme", "stream"):
        text = (out / f"{name}.json").read_text() if (out / f"{name}.json").exists() else ""
        if not text.strip():
            err = (out / f"{name}.err").read_text() if (out / f"{name}.err").exists() else ""
            pytest.fail(f"guest run {name!r} printed no JSON\n{err[-3000:]}\n--- console ---\n"
                        f"{result.console[-3000:]}", pytrace=False)
        runs[name] = json.loads(text)
    assert len(runs["file"]["tokens"]) == 6
    assert runs["nvme"]["tokens"] == runs["file"]["tokens"]
    assert runs["stream"]["tokens"] == runs["file"]["tokens"]
    assert runs["nvme"]["model"].startswith("nvme:")
    tiers = runs["stream"]["tiers"]
    assert tiers["streamed"] and tiers["bytes_per_tier"]["vram"] == 0
    assert tiers["pipeline"]["bytes"]["storage"] == 6 * tiers["bytes_per_tier"]["storage"]
