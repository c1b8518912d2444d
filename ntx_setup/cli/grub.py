"""`ntx-setup grub ...`: kernel parameters in /etc/default/grub (backup, diff, update-grub, undo)."""

from __future__ import annotations

from typing import Annotated

import typer

from ntx_common.options import DryRunOpt, JsonOpt, YesOpt
from ntx_setup.cli.flow import mutate, start

app = typer.Typer(add_completion=False, rich_markup_mode=None, no_args_is_help=True,
                  help="Edit kernel parameters in /etc/default/grub (shows a diff; a reboot applies them).")
Params = Annotated[list[str], typer.Argument(help="Kernel parameters, e.g. iommu=pt.")]


def _edit(ctx: typer.Context, action: str, params: list[str], dry_run: bool, yes: bool, json_out: bool) -> None:
    from ntx_setup import grub
    from ntx_setup.change import apply_change

    m = start(ctx, f"grub {action}", dry_run)
    plan, new = grub.plan_grub(m, action, params)
    old = m.path(grub.GRUB_FILE).read_bytes()
    mutate(m, plan, what=f"edit {grub.GRUB_FILE} ({action})", dry_run=dry_run, yes=yes, json_out=json_out,
           apply=lambda j: apply_change(j, plan, lambda e: grub.do_grub(m, j, e, old, new),
                                        lambda e: grub.undo_grub(m, j, e)))
    if not dry_run and not plan.noop and not json_out:
        typer.echo("reboot to use the new kernel command line", err=True)


@app.command("enable-iommu")
def enable_iommu(ctx: typer.Context, dry_run: DryRunOpt = False, yes: YesOpt = False, json_out: JsonOpt = False) -> None:
    """Add intel_iommu=on iommu=pt (Intel) or amd_iommu=on iommu=pt (AMD)."""
    _edit(ctx, "enable-iommu", [], dry_run, yes, json_out)


@app.command("disable-iommu")
def disable_iommu(ctx: typer.Context, dry_run: DryRunOpt = False, yes: YesOpt = False, json_out: JsonOpt = False) -> None:
    """Turn the IOMMU off (intel_iommu=off / amd_iommu=off) for the no-IOMMU path."""
    _edit(ctx, "disable-iommu", [], dry_run, yes, json_out)


@app.command()
def add(ctx: typer.Context, params: Params, dry_run: DryRunOpt = False, yes: YesOpt = False, json_out: JsonOpt = False) -> None:
    """Add (or change the value of) kernel parameters."""
    _edit(ctx, "add", params, dry_run, yes, json_out)


@app.command()
def remove(ctx: typer.Context, params: Params, dry_run: DryRunOpt = False, yes: YesOpt = False, json_out: JsonOpt = False) -> None:
    """Remove kernel parameters (a bare key removes every key=value)."""
    _edit(ctx, "remove", params, dry_run, yes, json_out)
