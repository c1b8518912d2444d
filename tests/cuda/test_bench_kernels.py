"""native/cuda/read_ceiling.cu (scripts/bench_cuda.py read_ceiling_table: the streaming-read
ceiling the decode matvecs are measured against) builds warning-free for sm_80 and sm_90 with
every layout the benchmark launches; no GPU needed."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.backends import cuda_nvrtc


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_read_ceiling_kernels_build(arch):
    cubin, log = cuda_nvrtc.compile_cubin("read_ceiling.cu", arch)
    assert "warning" not in log.lower(), log
    for u in (1, 2, 4, 8):
        for layout in ("rows", "flat"):
            assert f"read_{layout}_u{u}\0".encode() in cubin, f"read_{layout}_u{u} missing from the {arch} cubin"
    assert b"read_chain\0" in cubin, f"read_chain missing from the {arch} cubin"


@pytest.mark.parametrize("mix,key", [("q4_k_m", "Q4_K_M"), ("q8_0", "Q8_0")])
def test_layer_ceiling_reads_a_synthetic_8b_layer(mix, key):
    """scripts/bench_ceiling.py's byte counts are those of make_synthetic_model's llama3-8b layer
    (the file the decode benchmark runs), matrix by matrix in decode order."""
    from ntx_engine import quants
    from tests.cuda.conftest import _load_script

    msm, bc = _load_script("make_synthetic_model"), _load_script("bench_ceiling")
    _, plan = msm.tensor_plan("llama3-8b", 1, mix)
    size = {name.removeprefix("blk.0.").removesuffix(".weight"): quants.tensor_nbytes(t, int(np.prod(shape)))
            for name, t, shape in plan}
    want = (("qkv", size["attn_q"] + size["attn_k"] + size["attn_v"]), ("o", size["attn_output"]),
            ("gate+up", size["ffn_gate"] + size["ffn_up"]), ("down", size["ffn_down"]))
    assert bc.LAYERS[key] == want
    assert all(n % 16 == 0 for _, n in want)  # read_chain reads whole 16-byte chunks


def test_the_stack_start_marks_need_their_build():
    """scripts/bench_stack_trace.py --start reads the marks only an NTX_LQ_PTRACE build writes: without it, it says
    so instead of printing another build's marks as the launch's start."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "NTX_CUDA_DEFINES": ""}
    r = subprocess.run([sys.executable, str(root / "scripts/bench_stack_trace.py"), "m.gguf", "--start"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "NTX_CUDA_DEFINES=-DNTX_LQ_PTRACE=1" in r.stderr, r.stderr


@pytest.mark.parametrize("script,defines", [("bench_stack_trace.py", ""), ("bench_stack_ring.py", "-DNTX_LQ_RTRACE=1")])
def test_the_stack_tools_name_a_bad_model_or_prompt(tmp_path, script, defines):
    """The stack tools' bad input is a one-line error naming it (a model that cannot be opened, a prompt length that
    is not a number), never a traceback; --help prints the tool's description."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "NTX_CUDA_DEFINES": defines}
    run = lambda *a: subprocess.run([sys.executable, str(root / "scripts" / script), *a], capture_output=True, text=True,
                                    env=env, timeout=120, cwd=tmp_path)
    r = run(str(tmp_path / "missing.gguf"))
    assert r.returncode != 0 and "cannot open GGUF file" in r.stderr and str(tmp_path / "missing.gguf") in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = run("m.gguf", "many")
    assert r.returncode == 2 and "invalid int value: 'many'" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = run("--help")
    assert r.returncode == 0 and "stack" in r.stdout and "usage:" in r.stdout
