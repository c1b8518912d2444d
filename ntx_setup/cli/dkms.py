"""`ntx-setup dkms ...`: the NVIDIA open kernel module's os-mlock.c patch (status, patch, revert)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ntx_common.console import out, print_json
from ntx_common.options import DryRunOpt, JsonOpt, YesOpt
from ntx_setup.cli.flow import machine, mutate, start

app = typer.Typer(add_completion=False, rich_markup_mode=None, no_args_is_help=True,
                  help="Patch the NVIDIA open kernel module (DKMS) so cudaHostRegister can map an NVMe BAR on kernels >= 6.12.")
VersionOpt = Annotated[Optional[str], typer.Option("--version", help="Driver version, when several are under DKMS.")]


@app.command()
def status(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """NVIDIA modules under DKMS: version, open or proprietary, os-mlock.c layout, patched or not."""
    from ntx_setup.dkms import find_modules

    mods = [x.as_dict() for x in find_modules(machine(ctx))]
    if json_out:
        print_json({"modules": mods})
        return
    for x in mods or [None]:
        out.print("no NVIDIA module under DKMS (/var/lib/dkms/nvidia*)" if x is None else
                  f"{x['name']}/{x['version']}: {x['flavor']} module, os-mlock.c {x['os_mlock'] or 'missing'}, "
                  f"{'patched' if x['patched'] else 'layout ' + (x['layout'] or 'unknown (cannot patch)')}", markup=False)


@app.command()
def patch(ctx: typer.Context, version: VersionOpt = None, dry_run: DryRunOpt = False, yes: YesOpt = False,
          json_out: JsonOpt = False) -> None:
    """Back up os-mlock.c, patch nv_follow_pfn(), rebuild and install with dkms, verify."""
    from ntx_setup import dkms
    from ntx_setup.change import apply_change

    m = start(ctx, "dkms patch", dry_run)
    plan, old, new = dkms.plan_patch(m, version)
    mutate(m, plan, what=f"patch and rebuild {plan.target}", dry_run=dry_run, yes=yes, json_out=json_out,
           apply=lambda j: apply_change(j, plan, lambda e: dkms.do_patch(m, j, e, old, new),
                                        lambda e: dkms.undo_patch(m, j, e)))


@app.command()
def revert(ctx: typer.Context, dry_run: DryRunOpt = False, yes: YesOpt = False, json_out: JsonOpt = False) -> None:
    """Restore the original os-mlock.c bytes and rebuild (same as `ntx-setup restore dkms`)."""
    from ntx_setup.cli.main import restore

    restore(ctx, target="dkms", all_=False, force=False, dry_run=dry_run, yes=yes, json_out=json_out)
