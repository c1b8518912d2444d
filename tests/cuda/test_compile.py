"""Every kernel compiles with NVRTC to cubin for sm_80 and sm_90; no GPU or driver needed."""

from __future__ import annotations

import shutil

import pytest

from ntx_common.errors import CudaError
from ntx_engine.backends import cuda_nvrtc


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", cuda_nvrtc.SOURCES)
def test_kernel_compiles_to_cubin(source, arch):
    cubin, log = cuda_nvrtc.compile_cubin(source, arch)
    assert cubin[:4] == b"\x7fELF", "NVRTC did not return an ELF cubin"
    assert "warning" not in log.lower(), log


def test_every_weight_type_has_kernels():
    from ntx_engine.backends.cuda_kernels import KERNEL_TYPES

    cubin, _ = cuda_nvrtc.compile_cubin("matvec.cu", "sm_90")
    for suffix in KERNEL_TYPES.values():
        for kernel in (f"matvec_{suffix}_n1", f"matvec_{suffix}_n8", f"embed_{suffix}"):
            assert kernel.encode() + b"\0" in cubin, f"{kernel} missing from the cubin"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fast_kernels_present(arch):
    """The dp4a kernels exist for every FAST_TYPES entry (sm_80 too: NTX_PDL()'s griddepcontrol
    is Hopper-only and must compile to nothing there)."""
    from ntx_engine.backends.cuda_kernels import FAST_TYPES

    cubin, _ = cuda_nvrtc.compile_cubin("matvec_fast.cu", arch)
    for suffix in FAST_TYPES.values():
        for kernel in (f"matvecf_{suffix}_n1", f"matvecf_{suffix}_n8"):
            assert kernel.encode() + b"\0" in cubin, f"{kernel} missing from the cubin"
    for kernel in ("quanti_q8_1", "quanti_q8_k"):
        assert kernel.encode() + b"\0" in cubin


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_moe_kernels_compile(arch):
    """native/cuda/moe.cu (loaded by backends/cuda_moe.py, not cuda_nvrtc.SOURCES): clean build,
    the router, the combine and one routed matvec per weight type."""
    from ntx_engine.backends.cuda_kernels import KERNEL_TYPES
    from ntx_engine.backends.cuda_moe import SOURCES

    for source in SOURCES:
        cubin, log = cuda_nvrtc.compile_cubin(source, arch)
        assert cubin[:4] == b"\x7fELF" and "warning" not in log.lower(), log
    kernels = ["moe_route", "moe_combine", *(f"moe_matvec_{s}" for s in KERNEL_TYPES.values())]
    for kernel in kernels:
        assert kernel.encode() + b"\0" in cubin, f"{kernel} missing from the moe.cu cubin"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fused_kernels_present(arch):
    cubin, _ = cuda_nvrtc.compile_cubin("fused.cu", arch)
    for kernel in ("matvecf_multi_n1", "matvecf_multi_n8", "matvecf_swiglu_n1", "matvecf_swiglu_n8", "rope_kv",
                   "add_rmsnorm_quanti"):
        assert kernel.encode() + b"\0" in cubin, f"{kernel} missing from the cubin"
    from ntx_engine.backends.cuda_kernels import MMQ_TYPES

    cubin, _ = cuda_nvrtc.compile_cubin("mmq.cu", arch)
    for suffix in MMQ_TYPES.values():
        assert f"mmq_{suffix}".encode() + b"\0" in cubin, f"mmq_{suffix} missing from the cubin"


def test_tuning_defines_reach_only_the_dp4a_sources(monkeypatch):
    """NTX_CUDA_DEFINES changes the options (and so the cache key) of the TUNABLE sources
    (matvec_fast.cu, fused.cu, attn_grid.cu) only; anything but -DNTX_* is refused."""
    monkeypatch.setenv("NTX_CUDA_DEFINES", "-DNTX_G_Q8_0=64")
    assert cuda_nvrtc.options("fused.cu")[-1] == "-DNTX_G_Q8_0=64"
    assert cuda_nvrtc.options("attn_grid.cu")[-1] == "-DNTX_G_Q8_0=64"
    assert cuda_nvrtc.options("attention.cu") == cuda_nvrtc.OPTIONS
    assert cuda_nvrtc.options("matvec.cu") == cuda_nvrtc.OPTIONS
    cubin, _ = cuda_nvrtc.compile_cubin("matvec_fast.cu", "sm_90")
    assert b"matvecf_q8_0_n1\0" in cubin
    monkeypatch.setenv("NTX_CUDA_DEFINES", "-O0")
    with pytest.raises(CudaError, match="NTX_CUDA_DEFINES"):
        cuda_nvrtc.options("fused.cu")


