"""Byte-exact edits of one configuration file, shared by `grub` and `dkms`.

The journal entry records the original's sha256 and mode, the planned result's sha256 and the
backup's path. Undo writes the backup's bytes back only when the file still holds either the
original or ntx's version; anything else means somebody edited it since, and is refused.
"""

from __future__ import annotations

import difflib
import hashlib
import os

from ntx_common.errors import SetupError
from ntx_setup.journal import Entry, Journal, write_atomic
from ntx_setup.machine import Machine


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def unified_diff(path: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a{path}", f"b{path}"))


def before_record(m: Machine, path: str, old: bytes, new: bytes, label: str) -> dict:
    return {"path": path, "sha256": sha256(old), "new_sha256": sha256(new), "label": label,
            "mode": os.stat(m.path(path)).st_mode & 0o7777}


def write_new(m: Machine, journal: Journal, entry: Entry, old: bytes, new: bytes) -> None:
    """Back up the original (fsync'd), then replace the file atomically, keeping its mode."""
    b = entry.before
    journal.backup(entry.id, b["label"], old)
    if sha256(m.path(b["path"]).read_bytes()) != b["sha256"]:
        raise SetupError(f"{b['path']} changed while ntx-setup was working on it; nothing was written")
    write_atomic(m.path(b["path"]), new, b["mode"])


def restore_original(m: Machine, journal: Journal, entry: Entry, force: bool = False) -> bool:
    """Put the original bytes back; True when the file had to be rewritten."""
    b = entry.before
    current = sha256(m.path(b["path"]).read_bytes())
    if current == b["sha256"]:
        return False
    backup = journal.backups / f"{entry.id:06d}-{b['label']}"
    if current != b["new_sha256"] and not force:
        raise SetupError(f"{b['path']} was changed after ntx-setup edited it; not overwriting it. The original is "
                         f"in {backup}: copy it back by hand, or rerun restore with --force")
    try:
        data = backup.read_bytes()
    except OSError as exc:
        raise SetupError(f"backup {backup} of {b['path']} is missing ({exc.strerror}); restore the file by hand") from exc
    if sha256(data) != b["sha256"]:
        raise SetupError(f"backup {backup} does not match the journaled checksum; restore {b['path']} by hand")
    write_atomic(m.path(b["path"]), data, b["mode"])
    if sha256(m.path(b["path"]).read_bytes()) != b["sha256"]:
        raise SetupError(f"{b['path']} does not read back as the original after restoring it from {backup}")
    return True


def file_state(m: Machine, entry: Entry) -> str:
    b = entry.before
    try:
        current = sha256(m.path(b["path"]).read_bytes())
    except OSError:
        return f"{b['path']} missing"
    if current == b.get("new_sha256"):
        return f"{b['path']} holds ntx's edit"
    return f"{b['path']} is the original" if current == b["sha256"] else f"{b['path']} changed by someone else since"
