"""Options shared by every ntx CLI, defined once (`--json`, `--yes`, `--dry-run`, `-v`)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from ntx_common.errors import UsageError

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one machine-readable JSON object on stdout.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Apply without asking (required when stdin is not a TTY).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Show the exact plan/diff and change nothing.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Show tracebacks and debug detail.")]


def confirm_or_refuse(what: str, yes: bool, *, stdin_isatty: bool | None = None) -> None:
    """Mutating commands: ask on a TTY, refuse without `--yes` when there is none."""
    if yes:
        return
    tty = sys.stdin.isatty() if stdin_isatty is None else stdin_isatty
    if not tty:
        raise UsageError(f"refusing to {what} without --yes: stdin is not a terminal")
    if not typer.confirm(f"{what}?", default=False, err=True):
        raise UsageError(f"not confirmed: {what}")