def _ptx(source: str) -> str:
    """PTX of `source` for compute_90 with the current options (to read which instructions a
    build uses: a cubin's SASS is binary)."""
    nvrtc = cuda_nvrtc._nvrtc()
    path = cuda_nvrtc.KERNEL_DIR / source
    prog = cuda_nvrtc.check_nvrtc(nvrtc.nvrtcCreateProgram(path.read_bytes(), source.encode(), 0, [], []), "create")
    try:
        opts = [b"--gpu-architecture=compute_90", f"--include-path={cuda_nvrtc.KERNEL_DIR}".encode(),
                *(o.encode() for o in cuda_nvrtc.options(source))]
        cuda_nvrtc.check_nvrtc(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), "compile",
                               cuda_nvrtc._program_log(nvrtc, prog))
        buf = bytearray(cuda_nvrtc.check_nvrtc(nvrtc.nvrtcGetPTXSize(prog), "size"))
        cuda_nvrtc.check_nvrtc(nvrtc.nvrtcGetPTX(prog, buf), "ptx")
        return bytes(buf).decode()
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _first_weight_load_before_wait(ptx: str, kernel: str) -> bool:
    """Whether a weight load (ld.global.cs) comes before a PDL wait in the kernel's PTX (the
    compiler may copy the wait into several branches: the last one closes the path that loads)."""
    body = ptx[ptx.index(f".entry {kernel}("):]
    body = body[: body.index("\n}\n")]
    return body.index("ld.global.cs") < body.rindex("griddepcontrol.wait")


def test_prewait_loads_the_first_weight_group_before_the_pdl_wait(monkeypatch):
    """The default build loads each warp's first weight group (streaming loads, ld.global.cs)
    before griddepcontrol.wait; -DNTX_PRE_WAIT=0 waits first. Checked in the PTX of the one-weight
    kernels, whose blocks the compiler lays out in program order (in fused.cu the loading path
    jumps back to a wait placed earlier in the text, so only a change and a clean build are
    checked there). Results against each other: tests/cuda/test_prewait_gpu.py."""
    kernels = ("matvecf_q4_k_n1", "matvecf_q6_k_n8", "matvecf_q8_0_n1")
    default_ptx, default_fused = _ptx("matvec_fast.cu"), _ptx("fused.cu")
    assert all(_first_weight_load_before_wait(default_ptx, k) for k in kernels)
    monkeypatch.setenv("NTX_CUDA_DEFINES", "-DNTX_PRE_WAIT=0")
    assert not any(_first_weight_load_before_wait(_ptx("matvec_fast.cu"), k) for k in kernels)
    assert _ptx("fused.cu") != default_fused
    for source in ("matvec_fast.cu", "fused.cu"):
        for arch in ("sm_80", "sm_90"):
            cubin, log = cuda_nvrtc.compile_cubin(source, arch)
            assert "warning" not in log.lower(), log


def test_cache_reuses_cubin_and_keys_on_source(tmp_path):
    kdir = tmp_path / "kernels"
    shutil.copytree(cuda_nvrtc.KERNEL_DIR, kdir)
    cache = tmp_path / "cache"
    first = cuda_nvrtc.cached_cubin("attention.cu", "sm_90", cache, kdir)
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].read_bytes() == first
    assert cuda_nvrtc.cached_cubin("attention.cu", "sm_90", cache, kdir) == first
    assert len(list(cache.iterdir())) == 1  # a hit: nothing new written
    (kdir / "ntx_half.cuh").write_text((kdir / "ntx_half.cuh").read_text() + "\n// changed\n")
    cuda_nvrtc.cached_cubin("attention.cu", "sm_90", cache, kdir)
    assert len(list(cache.iterdir())) == 2  # a header change is a new key
    cuda_nvrtc.cached_cubin("attention.cu", "sm_80", cache, kdir)
    assert len(list(cache.iterdir())) == 3


