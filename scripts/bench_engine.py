#!/usr/bin/env python3
"""Decode/prefill benchmark of the CUDA engine over several models and kernel variants in one
process: tok/s, achieved GB/s against the HBM bound, per-kernel times of one decode step; one
JSON out and a short table last (the form the lent-GPU runs record in docs/benchmarks/).

    python scripts/bench_engine.py --synthetic llama3-8b:q4_k_m llama3-8b:q8_0 \\
        --variant fast/split/pdl fast/split staged/single --json out.json

A variant is MATVEC/ATTN[/pdl][/fuse[=A+B..]][/mmq][/gemm|/nogemm][/noprewait][/nopair][/noq6pair][/noagpre][/nonormpre][/noreg][/D=M:V+..][/skip=N][/cl=C][/drop=K]: MATVEC
fast|staged|direct, ATTN grid|split|single, pdl = Hopper programmatic dependent launch, fuse = the fused kernels
(all, or the named ones of cuda_backend.FUSIONS: qkv, ffn, rope, norm, attn, stack, stack8 (opt-in: the
layers in one persistent launch, Q8_0 / Q4_K / Q6_K models, in the backend's default all,stack; stack8: Q8_0
models only); without it, none), mmq = prefill matmuls
on the int8 tensor cores (mmq.cu), gemm / nogemm = prefill matmuls as fp16 cuBLAS GEMMs (dequant.cu) or not
(neither: the backend's default, NTX_CUDA_GEMM), noprewait = the dp4a kernels load no weight before the PDL wait
(-DNTX_PRE_WAIT=0, matvec_fast.cuh), nopair = the decode gate/up kernel streams its two rows one after the other
(-DNTX_SWIGLU_PAIR=0, fused.cu), noq6pair = the Q6_K dp4a decode one unit a lane (-DNTX_Q6_PAIR=0,
matvec_fast.cuh), noagpre = the grid attention issues its first K/V loads after the PDL wait (-DNTX_AG_PRE_WAIT=0,
attn_grid.cu), nonormpre = the fused norm loads its weights after the PDL wait (-DNTX_NORM_PRE_WAIT=0, fused.cu),
noreg = the build without matvec_reg.cu: Q4_K rows in the dp4a kernels' own order, one warp a row
(-DNTX_REG=0, matvec_reg.cuh; cuda_kernels.reg_build reads it too), D=M:V+.. = any tuning macros (-DNTX_M=V
each, e.g. D=FAST_WARPS:8+FAST_MINB:4; cuda_kernels.fast_rows reads NTX_FAST_WARPS too). skip=N (a bit mask: 1 the
fused norm, 2 the grid attention, 4 the activation quantizers, 8 the matvecs) = those kernels return right after their PDL wait
(-DNTX_SKIP=N, ntx_half.cuh): the step's time without that work, to place the step's time; its output is garbage.
cl=C = the grid attention's cluster form, C blocks a KV head (NTX_CUDA_GRID_CLUSTER=C; 0: the grid form).
drop=K (norm, quanti, or norm+quanti) = those launches are left out of the step altogether (NTX_CUDA_DROP): what a
fusion that removes them could gain at most, launch and dependency included; its output is garbage.
--prefill-chunk: tokens per prefill pass. Each (model, variant) is
bench_cuda.run (its docstring says how bytes per token and the bound are counted).
--kernels adds bench_cuda.kernel_table: each decode kernel's own GPU time at 8B shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# drop=A+B: launches left out of the step (cuda_kernels.Kernels reads NTX_CUDA_DROP)
DROP_KINDS = {"norm": ("add_rmsnorm_quanti",), "quanti": ("quanti_q8_1", "quanti_q8_k")}

# variant flags that switch a default of the decode kernels off (the macro, set to 0)
OFF_MACROS = {"noprewait": "-DNTX_PRE_WAIT=", "nopair": "-DNTX_SWIGLU_PAIR=", "noq6pair": "-DNTX_Q6_PAIR=",
              "noagpre": "-DNTX_AG_PRE_WAIT=", "nonormpre": "-DNTX_NORM_PRE_WAIT=", "noreg": "-DNTX_REG="}


def parse_variant(text: str) -> tuple[str, str, bool, str, bool, str | None, tuple[str, ...], tuple[tuple[str, str], ...]]:
    parts = text.split("/")
    flags = set(parts[2:])
    fuse = next((f for f in flags if f == "fuse" or f.startswith("fuse=")), "none")
    flags.discard(fuse)
    fuse = "all" if fuse == "fuse" else fuse.removeprefix("fuse=").replace("+", ",")
    skip = next((f for f in flags if f.startswith("skip=")), None)
    flags.discard(skip)
    cl = next((f for f in flags if f.startswith("cl=")), None)
    flags.discard(cl)
    env = (("NTX_CUDA_GRID_CLUSTER", cl.removeprefix("cl=")),) if cl is not None else ()
    tune = next((f for f in flags if f.startswith("D=")), None)
    flags.discard(tune)
    tuned = tuple(m.split(":") for m in tune.removeprefix("D=").split("+")) if tune is not None else ()
    if any(len(m) != 2 or not m[0].replace("_", "").isalnum() or not m[1].lstrip("-").isdigit() for m in tuned):
        raise argparse.ArgumentTypeError(f"variant {text!r}: D= takes MACRO:INT pairs joined by +, e.g. D=FAST_WARPS:8")
    drop = next((f for f in flags if f.startswith("drop=")), None)
    flags.discard(drop)
    if drop is not None:
        kinds = drop.removeprefix("drop=").split("+")
        if not kinds or not set(kinds) <= set(DROP_KINDS):
            raise argparse.ArgumentTypeError(f"variant {text!r}: drop= takes {'+'.join(DROP_KINDS)} (or some of them)")
        env += (("NTX_CUDA_DROP", ",".join(n for kind in kinds for n in DROP_KINDS[kind])),)
    if skip is not None and not skip.removeprefix("skip=").isdigit():
        raise argparse.ArgumentTypeError(f"variant {text!r}: skip=N takes a bit mask (1 norm, 2 attention, 4 quantizers, 8 matvecs)")
    if len(parts) < 2 or parts[0] not in ("fast", "staged", "direct") or parts[1] not in ("grid", "split", "single") \
            or not flags <= {"pdl", "mmq", "gemm", "nogemm", *OFF_MACROS}:
        raise argparse.ArgumentTypeError(f"variant {text!r}: expected MATVEC/ATTN[/pdl][/fuse[=A+B]][/mmq][/gemm|/nogemm]"
                                         "[/noprewait][/nopair][/noq6pair][/noagpre][/nonormpre][/noreg][/D=M:V+..][/skip=N][/cl=C][/drop=K], e.g. fast/grid/pdl/fuse")
    gemm = "1" if "gemm" in flags else "0" if "nogemm" in flags else None
    defines = tuple(f"{m}0" for f, m in OFF_MACROS.items() if f in flags)
    defines += tuple(f"-DNTX_{m}={v}" for m, v in tuned)
    if skip is not None:
        defines += (f"-DNTX_SKIP={int(skip.removeprefix('skip='))}",)
    return parts[0], parts[1], "pdl" in flags, fuse, "mmq" in flags, gemm, defines, env


VARIANT_MACROS = (*OFF_MACROS.values(), "-DNTX_SKIP=")


def variant_defines(defines: tuple[str, ...]) -> str:
    """NTX_CUDA_DEFINES for a variant: the caller's own, less the macros variants set (and those this
    one sets), plus the variant's (so a variant without noprewait runs the default build even if the
    caller set it)."""
    mine = tuple(d.split("=", 1)[0] + "=" for d in defines)
    own = [d for d in os.environ.get("NTX_CUDA_DEFINES", "").split() if not d.startswith(VARIANT_MACROS + mine)]
    return " ".join(own + list(defines))


def table(results: list[dict], top: int = 8) -> str:
    lines = []
    for r in results:
        lines.append(f"{r['model']} {r['matvec']}/{r['attn']}{'/pdl' if r['pdl'] else ''}{'/fuse=' + '+'.join(r['fuse']) if r['fuse'] else ''}"
                     f"{'/mmq' if r.get('mmq') else ''}{'/gemm' if r.get('gemm') else ''}"
                     f"{''.join(' ' + d for d in r.get('defines', ()))}: "
                     f"decode {r['decode_tok_s_graph']:.1f} tok/s (plain {r['decode_tok_s_plain']:.1f}), "
                     f"{r['achieved_gb_s']:.0f} GB/s = {100 * r['fraction_of_bound']:.1f} % of bound "
                     f"[queued ahead: {r.get('decode_tok_s_stream', float('nan')):.1f} tok/s = "
                     f"{100 * r.get('fraction_of_bound_stream', float('nan')):.1f} %] "
                     f"({r['hbm_bound_tok_s']:.0f} tok/s); prefill {r['prefill_tok_s']:.0f} tok/s; "
                     f"kernels {r['kernel_ms_per_token']:.3f} ms (profiled step {r.get('profiled_step_ms', float('nan')):.3f}) "
                     f"vs graph step {r['decode_ms_per_token_graph']:.3f} ms "
                     f"(back to back on the GPU {r.get('decode_ms_back_to_back', float('nan')):.3f})"
                     + (f" [stack step: {r['stack_source']}]" if r.get("stack_source") else
                        f" [op by op: {r['stack_why_not']}]" if r.get("stack_why_not") else ""))
        for name, v in list(r["kernels"].items())[:top]:
            lines.append(f"    {name:<24} {v['ms']:8.4f} ms  x{v['launches']}")
        if top and "prefill_kernels" in r:
            lines.append(f"  prefill chunk of {r['prefill_chunk']}: {r['prefill_chunk_gpu_ms']:.2f} ms GPU, "
                         f"{r['prefill_outside_kernels_ms']:.2f} ms of it outside ntx kernels (cuBLAS)")
            for name, v in list(r["prefill_kernels"].items())[:top]:
                lines.append(f"    {name:<24} {v['ms']:8.4f} ms  x{v['launches']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import bench_cuda

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", nargs="*", default=[], help="SHAPE:MIX[:LAYERS] ...")
    ap.add_argument("--variant", nargs="+", type=parse_variant, default=[("fast", "split", True, "none", False, None, ())])
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--n-ctx", type=int, default=1024)
    ap.add_argument("--plain", type=int, help="decode tokens without the graph (default: --decode)")
    ap.add_argument("--kernels", action="store_true", help="also time each decode kernel alone (8B shapes)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    results: list = []
    kernels = None
    if a.kernels:
        from ntx_engine.backends.cuda_backend import CudaBackend

        kernels = bench_cuda.kernel_table(CudaBackend())
        print("\n".join(f"    {r['kernel']:<36} {r['us']:8.2f} us  {r['gb_s'] or '':>8} GB/s" for r in kernels))
        if a.json:
            a.json.write_text(json.dumps({"kernels": kernels, "runs": results}, indent=1) + "\n")
    for spec in a.synthetic:
        path = bench_cuda.synthetic_model(spec, a.workdir)
        for matvec, attn, pdl, fuse, mmq, gemm, defines, env in a.variant:
            own = {name: os.environ.get(name) for name in ("NTX_CUDA_DEFINES", *(n for n, _ in env))}
            os.environ["NTX_CUDA_DEFINES"] = variant_defines(defines)  # read when the backend compiles
            os.environ.update(env)  # read when the backend is made
            try:
                results.append(bench_cuda.run(path, a.prompt, a.decode, a.n_ctx, matvec, attn, pdl, fuse, a.plain,
                                              mmq, gemm=gemm, prefill_chunk=a.prefill_chunk))
            finally:
                for name, value in own.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            results[-1]["defines"] = list(defines) + [f"{n}={v}" for n, v in env]
            print(table(results[-1:], top=0), flush=True)
            if a.json:  # after every run, so a time-out still leaves the finished ones
                a.json.write_text(json.dumps({"kernels": kernels, "runs": results}, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
