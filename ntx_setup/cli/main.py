"""`ntx-setup`: prepare this machine for NVMe-to-GPU streaming, and undo it.

Each command is parse -> plan (pure) -> show -> confirm -> apply; heavy work is imported
inside the command bodies so `--help` stays instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from ntx_common.console import err, out, print_json, run_app, status
from ntx_common.errors import SetupError, UsageError
from ntx_common.options import DryRunOpt, JsonOpt, VerboseOpt, YesOpt
from ntx_setup.cli import dkms as dkms_cli
from ntx_setup.cli import grub as grub_cli
from ntx_setup.cli.flow import RootOpt, machine, mutate, start

app = typer.Typer(add_completion=False, rich_markup_mode=None, no_args_is_help=True,
                  help="Prepare this machine for NVMe-to-GPU streaming (guarded, journaled, undoable).")
app.add_typer(grub_cli.app, name="grub")
app.add_typer(dkms_cli.app, name="dkms")


@app.callback()
def _root(ctx: typer.Context, root: RootOpt = None, verbose: VerboseOpt = False) -> None:
    # -v is read by the error boundary (run_app) from argv; declared here so click accepts it.
    ctx.obj = {"root": root}


@app.command()
def check(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """Diagnose this machine: IOMMU, VFIO, hugepages, memory, GPUs, NVMe drives, GRUB, Secure Boot."""
    from ntx_setup.check import collect
    from ntx_setup.cli.render import render_check

    report = collect(machine(ctx))
    if json_out:
        print_json(report)
    else:
        render_check(report)


@app.command()
def report(ctx: typer.Context, out_dir: Annotated[Path, typer.Option("--out", help="Directory for the files.")] = Path("."),
           json_out: JsonOpt = False) -> None:
    """Write the check's facts as ntx-report.json and a self-contained ntx-report.html."""
    from ntx_setup.check import collect
    from ntx_setup.report import write_report

    paths = write_report(collect(machine(ctx)), out_dir)
    if json_out:
        print_json({k: str(v) for k, v in paths.items()})
        return
    for path in paths.values():
        out.print(str(path), markup=False)


@app.command()
def bind(ctx: typer.Context, bdf: Annotated[str, typer.Argument(help="PCI address of the NVMe controller (0000:01:00.0).")],
         noiommu: Annotated[bool, typer.Option("--noiommu", help="Allow vfio's unsafe no-IOMMU mode (no DMA protection).")] = False,
         force: Annotated[bool, typer.Option("--force", help="Bind even though the namespaces carry filesystem/partition signatures.")] = False,
         dry_run: DryRunOpt = False, yes: YesOpt = False, json_out: JsonOpt = False) -> None:
    """Dedicate one NVMe controller to vfio-pci (after every guard passes)."""
    from ntx_setup import vfio
    from ntx_setup.change import apply_change

    m = start(ctx, f"bind {bdf} to vfio-pci", dry_run)
    bp = vfio.plan_bind(m, bdf, noiommu=noiommu, force=force)
    if bp.refusals:
        _refuse(f"bind {bp.device.bdf}", bp.refusals, json_out)
    extra = {"overridden": [r.as_dict() for r in bp.overridden]}
    mutate(m, bp.plan, what=f"bind {bp.device.bdf} to vfio-pci", dry_run=dry_run, yes=yes, json_out=json_out,
           extra=extra, apply=lambda j: apply_change(j, bp.plan, lambda e: vfio.do_bind(m, bp),
                                                     lambda e: vfio.undo_bind(m, e)))


def _refuse(what: str, refusals, json_out: bool) -> None:
    if json_out:
        print_json({"refused": True, "refusals": [r.as_dict() for r in refusals], "applied": False})
    for r in refusals:
        err.print(escape(f"refused ({r.code}): {r.message}\n  fix: {r.fix}"))
    can_force = all(r.overridable for r in refusals)
    raise SetupError(f"{what}: refused for {len(refusals)} reason(s) above"
                     + ("; --force overrides signature refusals" if can_force else ""))


@app.command()
def restore(ctx: typer.Context,
            target: Annotated[Optional[str], typer.Argument(help="A PCI address, or grub / dkms / hugepages.")] = None,
            all_: Annotated[bool, typer.Option("--all", help="Undo every change ntx-setup made.")] = False,
            force: Annotated[bool, typer.Option("--force", help="Overwrite files edited by someone else since.")] = False,
            dry_run: DryRunOpt = False, yes: YesOpt = False, json_out: JsonOpt = False) -> None:
    """Undo journaled changes in reverse order (idempotent; replays after a crash)."""
    from ntx_common.options import confirm_or_refuse
    from ntx_setup import restore as restore_mod
    from ntx_setup.journal import Journal

    if (target is None) == (not all_):
        raise UsageError("restore: give a target (PCI address, grub, dkms, hugepages) or --all, not both")
    m = start(ctx, "restore", dry_run)
    journal = Journal(m.root)
    entries = restore_mod.select(journal, target)
    plan = [f"journal entry {e.id} ({e.state}): {restore_mod.describe(e)}" for e in entries]
    if not json_out:
        for line in plan or ["nothing to restore"]:
            out.print(line, markup=False)
    if not entries or dry_run:
        if json_out:
            print_json({"plan": plan, "restored": [], "dry_run": dry_run})
        return
    confirm_or_refuse(f"undo {len(entries)} change(s)", yes)
    with journal.lock():
        done = restore_mod.restore(m, journal, entries, force)
    if json_out:
        print_json({"plan": plan, "restored": done, "dry_run": False})
    else:
        status(f"restored {len(done)} change(s)")


@app.command("status")
def status_cmd(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """What ntx-setup has changed on this machine right now (journal + live state)."""
    from ntx_setup import restore as restore_mod
    from ntx_setup.journal import Journal

    m = machine(ctx)
    rows = restore_mod.status(m, Journal(m.root))
    if json_out:
        print_json({"changes": rows})
        return
    for r in rows or [None]:
        line = "no active changes: this machine is as ntx-setup found it" if r is None else \
            f"#{r['id']} {r['kind']} {r['target']} [{r['state']}] now: {r['live']}; restore would {r['undo']}"
        out.print(line, markup=False)


@app.command()
def hugepages(ctx: typer.Context, count: Annotated[int, typer.Argument(help="Number of pages in the pool.")],
              size: Annotated[str, typer.Option("--size", help="2M or 1G.")] = "2M",
              node: Annotated[Optional[int], typer.Option("--node", help="NUMA node (default: system-wide).")] = None,
              dry_run: DryRunOpt = False, yes: YesOpt = False, json_out: JsonOpt = False) -> None:
    """Size a hugepage pool (journaled; `restore hugepages` gives the pages back)."""
    from ntx_setup import hugepages as hp
    from ntx_setup.change import apply_change

    m = start(ctx, "resize a hugepage pool", dry_run)
    plan = hp.plan_hugepages(m, count, size, node)
    mutate(m, plan, what=f"set {plan.target} to {count} pages", dry_run=dry_run, yes=yes, json_out=json_out,
           apply=lambda j: apply_change(j, plan, lambda e: hp.do_hugepages(m, plan), lambda e: hp.undo_hugepages(m, e)))


@app.command()
def memlock(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """How much memory this user may pin (RLIMIT_MEMLOCK) and how to raise it."""
    from ntx_setup.check import memlock_advice

    advice = memlock_advice(machine(ctx))
    if json_out:
        print_json(advice)
    else:
        out.print("\n".join(advice["lines"]), markup=False)


def main(argv: list[str] | None = None) -> None:
    run_app(app, argv)
