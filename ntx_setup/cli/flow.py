"""The shape every mutating command shares: plan -> show -> (dry run) -> confirm -> journal+apply.

Imports stay light: typer, rich and the ntx_setup modules that read files; nothing here
touches CUDA or the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.markup import escape

from ntx_common.console import out, print_json, status
from ntx_common.options import confirm_or_refuse
from ntx_setup.change import Plan
from ntx_setup.journal import Entry, Journal
from ntx_setup.machine import Machine

RootOpt = Annotated[Optional[Path], typer.Option(
    "--root", metavar="DIR", hidden=True,
    help="Testing aid: read and write /sys, /proc, /etc, /dev, /run, /var/lib under DIR instead of /; "
         "programs (modprobe, update-grub, dkms) are never run with it.")]


def machine(ctx: typer.Context) -> Machine:
    obj = ctx.find_root().obj or {}
    return Machine.from_root(obj.get("root"))


def start(ctx: typer.Context, what: str, dry_run: bool) -> Machine:
    """The machine for a mutating command, after the root check (skipped for --dry-run)."""
    m = machine(ctx)
    if not dry_run:
        m.require_root(what)
    return m


def show_plan(plan: Plan) -> None:
    out.print(f"plan: {plan.kind} {plan.target}", markup=False)
    for i, step in enumerate(plan.steps, 1):
        out.print(f"  {i}. {step}", markup=False)
    if plan.diff:
        out.print(plan.diff.rstrip("\n"), markup=False, highlight=False)
    for note in plan.notes:
        out.print(f"note: {note}", markup=False)


def mutate(m: Machine, plan: Plan, *, what: str, dry_run: bool, yes: bool, json_out: bool,
           apply: Callable[[Journal], Entry], extra: dict | None = None) -> Entry | None:
    """Show `plan`; stop on --dry-run or a no-op; otherwise confirm, lock the journal and apply."""
    report = {"plan": plan.as_dict(), "dry_run": dry_run, "applied": False} | (extra or {})
    if not json_out:
        show_plan(plan)
    if plan.noop or dry_run:
        if json_out:
            print_json(report)
        elif dry_run and not plan.noop:
            status("dry run: nothing was changed")
        return None
    confirm_or_refuse(what, yes)
    journal = Journal(m.root)
    with journal.lock():
        entry = apply(journal)
    if json_out:
        print_json(report | {"applied": True, "entry": entry.as_dict()})
    else:
        status(escape(f"done: {what} (journal entry {entry.id}; undo with `ntx-setup restore`)"))
    return entry
