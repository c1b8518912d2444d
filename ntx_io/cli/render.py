"""Human-readable output of `ntx-io` (results on stdout, progress on stderr).

Strings that come from devices or image headers are untrusted: they go through `escape`
and are printed without markup.
"""

from __future__ import annotations

from contextlib import contextmanager

from rich.markup import escape
from rich.table import Table

from ntx_common.console import err, out


@contextmanager
def progress_bar(label: str, total: int):
    """A rich progress bar on stderr; yields advance(nbytes)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(escape(label), total=total)
        yield lambda n: bar.advance(task, n)


def render_identity(ident) -> None:
    table = Table(show_header=False, box=None)
    for key, value in ident.as_dict().items():
        table.add_row(key, escape(str(value)))
    out.print(table)


def render_plan(plan) -> None:
    err.print(escape(f"stage {plan.model.name} ({plan.model_bytes} bytes) -> {plan.target}"), markup=False)
    err.print(escape(plan.overwrite), markup=False)


def render_refusals(refusals, force: bool) -> None:
    for r in refusals:
        state = "overridden by --force" if force and r.overridable else "refused"
        err.print(f"{state} ({r.code}): {r.message}\n  fix: {r.fix}", markup=False)


def render_header(header) -> None:
    d = header.as_dict()
    out.print(f"staged {d['source_name']!r}: {d['source_size']} bytes at byte {d['data_offset']} "
              f"(LBA {d['first_data_lba']} of {d['lba_bytes']} bytes), sha256 {d['sha256']}", markup=False)


def render_verify(report, why: str) -> None:
    err.print(f"reader: {why}", markup=False)
    h = report.header
    out.print(f"image: {h.source_name!r}, {h.source_size} bytes at byte {h.data_offset}", markup=False)
    out.print(f"{report.mode}: {report.ranges} range(s), {report.bytes_checked} bytes compared", markup=False)
    for offset, length in report.mismatches[:20]:
        out.print(f"  MISMATCH bytes {offset}..{offset + length} of the GGUF", markup=False)
    for problem in report.problems:
        out.print(f"  PROBLEM {problem}", markup=False)
    out.print("OK" if report.ok else "FAILED", markup=False)


def render_bench(report) -> None:
    table = Table("reader", "GB/s", "bytes", "seconds", "why", box=None)
    for r in report.reads:
        table.add_row(r.reader, f"{r.gbps:.2f}", str(r.nbytes), f"{r.seconds:.2f}", escape(r.reason))
    for streams, gbps in report.dd.items():
        shown = "n/a" if gbps is None else f"{gbps:.2f}"
        table.add_row(f"dd iflag=direct x{streams}", shown, "", "", "the disk's own figure")
    if report.kvikio_gbps is not None:
        table.add_row("kvikio (compat)", f"{report.kvikio_gbps:.2f}", "", "", "into GPU memory")
    out.print(table)
    h2d = report.h2d
    if h2d and h2d.get("available"):
        out.print(f"H2D from registered pinned buffer: {h2d['registered_gbps']} GB/s; cudaMemcpy from "
                  f"cuMemAllocHost: {h2d['cuda_pinned_gbps']} GB/s ({h2d['ratio']:.0%})", markup=False)
    elif h2d:
        out.print(f"H2D: not measured ({h2d['reason']})", markup=False)
    for note in report.notes:
        err.print(note, markup=False)
