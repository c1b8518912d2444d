"""The journal: one JSON file per change under `<root>/var/lib/ntx/journal/`.

An entry is written *before* its change (state `pending`, with everything needed to undo it)
and rewritten after (`done`). Each write is atomic: a temporary file in the same directory,
fsync'd, renamed over the old one, then the directory is fsync'd. A crash therefore leaves
either the old or the new entry, never a torn one, and `restore` can replay from it.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ntx_common.errors import SetupError
from ntx_setup.sysfs import under

STATE_DIR = "/var/lib/ntx"
STATES = ("pending", "done", "rolled-back", "restored")
ACTIVE = ("pending", "done")
KINDS = ("bind", "grub", "dkms", "hugepages")
_NAME_RE = re.compile(r"^(\d{6})\.json$")


@dataclass(frozen=True)
class Entry:
    id: int
    kind: str
    target: str
    state: str
    before: dict = field(default_factory=dict)   # the state to go back to
    after: dict = field(default_factory=dict)    # what the change produced (for verification)
    created: str = ""
    updated: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"journal entry kind {self.kind!r} not one of {KINDS}")
        if self.state not in STATES:
            raise ValueError(f"journal entry state {self.state!r} not one of {STATES}")

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def as_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "target": self.target, "state": self.state,
                "before": self.before, "after": self.after, "created": self.created, "updated": self.updated}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace `path` with `data` so that a crash leaves the old or the new bytes, fsync'd."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class Journal:
    def __init__(self, root: Path):
        self.state_dir = under(root, STATE_DIR)
        self.dir = self.state_dir / "journal"
        self.backups = self.state_dir / "backups"

    def _ensure(self) -> None:
        for d in (self.state_dir, self.dir, self.backups):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)

    def lock(self):
        """An exclusive lock for one mutating command (two at once would interleave undo records)."""
        self._ensure()
        fd = os.open(self.state_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SetupError(f"another ntx-setup is changing this machine (lock {self.state_dir / 'lock'})") from None
        return os.fdopen(fd)

    def entries(self) -> list[Entry]:
        found = []
        for name in sorted(os.listdir(self.dir)) if self.dir.is_dir() else []:
            if _NAME_RE.match(name):
                found.append(self._load(self.dir / name))
        return found

    def active(self) -> list[Entry]:
        return [e for e in self.entries() if e.active]

    def _load(self, path: Path) -> Entry:
        try:
            raw = json.loads(path.read_text())
            return Entry(**raw)
        except (OSError, ValueError, TypeError) as exc:
            raise SetupError(f"journal entry {path} is unreadable ({exc}); inspect it by hand") from exc

    def _store(self, entry: Entry) -> Entry:
        self._ensure()
        data = json.dumps(entry.as_dict(), indent=2, sort_keys=True).encode() + b"\n"
        write_atomic(self.dir / f"{entry.id:06d}.json", data)
        return entry

    def begin(self, kind: str, target: str, before: dict) -> Entry:
        """Record a change about to happen (state `pending`) and return its entry."""
        existing = self.entries()
        next_id = (existing[-1].id + 1) if existing else 1
        now = _now()
        return self._store(Entry(next_id, kind, target, "pending", before, {}, now, now))

    def finish(self, entry: Entry, after: dict) -> Entry:
        return self._store(replace(entry, state="done", after=after, updated=_now()))

    def mark(self, entry: Entry, state: str) -> Entry:
        return self._store(replace(entry, state=state, updated=_now()))

    def backup(self, entry_id: int, label: str, data: bytes) -> Path:
        """Keep original bytes next to the journal (fsync'd) before a file is edited."""
        self._ensure()
        path = self.backups / f"{entry_id:06d}-{label}"
        write_atomic(path, data)
        return path
