"""The machine ntx-setup acts on: a root directory plus the two ways it changes the system.

Reads go straight to files under `root`. Changes that make the kernel *do* something (a write
to a sysfs attribute such as `driver/unbind`, running `modprobe` or `update-grub`) go through
`host`, so tests substitute a fake kernel for exactly those two operations and the rest of the
code runs unchanged against a fake tree, and against the real sysfs in the VM.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from ntx_common.errors import PermissionNeeded, SetupError
from ntx_setup.sysfs import under

TOOL_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


class Host(Protocol):
    def write(self, path: Path, text: str) -> None: ...

    def run(self, argv: list[str], timeout: float) -> tuple[int, str]: ...


class RealHost:
    """The running kernel and its programs."""

    def write(self, path: Path, text: str) -> None:
        # One write() call: sysfs attributes take the whole value in a single store.
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def run(self, argv: list[str], timeout: float) -> tuple[int, str]:
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        except FileNotFoundError:
            return 127, f"{argv[0]}: not found"
        except subprocess.TimeoutExpired:
            return 124, f"{argv[0]}: still running after {timeout:.0f} s, killed"
        return proc.returncode, (proc.stdout + proc.stderr).strip()


class TreeHost(RealHost):
    """`--root DIR`: attribute writes land in the tree; programs are never run on the real machine."""

    def __init__(self, root: Path):
        self.root = root

    def run(self, argv: list[str], timeout: float) -> tuple[int, str]:
        raise SetupError(f"--root {self.root}: refusing to run `{shlex.join(argv)}` on the real machine "
                         "(it would act outside the tree); drop --root to really apply this")


@dataclass(frozen=True)
class Machine:
    root: Path = Path("/")
    host: Host = field(default_factory=RealHost)
    euid: int = field(default_factory=os.geteuid)
    sleep: Callable[[float], None] = time.sleep

    @classmethod
    def from_root(cls, root: Path | None) -> "Machine":
        """The CLI's one way to get a machine (tests replace this to inject a fake kernel)."""
        if root is None or str(root) == "/":
            return cls()
        root = Path(root).resolve()
        if not root.is_dir():
            raise SetupError(f"--root {root}: not a directory")
        return cls(root=root, host=TreeHost(root))

    @property
    def is_fake(self) -> bool:
        return str(self.root) != "/"

    def path(self, path: str) -> Path:
        return under(self.root, path)

    def require_root(self, what: str) -> None:
        if self.euid != 0:
            raise PermissionNeeded(f"{what} needs root (running as uid {self.euid}); rerun with sudo, "
                                   "or add --dry-run to only see the plan")

    def tool(self, *names: str) -> str | None:
        """In-machine path of the first of `names` found in the usual bin directories."""
        for name in names:
            for d in TOOL_DIRS:
                p = self.path(f"{d}/{name}")
                if p.is_file() and os.access(p, os.X_OK):
                    return f"{d}/{name}"
        return None

    def run(self, argv: list[str], timeout: float = 600) -> str:
        rc, output = self.host.run(argv, timeout)
        if rc != 0:
            tail = "\n".join(output.splitlines()[-15:])
            raise SetupError(f"`{shlex.join(argv)}` failed with exit status {rc}:\n{tail}")
        return output

    def write(self, path: Path, text: str) -> None:
        try:
            self.host.write(path, text)
        except OSError as exc:
            raise SetupError(f"writing {text.strip()!r} to {path} failed: {exc.strerror or exc}") from exc

    def wait_for(self, check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise SetupError(f"timed out after {timeout:g} s waiting for {what}")
            self.sleep(0.05)