def test_a_source_built_from_another_is_keyed_on_both(tmp_path):
    """layer_q8_ks.cu includes layer_q8.cu (the stack kernel with other macros) and layer_q8_ks5.cu includes
    layer_q8_ks.cu: a change to layer_q8.cu is a new key for all three, and no change to a source that includes none."""
    kdir = tmp_path / "kernels"
    shutil.copytree(cuda_nvrtc.KERNEL_DIR, kdir)
    assert cuda_nvrtc.included_sources("layer_q8_ks.cu", kdir) == ["layer_q8.cu"]
    assert cuda_nvrtc.included_sources("layer_q8_ks5.cu", kdir) == ["layer_q8.cu", "layer_q8_ks.cu"]
    names = ("layer_q8_ks5.cu", "layer_q8_ks.cu", "layer_q8.cu", "attention.cu")
    before = {s: cuda_nvrtc.cache_key(s, "sm_90", kdir) for s in names}
    (kdir / "layer_q8.cu").write_text((kdir / "layer_q8.cu").read_text() + "\n// changed\n")
    after = {s: cuda_nvrtc.cache_key(s, "sm_90", kdir) for s in names}
    assert all(after[s] != before[s] for s in names[:3])
    assert after["attention.cu"] == before["attention.cu"]


def test_uncached_sources_compile_side_by_side(tmp_path):
    """cached_cubins: the sources missing from the cache compiled on threads, with progress
    (0 of n, then one call a finished source), the same bytes a compile of each alone gives,
    written to the cache; a second call compiles nothing, and a changed source alone recompiles."""
    kdir = tmp_path / "kernels"
    shutil.copytree(cuda_nvrtc.KERNEL_DIR, kdir)
    cache, sources, calls = tmp_path / "cache", ["ops.cu", "dequant.cu", "mmq.cu"], []
    got = cuda_nvrtc.cached_cubins(sources, "sm_90", cache, kdir, on_compile=lambda d, t: calls.append((d, t)))
    assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]
    assert got == {s: cuda_nvrtc.compile_cubin(s, "sm_90", kdir)[0] for s in sources}
    assert sorted(p.read_bytes() for p in cache.iterdir()) == sorted(got.values())
    calls.clear()
    assert cuda_nvrtc.cached_cubins(sources, "sm_90", cache, kdir, on_compile=lambda d, t: calls.append((d, t))) == got
    assert calls == []
    (kdir / "ops.cu").write_text((kdir / "ops.cu").read_text() + "\n// changed\n")
    cuda_nvrtc.cached_cubins(sources, "sm_90", cache, kdir, on_compile=lambda d, t: calls.append((d, t)))
    assert calls == [(0, 1), (1, 1)] and len(list(cache.iterdir())) == 4


def test_a_failing_source_among_parallel_compiles_carries_its_log(tmp_path):
    shutil.copy(cuda_nvrtc.KERNEL_DIR / "ops.cu", tmp_path)
    for header in cuda_nvrtc.KERNEL_DIR.glob("*.cuh"):
        shutil.copy(header, tmp_path)
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n')
    with pytest.raises(CudaError, match=r"(?s)nvrtcCompileProgram\(broken.cu, sm_90\).*undefined_name"):
        cuda_nvrtc.cached_cubins(["ops.cu", "broken.cu"], "sm_90", tmp_path / "cache", tmp_path)


def test_compile_error_carries_the_log(tmp_path):
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n')
    with pytest.raises(CudaError) as exc:
        cuda_nvrtc.compile_cubin("broken.cu", "sm_90", tmp_path)
    assert "nvrtcCompileProgram(broken.cu, sm_90)" in str(exc.value)
    assert "undefined_name" in str(exc.value)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_prefill_gemm_kernels_present(arch):
    """dequant.cu: an fp16 decoder for every weight type the GEMM path takes, and the activation
    conversion / scale kernels around the cuBLAS call."""
    from ntx_engine.backends.cuda_backend import GEMM_TYPES
    from ntx_engine.backends.cuda_kernels import KERNEL_TYPES

    cubin, _ = cuda_nvrtc.compile_cubin("dequant.cu", arch)
    for t in GEMM_TYPES:
        assert f"dequant_f16_{KERNEL_TYPES[t]}".encode() + b"\0" in cubin, f"dequant_f16 for {t.name} missing"
    for kernel in ("to_f16_rows", "scale_rows"):
        assert kernel.encode() + b"\0" in cubin, f"{kernel} missing from the cubin"


