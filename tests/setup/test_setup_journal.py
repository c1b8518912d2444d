"""The journal's atomic writes, and crash recovery: a process killed between journal write and
change, or between change and "done", leaves a state that `restore` repairs."""

import json
import os

import pytest

from ntx_common.errors import SetupError
from ntx_setup.journal import Entry, Journal, write_atomic

from test_setup_bind import BDF, DEV, driver
from test_setup_grub import GRUB


def test_write_atomic_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"old")
    write_atomic(p, b"new contents", 0o640)
    assert p.read_bytes() == b"new contents" and oct(p.stat().st_mode & 0o777) == "0o640"
    assert os.listdir(tmp_path) == ["f"]


def test_entries_roundtrip_and_validation(fr):
    j = Journal(fr.base)
    a = j.begin("bind", BDF, {"driver": "nvme"})
    b = j.begin("grub", "/etc/default/grub", {})
    j.finish(a, {"driver": "vfio-pci"})
    assert [(e.id, e.state) for e in j.entries()] == [(1, "done"), (2, "pending")]
    assert json.loads((j.dir / "000001.json").read_text())["after"] == {"driver": "vfio-pci"}
    assert oct(j.dir.stat().st_mode & 0o777) == "0o700"
    j.mark(b, "restored")
    assert [e.id for e in j.active()] == [1]
    with pytest.raises(ValueError):
        Entry(1, "reboot", "x", "done")
    with pytest.raises(ValueError):
        Entry(1, "bind", "x", "half-done")


def test_corrupt_entry_is_reported_with_its_path(fr):
    j = Journal(fr.base)
    j.begin("bind", BDF, {})
    (j.dir / "000001.json").write_text("{ torn")
    with pytest.raises(SetupError, match="000001.json is unreadable"):
        j.entries()


def test_second_writer_is_locked_out(fr):
    j = Journal(fr.base)
    with j.lock():
        with pytest.raises(SetupError, match="another ntx-setup"):
            Journal(fr.base).lock()


def crash_in_child(cli, monkeypatch, point, args):
    """Run `ntx-setup args` in a forked child killed (os._exit, no cleanup, no rollback - like
    kill -9 or a power cut) either right after the journal entry is written (`after-journal`)
    or after the change but before the entry is marked done (`before-done`)."""
    pid = os.fork()
    if pid == 0:
        try:
            if point == "after-journal":
                begin = Journal.begin
                monkeypatch.setattr(Journal, "begin", lambda self, *a: (begin(self, *a), os._exit(137)))
            else:
                monkeypatch.setattr(Journal, "finish", lambda self, entry, after: os._exit(137))
            cli(*args)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 137, "the child did not reach the crash point"


@pytest.fixture
def nvme(fr):
    fr.add_nvme(BDF, group="1")


@pytest.mark.parametrize("point,driver_after_crash", [("after-journal", "nvme"), ("before-done", "vfio-pci")])
def test_bind_crash_is_repaired_by_restore(cli, fr, nvme, monkeypatch, point, driver_after_crash):
    crash_in_child(cli, monkeypatch, point, ["bind", BDF, "--yes"])
    assert [e.state for e in Journal(fr.base).entries()] == ["pending"]
    assert driver(fr) == driver_after_crash
    assert "[pending]" in cli("status").stdout
    r = cli("restore", BDF, "--yes")
    assert r.exit_code == 0, r.stderr
    assert driver(fr) == "nvme" and fr.p("/dev/nvme0n1").exists()
    assert fr.read(f"{DEV}/driver_override") == "(null)" and fr.read(f"{DEV}/power/control") == "auto"
    assert [e.state for e in Journal(fr.base).entries()] == ["restored"]
    assert cli("restore", "--all", "--yes").stdout.strip() == "nothing to restore"


@pytest.mark.parametrize("point", ["after-journal", "before-done"])
def test_grub_crash_is_repaired_byte_identically(cli, fr, kernel, monkeypatch, point):
    fr.write("/etc/default/grub", GRUB)
    fr.write("/usr/sbin/update-grub", "")
    os.chmod(fr.p("/usr/sbin/update-grub"), 0o755)
    crash_in_child(cli, monkeypatch, point, ["grub", "enable-iommu", "--yes"])
    changed = "intel_iommu=on" in fr.p("/etc/default/grub").read_text()
    assert changed == (point == "before-done")
    assert [e.state for e in Journal(fr.base).entries()] == ["pending"]
    assert cli("restore", "--all", "--yes").exit_code == 0
    assert fr.p("/etc/default/grub").read_bytes() == GRUB.encode()
    assert kernel.commands == ([["update-grub"]] if changed else [])   # grub.cfg regenerated only if touched
    assert cli("restore", "--all", "--yes").stdout.strip() == "nothing to restore"
