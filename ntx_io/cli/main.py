"""`ntx-io`: move model bytes from storage into page-locked host memory.

Each command is parse -> plan (pure) -> show -> confirm -> apply; the heavy modules are
imported inside the command bodies so `--help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ntx_common.console import print_json, run_app
from ntx_common.errors import NtxIOError, UsageError
from ntx_common.options import DryRunOpt, JsonOpt, VerboseOpt, YesOpt

app = typer.Typer(add_completion=False, rich_markup_mode=None, no_args_is_help=True,
                  help="Storage -> pinned host memory: userspace NVMe over VFIO, O_DIRECT, mmap; model images.")

ReaderOpt = Annotated[str, typer.Option("--reader", help="auto | vfio | direct | mmap.")]
NoIommuOpt = Annotated[bool, typer.Option("--noiommu", help="VFIO without an IOMMU: DMA to physical "
                                          "addresses (unprotected; needs hugepages). Never chosen by itself.")]
DeviceOpt = Annotated[str, typer.Option("--device", "-d", help="Block device or image file, or vfio:<PCI address>.")]


@app.callback()
def _main(verbose: VerboseOpt = False) -> None:
    """Storage -> pinned host memory."""


@app.command()
def identify(bdf: Annotated[str, typer.Argument(help="PCI address of an NVMe controller on vfio-pci.")],
             noiommu: NoIommuOpt = False, json_out: JsonOpt = False) -> None:
    """Bring up an NVMe controller through VFIO and show what it reports (reads nothing)."""
    from ntx_io.cli.render import render_identity
    from ntx_io.nvme import NvmeDevice

    with NvmeDevice.open(bdf, iommu=not noiommu) as dev:
        ident = dev.identify()
    print_json(ident.as_dict()) if json_out else render_identity(ident)


@app.command()
def stage(model: Annotated[Path, typer.Argument(help="The GGUF file.")],
          device: Annotated[Path, typer.Option("--device", "-d", help="Target block device or image file.")],
          force: Annotated[bool, typer.Option("--force", help="Write over a filesystem/partition signature.")] = False,
          dry_run: DryRunOpt = False, yes: YesOpt = False, json_out: JsonOpt = False) -> None:
    """Write MODEL to a raw device behind an ntx header (after the same guards as `ntx-setup bind`)."""
    from ntx_common.options import confirm_or_refuse
    from ntx_io.cli.render import progress_bar, render_header, render_plan, render_refusals
    from ntx_io.stage import apply_stage, plan_stage

    plan = plan_stage(model, device)
    render_plan(plan)
    render_refusals(plan.refusals, force)
    blocking = plan.blocking(force)
    if blocking or dry_run:
        if json_out:
            print_json({**plan.as_dict(), "applied": False, "refused": bool(blocking)})
        if blocking:
            hint = "; --force overrides signature refusals" if all(r.overridable for r in blocking) else ""
            raise NtxIOError(f"stage onto {plan.target}: refused for {len(blocking)} reason(s) above{hint}")
        return
    confirm_or_refuse(f"overwrite {plan.target} with {plan.model.name}", yes)
    with progress_bar(f"staging {plan.model.name}", plan.model_bytes) as advance:
        header = apply_stage(plan, force, advance)
    print_json({**plan.as_dict(), "applied": True, "header": header.as_dict()}) if json_out else render_header(header)


@app.command()
def verify(model: Annotated[Optional[Path], typer.Argument(help="The GGUF file that was staged.")] = None,
           device: DeviceOpt = "", reader: ReaderOpt = "auto", noiommu: NoIommuOpt = False,
           full: Annotated[bool, typer.Option("--full", help="Hash every byte (default: sampled ranges).")] = False,
           samples: Annotated[int, typer.Option(min=2, help="Ranges to compare in sampled mode.")] = 64,
           seed: Annotated[int, typer.Option(help="Seed of the sampled ranges.")] = 0,
           json_out: JsonOpt = False) -> None:
    """Check a staged image: its header, then its bytes against MODEL (sampled or --full)."""
    from ntx_io.cli.render import progress_bar, render_verify
    from ntx_io.reader import open_reader
    from ntx_io.verify import verify_image

    if not device:
        raise UsageError("verify needs --device (a block device, an image file or vfio:<PCI address>)")
    rd, why = open_reader(device, reader, iommu=not noiommu)
    try:
        with progress_bar("verifying", 0) as advance:
            report = verify_image(rd, model, full=full, samples=samples, seed=seed, progress=advance)
    finally:
        rd.close()
    print_json({**report.as_dict(), "reader": rd.name, "reason": why}) if json_out else render_verify(report, why)
    if not report.ok:
        raise NtxIOError(f"{report.source}: verification failed "
                         f"({len(report.mismatches)} mismatching range(s), {len(report.problems)} problem(s))")


@app.command()
def bench(source: Annotated[Optional[str], typer.Argument(help="File, block device or vfio:<PCI address>; "
                                                          "default: a scratch file in --dir.")] = None,
          reader: Annotated[list[str], typer.Option("--reader", help="Reader(s) to measure (repeat); default all.")] = [],
          size: Annotated[str, typer.Option(help="Bytes to read, e.g. 1G.")] = "1G",
          chunk: Annotated[str, typer.Option(help="Request size.")] = "8M",
          inflight: Annotated[int, typer.Option(min=1, help="Requests in flight.")] = 8,
          dd_streams: Annotated[int, typer.Option("--dd-streams", min=1, help="Parallel dd streams for the second dd figure.")] = 8,
          workdir: Annotated[Path, typer.Option("--dir", help="Where the scratch file goes.")] = Path("."),
          h2d: Annotated[bool, typer.Option("--h2d/--no-h2d", help="Measure H2D from pinned buffers (GPU only).")] = True,
          compare_kvikio: Annotated[bool, typer.Option("--compare-kvikio", help="Also time kvikio's compat mode, if importable.")] = False,
          noiommu: NoIommuOpt = False,
          keep: Annotated[bool, typer.Option("--keep", help="Keep the scratch file.")] = False,
          json_out: JsonOpt = False) -> None:
    """Sequential read bandwidth per reader vs `dd iflag=direct`, and H2D from pinned buffers."""
    from ntx_io.bench import BenchPlan, parse_size, run_bench
    from ntx_io.cli.render import progress_bar, render_bench

    try:
        plan = BenchPlan(source, tuple(reader), parse_size(size), workdir, parse_size(chunk), inflight,
                         dd_streams, h2d, compare_kvikio, not noiommu, keep)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    report = run_bench(plan, progress_bar)
    print_json(report.as_dict()) if json_out else render_bench(report)


def main() -> None:
    run_app(app)
