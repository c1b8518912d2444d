"""Run one shell command as root in a throw-away QEMU guest with an emulated NVMe.

The guest boots Debian's kernel (TCG, one vCPU) from the assets `make vm-assets` builds under
`assets_dir()`, optionally behind an emulated VT-d IOMMU, binds the NVMe to vfio-pci if asked,
and runs the command in a chroot of the host's `/` (shared read-only over 9p) in the repo root,
so the repo's `.venv/bin/python` and the code under test run unchanged. See scripts/vm/init for
the guest side; tests/vm/conftest.py for the fixtures.

Inside the guest the command sees:
  NTX_VM_BDF    the NVMe's PCI address (always)
  NTX_VM_VFIO   its /dev/vfio node (only when bound: /dev/vfio/<group> or /dev/vfio/noiommu-<group>)
  NTX_VM_OUT    a directory shared read-write with the host (same path on both sides)
  NTX_VM_MODE   iommu | noiommu | none
  writable: /tmp, /run, /var/tmp, /dev/shm (tmpfs), /dev/hugepages (hugetlbfs), $NTX_VM_OUT;
  everything else is the host's read-only /. `modprobe vfio-pci` works (the guest kernel's
  module tree is bind-mounted over /lib/modules).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INIT = REPO / "scripts" / "vm" / "init"
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
NVME_SERIAL = "ntxvm0001"
MODES = ("iommu", "noiommu", "none")
GUEST_PATH = f"{REPO}/.venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOW_TO_BUILD = "run `make vm-assets` (scripts/vm/install_host.sh, then scripts/vm/build_assets.sh)"
TAIL_CHARS = 4000


class VmUnavailable(Exception):
    """A piece the VM needs is missing on this host; the message says which and how to get it."""


class GuestError(RuntimeError):
    """The guest booted but could not run the command (init failed, QEMU refused to start...)."""


@dataclass(frozen=True)
class GuestResult:
    returncode: int  # exit status of the guest command
    output: str  # the guest command's stdout+stderr
    console: str  # the whole serial console log (kernel + init), for debugging
    wall_s: float  # host wall time of the whole QEMU run, boot included
    out_dir: Path  # host side of $NTX_VM_OUT


def assets_dir() -> Path:
    """Where build_assets.sh puts its output: $NTX_VM_CACHE or ~/.cache/ntx/vm."""
    return Path(os.environ.get("NTX_VM_CACHE") or Path.home() / ".cache" / "ntx" / "vm")


def ensure_assets(noiommu: bool = False) -> Path:
    """Check (never build) everything a boot needs; return the kernel's asset dir."""
    if shutil.which("qemu-system-x86_64") is None:
        raise VmUnavailable(f"qemu-system-x86_64 is not installed: {HOW_TO_BUILD}")
    if not Path("/lib/modules").is_dir():
        raise VmUnavailable(f"/lib/modules is missing on the host (the guest mounts its modules there): {HOW_TO_BUILD}")
    if not VENV_PYTHON.exists():
        raise VmUnavailable(f"{VENV_PYTHON} is missing (the guest runs it): run `make .venv/.test`")
    current = assets_dir() / "current"
    if not current.is_file():
        raise VmUnavailable(f"no VM assets in {assets_dir()}: {HOW_TO_BUILD}")
    kdir = assets_dir() / current.read_text().strip()
    needed = ["vmlinux", "initramfs.cpio.gz"] + (["vfio-noiommu.ko"] if noiommu else [])
    for name in needed:
        if not (kdir / name).is_file():
            raise VmUnavailable(f"{kdir / name} is missing: {HOW_TO_BUILD}")
    if _initramfs_info(kdir).get("init_sha256") != _sha256(INIT):
        raise VmUnavailable(f"{kdir}/initramfs.cpio.gz was built from another {INIT}: {HOW_TO_BUILD}")
    return kdir


