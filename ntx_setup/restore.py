"""Undo journaled changes in reverse order; what ntx has changed right now.

Every undo works from the journal entry alone and is idempotent, so `restore` after a crash
(an entry left `pending`, the change half-made or not made at all) converges to the original
state, and a second `restore` finds nothing to do.
"""

from __future__ import annotations

from ntx_common.errors import SetupError
from ntx_setup import dkms, filechange, grub, hugepages, vfio
from ntx_setup.journal import Entry, Journal
from ntx_setup.machine import Machine
from ntx_setup.sysfs import normalize_bdf


def undo(m: Machine, journal: Journal, entry: Entry, force: bool = False) -> None:
    if entry.kind == "bind":
        vfio.undo_bind(m, entry)
    elif entry.kind == "grub":
        grub.undo_grub(m, journal, entry, force)
    elif entry.kind == "dkms":
        dkms.undo_patch(m, journal, entry, force)
    elif entry.kind == "hugepages":
        hugepages.undo_hugepages(m, entry)
    else:  # Entry validates kinds; a new kind without an undo is a bug
        raise SetupError(f"journal entry {entry.id}: no undo for kind {entry.kind!r}")


def _matches(entry: Entry, target: str) -> bool:
    try:
        target = normalize_bdf(target)
    except ValueError:
        pass
    return target in (entry.target, entry.kind)


def select(journal: Journal, target: str | None) -> list[Entry]:
    """Active entries to undo, newest first; `target` is a BDF, a journal target or a kind."""
    entries = [e for e in journal.active() if target is None or _matches(e, target)]
    return sorted(entries, key=lambda e: e.id, reverse=True)


def describe(entry: Entry) -> str:
    b = entry.before
    if entry.kind == "bind":
        return f"give {entry.target} back to {b.get('driver') or 'no driver'} (now on vfio-pci)"
    if entry.kind == "hugepages":
        return f"set {b['path']} back to {b['nr']}"
    return f"restore {b['path']} byte-identically from the backup" + (" and rebuild with dkms" if entry.kind == "dkms" else "")


def restore(m: Machine, journal: Journal, entries: list[Entry], force: bool = False) -> list[dict]:
    done = []
    for entry in entries:
        try:
            undo(m, journal, entry, force)
        except SetupError as exc:
            left = ", ".join(str(e.id) for e in entries[len(done):])
            raise SetupError(f"restoring journal entry {entry.id} ({entry.kind} {entry.target}) failed: {exc}\n"
                             f"entries still active: {left}; fix the cause and run restore again") from exc
        journal.mark(entry, "restored")
        done.append({"id": entry.id, "kind": entry.kind, "target": entry.target, "was": entry.state})
    return done


def live_state(m: Machine, entry: Entry) -> str:
    try:
        if entry.kind == "bind":
            return vfio.live_state(m, entry)
        if entry.kind == "hugepages":
            return hugepages.live_state(m, entry)
        return filechange.file_state(m, entry)
    except (OSError, KeyError) as exc:
        return f"unknown ({exc})"


def status(m: Machine, journal: Journal) -> list[dict]:
    return [entry.as_dict() | {"live": live_state(m, entry), "undo": describe(entry)} for entry in journal.active()]
