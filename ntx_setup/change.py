"""Journal → change → verify → done, with roll-back on failure.

Every mutating command funnels through `apply_change`, so the order "journal entry fsync'd
before the change, marked done after it was verified" holds everywhere. The undo function
is the same one `restore` uses; it must be idempotent and work from the entry alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ntx_common.errors import SetupError
from ntx_setup.journal import Entry, Journal


@dataclass(frozen=True)
class Plan:
    """What a mutating command is about to do, shown before anything happens."""

    kind: str
    target: str
    steps: list[str] = field(default_factory=list)
    diff: str = ""
    notes: list[str] = field(default_factory=list)
    before: dict = field(default_factory=dict)

    @property
    def noop(self) -> bool:
        return not self.steps

    def as_dict(self) -> dict:
        return {"kind": self.kind, "target": self.target, "steps": self.steps, "diff": self.diff,
                "notes": self.notes, "noop": self.noop}


def apply_change(journal: Journal, plan: Plan, do: Callable[[Entry], dict],
                 undo: Callable[[Entry], None]) -> Entry:
    """Journal `plan`, run `do` (which changes and verifies), roll back through `undo` on failure."""
    entry = journal.begin(plan.kind, plan.target, plan.before)
    try:
        after = do(entry)
    except BaseException as exc:  # Ctrl-C mid-change must roll back too
        try:
            undo(entry)
        except Exception as undo_exc:
            raise SetupError(
                f"{plan.kind} {plan.target} failed ({exc}) and rolling it back failed too ({undo_exc}); "
                f"journal entry {entry.id} is kept: fix the cause and run `ntx-setup restore --all`") from exc
        journal.mark(entry, "rolled-back")
        raise
    return journal.finish(entry, after)