def _initramfs_info(kdir: Path) -> dict[str, str]:
    try:
        lines = (kdir / "initramfs.info").read_text().splitlines()
    except FileNotFoundError:
        return {}
    return dict(line.split("=", 1) for line in lines if "=" in line)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def compile_python() -> None:
    """Byte-compile the venv and the repo once per process.

    The guest sees them read-only: a missing or stale .pyc would be recompiled under emulation
    on every import, every boot. Files that do not compile (a colleague's half-written module)
    are left to fail in the test that imports them.
    """
    skip = r"/\.git/|/\.venv/|/build/|/\.hypothesis/|/\.pytest_cache/"
    for target, extra in ((REPO / ".venv" / "lib", []), (REPO, ["-x", skip])):
        subprocess.run([str(VENV_PYTHON), "-m", "compileall", "-q", "-j", "0", *extra, str(target)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def make_disk(path: Path, size_mb: int = 64) -> Path:
    """Create a sparse raw file to back the guest's NVMe namespace."""
    if size_mb <= 0:
        raise ValueError(f"disk size must be positive, got {size_mb} MiB")
    with open(path, "wb") as f:
        f.truncate(size_mb << 20)
    return Path(path)


def run_guest(command: str, *, disk: Path, mode: str = "iommu", bind_vfio: bool = True,
              mem_mb: int = 512, timeout: float = 300, env: dict[str, str] | None = None,
              out_dir: Path | None = None) -> GuestResult:
    """Boot a guest, run `command` (sh) as root in the repo root, power off, return the result.

    out_dir: the host dir shared as $NTX_VM_OUT; when None, a fresh temp dir that lives until
    this process exits. Raises VmUnavailable (assets missing), TimeoutError (guest still up after `timeout`
    s; QEMU is killed) and GuestError (the command could not be started).
    """
    disk = _check_args(mode, bind_vfio, Path(disk), mem_mb, timeout, env or {})
    kdir = ensure_assets(noiommu=mode == "noiommu")
    compile_python()
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(dir=_out_root().name))
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ntx-vm-") as tmp:
        job = Path(tmp) / "job"
        job.mkdir()
        _write_job(job, command, mode, out, env or {})
        console = Path(tmp) / "console.log"
        argv = _qemu_argv(kdir, disk, job, out, console, mode, bind_vfio, mem_mb)
        wall, qemu_log = _boot(argv, console, job, timeout)
        return _collect(job, console, qemu_log, wall, out)


@functools.cache
def _out_root() -> tempfile.TemporaryDirectory:
    """Parent of the default out dirs; the cache holds it, its finalizer removes it at exit."""
    return tempfile.TemporaryDirectory(prefix="ntx-vm-out-")


def _check_args(mode: str, bind_vfio: bool, disk: Path, mem_mb: int, timeout: float,
                env: dict[str, str]) -> Path:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "none" and bind_vfio:
        raise ValueError("mode='none' has neither an IOMMU nor no-IOMMU vfio: vfio-pci cannot bind; "
                         "pass bind_vfio=False")
    if not disk.is_file():
        raise ValueError(f"disk {disk} is not a file (make one with make_disk())")
    size = disk.stat().st_size
    if size == 0 or size % 512:
        raise ValueError(f"disk {disk} is {size} bytes; the emulated NVMe needs a non-zero multiple of 512")
    if mem_mb < 256:
        raise ValueError(f"mem_mb={mem_mb}: the guest needs at least 256 MiB")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    bad = [k for k in env if not k.isidentifier()]
    if bad:
        raise ValueError(f"env names must be shell identifiers: {bad}")
    return disk.resolve()


def _write_job(job: Path, command: str, mode: str, out: Path, env: dict[str, str]) -> None:
    (job / "config").write_text(f"OUT={shlex.quote(str(out))}\nREPO={shlex.quote(str(REPO))}\n")
    exports = {"PATH": GUEST_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "NTX_VM": "1", "NTX_VM_MODE": mode,
               "NTX_VM_OUT": str(out), "NTX_VM_NVME_SERIAL": NVME_SERIAL, **env}
    lines = [f"export {k}={shlex.quote(v)}" for k, v in exports.items()]
    script = "\n".join([f"cd {shlex.quote(str(REPO))} || exit 125", *lines, command, ""])
    (job / "run.sh").write_text(script)


def _qemu_opt(path: Path) -> str:
    return str(path).replace(",", ",,")  # QEMU option values escape commas by doubling


def _qemu_argv(kdir: Path, disk: Path, job: Path, out: Path, console: Path, mode: str,
               bind_vfio: bool, mem_mb: int) -> list[str]:
    append = f"console=ttyS0 quiet loglevel=4 panic=-1 ntx.mode={mode} ntx.bind={int(bind_vfio)}"
    iommu: list[str] = []
    if mode == "iommu":
        # must precede the PCI devices it translates
        iommu = ["-device", "intel-iommu,intremap=on,caching-mode=on"]
        append += " intel_iommu=on"
    else:
        append += " intel_iommu=off"
    share = "security_model=none,multidevs=remap"
    return [
        "qemu-system-x86_64", "-nodefaults", "-no-user-config", "-display", "none",
        "-monitor", "none", "-no-reboot",
        # /dev/kvm is unusable on our hosts; one vCPU is faster than two on a 2-core host.
        "-machine", "q35", "-accel", "tcg", "-cpu", "max", "-smp", "1", "-m", str(mem_mb),
        *iommu,
        "-kernel", str(kdir / "vmlinux"), "-initrd", str(kdir / "initramfs.cpio.gz"),
        "-append", append, "-serial", f"file:{_qemu_opt(console)}",
        "-drive", f"file={_qemu_opt(disk)},if=none,id=nvm,format=raw,cache=writeback,aio=threads",
        "-device", f"nvme,serial={NVME_SERIAL},drive=nvm",
        "-virtfs", f"local,path=/,mount_tag=hostroot,readonly=on,{share}",
        "-virtfs", f"local,path={_qemu_opt(job)},mount_tag=ntxjob,{share}",
        "-virtfs", f"local,path={_qemu_opt(out)},mount_tag=ntxout,{share}",
        # the repo again, mounted at its own path after the guest's tmpfs mounts (a CI clone may live in /tmp)
        "-virtfs", f"local,path={_qemu_opt(REPO)},mount_tag=ntxrepo,readonly=on,{share}",
    ]


def _boot(argv: list[str], console: Path, job: Path, timeout: float) -> tuple[float, str]:
    """Run QEMU to completion; return (wall seconds, QEMU's own stdout+stderr)."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as qlog:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=qlog, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"guest still running after {timeout:g} s; QEMU killed.\n"
                               f"--- console tail ---\n{_tail(console)}\n"
                               f"--- command output tail ---\n{_tail(job / 'output')}") from None
        finally:  # also on KeyboardInterrupt or a pytest-timeout: never leave a QEMU behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        qlog.seek(0)
        return time.monotonic() - t0, qlog.read().decode(errors="replace")


def _tail(path: Path) -> str:
    return _read(path)[-TAIL_CHARS:]


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return ""


def _collect(job: Path, console: Path, qemu_log: str, wall: float, out: Path) -> GuestResult:
    log = _read(console)
    fatal = _read(job / "fatal").strip()
    if fatal:
        raise GuestError(f"guest init failed: {fatal}\n--- console tail ---\n{log[-TAIL_CHARS:]}")
    rc = _read(job / "rc").strip()
    if not rc.lstrip("-").isdigit():
        raise GuestError(f"guest stopped without running the command (no exit status, wall {wall:.1f} s)\n--- qemu ---\n"
                         f"{qemu_log[-TAIL_CHARS:]}\n--- console tail ---\n{log[-TAIL_CHARS:]}"
                         f"\n--- command output tail ---\n{_tail(job / 'output')}")
    return GuestResult(returncode=int(rc), output=_read(job / "output"), console=log,
                       wall_s=wall, out_dir=out)


def main(argv: list[str] | None = None) -> int:
    """Debugging aid: python -m tests.vm.harness [--mode M] [--no-bind] [--disk F] 'command'."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m tests.vm.harness", description=main.__doc__)
    ap.add_argument("command")
    ap.add_argument("--mode", choices=MODES, default="iommu")
    ap.add_argument("--no-bind", action="store_true", help="leave the NVMe on the nvme driver")
    ap.add_argument("--disk", type=Path, help="backing file (default: a fresh sparse 64 MiB one)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", type=Path, help="host dir shared as $NTX_VM_OUT (default: a new, kept temp dir)")
    ap.add_argument("--console", action="store_true", help="also print the serial console")
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="ntx-vm-out-"))
    with tempfile.TemporaryDirectory(prefix="ntx-vm-disk-") as tmp:
        disk = args.disk or make_disk(Path(tmp) / "nvme.img")
        try:
            result = run_guest(args.command, disk=disk, mode=args.mode, bind_vfio=not args.no_bind,
                               timeout=args.timeout, out_dir=out)
        except (VmUnavailable, GuestError, TimeoutError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.console:
        sys.stderr.write(result.console)
    sys.stdout.write(result.output)
    print(f"[guest exit {result.returncode}, {result.wall_s:.1f} s, out dir {result.out_dir}]", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())
