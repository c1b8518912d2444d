"""The grid attention's fixed-group kernels (attn_grid.cu, cuda_kernels.GRID_FIXED_GROUPS): built
for sm_80 and sm_90, each smaller than the generic kernel of its head_dim, and chosen by
grid_attn_kernel for exactly their layouts; no GPU needed."""

from __future__ import annotations

import pytest

from ntx_engine.backends import cuda_nvrtc


def _text_sizes(cubin: bytes) -> dict[str, int]:
    """{kernel: bytes of its .text section} from the cubin's ELF section headers."""
    import struct

    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = heads[shstrndx][4]

    def name(off: int) -> str:
        return cubin[strtab + off:cubin.index(b"\0", strtab + off)].decode()

    return {name(h[0])[len(".text."):]: h[5] for h in heads if name(h[0]).startswith(".text.")}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fixed_group_kernels_are_built_and_smaller(arch):
    from ntx_engine.backends.cuda_kernels import GRID_FIXED_GROUPS

    sizes = _text_sizes(cuda_nvrtc.compile_cubin("attn_grid.cu", arch)[0])
    for v, g in GRID_FIXED_GROUPS:
        fixed, generic = sizes.get(f"attn_grid_{v}_g{g}"), sizes[f"attn_grid_{v}"]
        assert fixed, f"attn_grid_{v}_g{g} missing from the {arch} cubin: {sorted(sizes)}"
        assert fixed < generic / 2, f"attn_grid_{v}_g{g}: {fixed} bytes of code against the generic {generic}"


def test_grid_kernel_choice(monkeypatch):
    from ntx_engine.backends.cuda_kernels import grid_attn_kernel

    assert grid_attn_kernel(32, 8, 128) == "attn_grid_4_g4"  # Llama-3-8B
    assert grid_attn_kernel(64, 8, 128) == "attn_grid_4_g8"  # Llama-3-70B
    assert grid_attn_kernel(9, 3, 64) == "attn_grid_2_g3"  # SmolLM2-135M
    assert grid_attn_kernel(28, 4, 128) == "attn_grid_4"  # a group of 7: the generic kernel
    assert grid_attn_kernel(32, 8, 64) == "attn_grid_2"  # (64, 4) has no fixed kernel
    monkeypatch.setenv("NTX_CUDA_GRID_FIXED", "0")
    assert grid_attn_kernel(32, 8, 128) == "attn_grid_4"


@pytest.mark.parametrize("value", ["2", "yes", ""])
def test_grid_fixed_setting_is_checked(monkeypatch, value):
    from ntx_common.errors import UsageError
    from ntx_engine.backends.cuda_kernels import grid_attn_kernel

    monkeypatch.setenv("NTX_CUDA_GRID_FIXED", value)
    with pytest.raises(UsageError, match="NTX_CUDA_GRID_FIXED must be 0 or 1"):
        grid_attn_kernel(32, 8, 128)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cluster_kernels_are_built_for_hopper_only(arch):
    """The cluster form needs sm_90 (thread-block clusters, distributed shared memory): its kernels
    are in the sm_90 cubin, and the sm_80 one, which cannot hold them, leaves them out."""
    from ntx_engine.backends.cuda_kernels import CLUSTER_GROUPS, CLUSTER_SIZES

    sizes = _text_sizes(cuda_nvrtc.compile_cubin("attn_grid.cu", arch)[0])
    names = [f"attn_cl{c}_{v}_g{g}" for v, g in CLUSTER_GROUPS for c in CLUSTER_SIZES]
    assert all((n in sizes) == (arch == "sm_90") for n in names), (arch, sorted(sizes))


def test_cluster_choice(monkeypatch):
    """The cluster form runs where it is not turned off (NTX_CUDA_GRID_CLUSTER=0), the layout has a
    cluster kernel and the GPU has clusters (sm_90+); its shape is the cluster's blocks a KV head, with no
    bound from the blocks an SM holds (its clusters need not be resident together)."""
    from ntx_engine.backends.cuda_kernels import (CLUSTER_STATIC_SMEM, grid_attn_kernel, grid_attn_shape,
                                                  grid_cluster_setting, grid_cluster_size)

    assert grid_cluster_setting() == 16  # the default
    monkeypatch.setenv("NTX_CUDA_GRID_CLUSTER", "0")
    assert grid_cluster_setting() == 0
    assert grid_cluster_size(32, 8, 128, (9, 0), 16) == 16  # Llama-3-8B on the H200
    assert grid_cluster_size(32, 8, 128, (8, 0), 16) == 0  # an A100: no clusters
    assert grid_cluster_size(64, 8, 128, (9, 0), 16) == 0  # groups of 8: no cluster kernel
    assert grid_cluster_size(9, 3, 64, (9, 0), 8) == 0
    assert grid_cluster_size(32, 8, 128, (9, 0), 0) == 0
    assert grid_attn_kernel(32, 8, 128, cluster=8) == "attn_cl8_4_g4"
    h200 = dict(sm_count=132, smem_optin=232448)
    assert grid_attn_shape(32, 8, 128, 576, **h200, cluster=16) == (16, 36, 16)
    assert grid_attn_shape(32, 8, 128, 100, **h200, cluster=8) == (8, 16, 16)
    assert grid_attn_shape(32, 8, 128, 576, sm_count=4, smem_optin=232448, cluster=16) == (16, 36, 16)
    rmax = (232448 - CLUSTER_STATIC_SMEM) // 16 // 8 * 8  # 4 heads' scores: as long as shared memory holds
    assert grid_attn_shape(32, 8, 128, 16 * rmax, **h200, cluster=16) == (16, rmax, 16)
    assert grid_attn_shape(32, 8, 128, 16 * rmax + 16 * 8, **h200, cluster=16) is None


@pytest.mark.parametrize("value", ["1", "32", "yes"])
def test_cluster_setting_is_checked(monkeypatch, value):
    from ntx_common.errors import UsageError
    from ntx_engine.backends.cuda_kernels import grid_cluster_setting

    monkeypatch.setenv("NTX_CUDA_GRID_CLUSTER", value)
    with pytest.raises(UsageError, match="NTX_CUDA_GRID_CLUSTER must be 0 or one of 8, 16"):
        grid_cluster_setting()