def test_missing_cublas_is_a_clear_error(monkeypatch):
    """Without libcublas the error names the package to install and the switch to go without."""
    import cuda.pathfinder

    from ntx_engine.backends import cublas

    def not_found(name):
        raise cuda.pathfinder.DynamicLibNotFoundError(f"{name} not found")

    monkeypatch.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", not_found)
    with pytest.raises(CudaError, match=r"ntx\[cuda\].*NTX_CUDA_GEMM=0"):
        cublas.load_library()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_gqa_attention_kernels_present(arch):
    """Both passes of the split decode attention for every head_dim the backend may pick
    (cuda_kernels.ATTN_GQA_V), and the head layouts gqa_split_ok admits or sends elsewhere."""
    from ntx_engine.backends.cuda_kernels import ATTN_GQA_V, gqa_split_ok

    cubin, _ = cuda_nvrtc.compile_cubin("attention.cu", arch)
    for v in ATTN_GQA_V:
        for kernel in (f"attn_gqa_scores_{v}", f"attn_gqa_pv_{v}"):
            assert kernel.encode() + b"\0" in cubin, f"{kernel} missing from the cubin"
    assert gqa_split_ok(32, 8, 128) and gqa_split_ok(9, 3, 64) and gqa_split_ok(64, 8, 128)
    assert not gqa_split_ok(32, 8, 80)  # head_dim not whole 32-value lanes
    assert not gqa_split_ok(64, 2, 128)  # 32 query heads a KV head: more than the kernels hold


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_grid_attention_kernels_present(arch):
    """The one-launch decode attention (attn_grid.cu) for every head_dim the split kernels take,
    with its static shared memory within what cuda_kernels reserves for it."""
    from ntx_engine.backends.cuda_kernels import ATTN_GQA_V

    cubin, _ = cuda_nvrtc.compile_cubin("attn_grid.cu", arch)
    for v in ATTN_GQA_V:
        assert f"attn_grid_{v}\0".encode() in cubin, f"attn_grid_{v} missing from the cubin"


def test_grid_attention_shape():
    """Blocks a KV head and positions a block: every block resident at once (the kernel's blocks
    wait for each other), the scores in shared memory, else None (the split kernels run)."""
    from ntx_engine.backends.cuda_kernels import GRID_NBMAX, GRID_STATIC_SMEM, grid_attn_shape

    h200 = dict(sm_count=132, smem_optin=227 * 1024)
    assert grid_attn_shape(32, 8, 128, 1024, **h200) == (16, 64, 16)  # Llama-3-8B: 128 blocks on 132 SMs
    assert grid_attn_shape(32, 8, 128, 1024, **h200, per_sm=2) == (32, 32, 16)  # two blocks an SM
    assert grid_attn_shape(9, 3, 64, 8192, **h200) == (GRID_NBMAX, 256, 16)  # few KV heads: at most 32 a head
    assert grid_attn_shape(32, 8, 128, 40, **h200) == (16, 16, 16)  # at least 16 positions a block
    assert grid_attn_shape(32, 8, 128, 40, **h200, minr=48) == (16, 48, 48)  # room for minr positions
    assert grid_attn_shape(64, 8, 128, 131072, **h200) is None  # 8 heads x 8192 scores: 256 KiB
    assert grid_attn_shape(32, 8, 80, 1024, **h200) is None  # not a split-kernel layout
    assert grid_attn_shape(32, 32, 128, 1024, sm_count=16, smem_optin=227 * 1024) is None  # more KV heads than SMs
    for n_head, n_kv, n_ctx in ((32, 8, 1024), (9, 3, 8192), (64, 8, 32768), (16, 2, 4096)):
        nb, rmax, _ = grid_attn_shape(n_head, n_kv, 128, n_ctx, **h200)
        assert nb * n_kv <= 132 and nb * rmax >= n_ctx
        assert GRID_STATIC_SMEM + 4 * (n_head // n_kv) * rmax <= 227 * 1024


@pytest.mark.parametrize("source,kernels", [("ops.cu", ("rmsnorm",)), ("fused.cu", ("add_rmsnorm_quanti",))])
def test_norm_kernels_fit_their_block(source, kernels, monkeypatch):
    """The norms run 1024 threads a block (cuda_kernels.NORM_THREADS): 64 registers a thread at
    most, or the launch fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES on the GPU."""
    import re

    from ntx_engine.backends.cuda_kernels import NORM_THREADS

    monkeypatch.setattr(cuda_nvrtc, "OPTIONS", cuda_nvrtc.OPTIONS + ("--ptxas-options=-v",))
    _, log = cuda_nvrtc.compile_cubin(source, "sm_90")
    for kernel in kernels:
        used = re.search(rf"Function properties for {kernel}\n.*?\nptxas info\s*: Used (\d+) registers", log, re.S)
        assert used, f"no register count for {kernel} in the ptxas log"
        assert int(used.group(1)) * NORM_THREADS <= 65536, f"{kernel}: {used.group(1)} registers a thread"


def test_decode_matvecs_do_not_spill(monkeypatch):
    """The one-token dp4a kernels keep everything in registers under their launch bounds (the
    paired gate/up rows spilled 164 bytes at 64 registers a thread: NTX_SWIGLU_MINB)."""
    import re

    monkeypatch.setattr(cuda_nvrtc, "OPTIONS", cuda_nvrtc.OPTIONS + ("--ptxas-options=-v",))
    for source in ("matvec_fast.cu", "fused.cu"):
        _, log = cuda_nvrtc.compile_cubin(source, "sm_90")
        found = re.findall(r"Function properties for (\w+_n1)\n.*?(\d+) bytes spill stores", log)
        assert found, f"no ptxas report for the _n1 kernels of {source}"
        assert all(int(spill) == 0 for _, spill in found), found


@pytest.mark.parametrize("value", ["3", "two", ""])
def test_grid_blocks_per_sm_setting_is_checked(monkeypatch, value):
    """NTX_CUDA_GRID_PER_SM takes 1 or 2; anything else is a usage error naming the variable
    (checked before the GPU is asked anything)."""
    from types import SimpleNamespace

    from ntx_common.errors import UsageError
    from ntx_engine.backends.cuda_kernels import Kernels

    monkeypatch.setenv("NTX_CUDA_GRID_PER_SM", value)
    with pytest.raises(UsageError, match="NTX_CUDA_GRID_PER_SM must be 1 or 2"):
        Kernels.grid_per_sm(SimpleNamespace(), 32, 8, 128, 1024)


# the dp4a decode builds other than the default (matvec_fast.cuh): Q6_K one unit a lane
DECODE_VARIANTS = ("-DNTX_Q6_PAIR=0",)


def _n1_spills(source: str, arch: str) -> dict[str, int]:
    """Spill-store bytes of each _n1 kernel of `source` from ptxas -v, with the current defines."""
    import re

    _, log = cuda_nvrtc.compile_cubin(source, arch)
    assert "warning" not in log.lower(), log
    found = re.findall(r"Function properties for (\w+_n1)\n.*?(\d+) bytes spill stores", log)
    assert found, f"no ptxas report for the _n1 kernels of {source} ({arch})"
    return {kernel: int(spill) for kernel, spill in found}


@pytest.mark.parametrize("defines", DECODE_VARIANTS)
def test_decode_variants_compile_clean_without_spills(monkeypatch, defines):
    """Each decode build other than the default builds warning-free for sm_80 and sm_90, and its
    one-token kernels keep everything in registers under the default launch bounds: no spill on sm_90 (as
    test_decode_matvecs_do_not_spill) and none beyond the default build's on sm_80 (whose paired
    gate/up kernel spills 8 bytes in the default build too). The build is not the default one.
    Results: tests/cuda/test_decode_variants_gpu.py."""
    monkeypatch.setattr(cuda_nvrtc, "OPTIONS", cuda_nvrtc.OPTIONS + ("--ptxas-options=-v",))
    for source in ("matvec_fast.cu", "fused.cu"):
        for arch in ("sm_80", "sm_90"):
            monkeypatch.setenv("NTX_CUDA_DEFINES", "")
            default = _n1_spills(source, arch)
            monkeypatch.setenv("NTX_CUDA_DEFINES", defines)
            spills = _n1_spills(source, arch)
            assert spills.keys() == default.keys()
            allowed = {k: 0 if arch == "sm_90" else v for k, v in default.items()}
            assert all(spills[k] <= allowed[k] for k in spills), f"{defines} {source} {arch}: {spills}"
    monkeypatch.setenv("NTX_CUDA_DEFINES", "")
    default_cubin, _ = cuda_nvrtc.compile_cubin("matvec_fast.cu", "sm_90")
    monkeypatch.setenv("NTX_CUDA_DEFINES", defines)
    assert cuda_nvrtc.compile_cubin("matvec_fast.cu", "sm_90")[0] != default_cubin, f"{defines} changed nothing"


# (macro, source, kernel): loads a latency-bound kernel issues before its PDL wait, default 1
PRE_WAIT_LOADS = [("NTX_AG_PRE_WAIT", "attn_grid.cu", "attn_grid_4_g4"),  # the first K/V cache rows
                  ("NTX_NORM_PRE_WAIT", "fused.cu", "add_rmsnorm_quanti")]  # the norm weights


@pytest.mark.parametrize("pre", [1, 0])
@pytest.mark.parametrize("macro,source,kernel", PRE_WAIT_LOADS, ids=[m for m, *_ in PRE_WAIT_LOADS])
def test_latency_bound_kernels_load_before_the_pdl_wait(monkeypatch, macro, source, kernel, pre):
    """With the macro at 1 (its default) the kernel's PTX has its independent loads (at least one
    a register of NTX_NORM_REGS / the first K/V pass) before griddepcontrol.wait; with 0 none. The
    grid attention keeps a wait first on its path without the fused RoPE (the kernel before
    stores the new K/V row there): the last wait is the one after the loads."""
    monkeypatch.setenv("NTX_CUDA_DEFINES", f"-D{macro}={pre}")
    ptx = _ptx(source)
    body = ptx[ptx.index(f".entry {kernel}("):]
    body = body[: body.index("\n}\n")]
    before = body[: body.rindex("griddepcontrol.wait")].count("ld.global")
    assert (before >= 8) if pre else (before == 0), f"{kernel}: {before} global loads before the wait"


def test_the_host_reads_a_tuning_macro_as_the_kernels_are_built_with_it(monkeypatch):
    """define_value: what NTX_CUDA_DEFINES gives a macro (the first -D of it), None where it sets none; the dp4a
    kernels' rows a block follow NTX_FAST_WARPS through it."""
    from ntx_engine.backends.cuda_kernels import FAST_ROWS_PER_BLOCK, fast_rows

    monkeypatch.delenv("NTX_CUDA_DEFINES", raising=False)
    assert cuda_nvrtc.define_value("NTX_FAST_WARPS") is None and fast_rows() == FAST_ROWS_PER_BLOCK
    monkeypatch.setenv("NTX_CUDA_DEFINES", "-DNTX_FAST_WARPSX=3 -DNTX_FAST_WARPS=16 -DNTX_FAST_WARPS=4")
    assert cuda_nvrtc.define_value("NTX_FAST_WARPS") == "16" and fast_rows() == 16
    assert cuda_nvrtc.define_value("NTX_FAST_MINB") is None


# the stack kernel's tuning builds other than the default (layer_q8.cu), with the builds each changes: a K-slice down
# chunk's slot released before its arithmetic (docs/cuda.md session 32; the K-slice builds only), a layer's first
# gate/up chunks asked of L2 during the attention (session 33)
STACK_VARIANTS = (("-DNTX_LQ_KSREL=1", ("layer_q8_ks.cu", "layer_q8_ks5.cu")),
                  ("-DNTX_LQ_L2GU=8", ("layer_q8.cu", "layer_q8_ks.cu")))


@pytest.mark.parametrize("defines, source", [(d, s) for d, sources in STACK_VARIANTS for s in sources])
def test_stack_variants_compile_clean_without_spills(monkeypatch, source, defines):
    """Each stack build other than the default builds warning-free for sm_90, spills nothing in any function, and is
    not the default build. Results: tests/cuda/test_stack_gpu.py with NTX_CUDA_DEFINES set to the build's defines."""
    import re

    monkeypatch.setattr(cuda_nvrtc, "OPTIONS", cuda_nvrtc.OPTIONS + ("--ptxas-options=-v",))
    monkeypatch.setenv("NTX_CUDA_DEFINES", "")
    default_cubin, _ = cuda_nvrtc.compile_cubin(source, "sm_90")
    monkeypatch.setenv("NTX_CUDA_DEFINES", defines)
    cubin, log = cuda_nvrtc.compile_cubin(source, "sm_90")
    assert "warning" not in log.lower(), log
    spills = re.findall(r"Function properties for (\w+)\n.*?(\d+) bytes spill stores", log)
    assert any(name.startswith("layer_q8_hd") for name, _ in spills), f"no ptxas report for {source}'s kernels"
    assert all(int(n) == 0 for _, n in spills), spills
    assert cubin != default_cubin, f"{defines} changed nothing"
