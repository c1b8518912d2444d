"""`ntx-setup bind` / `restore` / `status` on a fake machine, through the real CLI entry point."""

import json
import os

import pytest

from ntx_setup.journal import Journal
from ntx_setup.pci import ConfigSpace

BDF = "0000:01:00.0"
DEV = f"/sys/devices/pci0000:00/{BDF}"


def driver(fr, bdf=BDF):
    link = fr.p(f"{DEV[:-len(BDF)]}{bdf}/driver")
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


@pytest.fixture
def nvme(fr):
    fr.add_nvme(BDF, group="1")
    data = os.urandom(4096)
    fr.dev_write("nvme0n1", data, offset=1 << 20)   # data past the first 72 KiB: no signature
    return data


def test_dry_run_shows_plan_and_changes_nothing(cli, fr, kernel, nvme):
    r = cli("bind", BDF, "--dry-run")
    assert r.exit_code == 0, r.output + r.stderr
    assert "driver_override" in r.stdout and "drivers_probe" in r.stdout and "modprobe vfio-pci" in r.stdout
    assert "dry run" in r.stderr
    assert kernel.writes == [] and kernel.commands == [] and driver(fr) == "nvme"
    assert Journal(fr.base).entries() == []


def test_refuses_without_yes_when_no_tty(cli, fr, kernel, nvme):
    r = cli("bind", BDF)
    assert r.exit_code == 2 and "without --yes" in r.stderr
    assert kernel.writes == [] and driver(fr) == "nvme"


def test_needs_root(cli, fr, kernel, nvme):
    cli.euid = 1000
    for args in (["bind", BDF, "--yes"], ["restore", "--all", "--yes"], ["grub", "enable-iommu", "--yes"],
                 ["dkms", "patch", "--yes"], ["hugepages", "8", "--yes"]):
        r = cli(*args)
        assert r.exit_code == 1, args
        assert "needs root" in r.stderr and "sudo" in r.stderr and "uid 1000" in r.stderr, args
    assert kernel.writes == [] and kernel.commands == []
    assert cli("bind", BDF, "--dry-run").exit_code == 0     # looking is fine without root


def test_bind_then_restore_round_trip(cli, fr, kernel, nvme):
    r = cli("bind", BDF, "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["applied"] and doc["entry"]["state"] == "done" and doc["entry"]["before"]["driver"] == "nvme"
    assert doc["entry"]["before"]["namespaces"] == ["nvme0n1"]
    assert driver(fr) == "vfio-pci" and fr.p("/dev/vfio/1").exists() and not fr.p("/dev/nvme0n1").exists()
    assert doc["entry"]["after"]["vfio"] == "/dev/vfio/1"
    cfg = ConfigSpace(fr.base, BDF)
    assert cfg.power_state() == "D0" and cfg.command() & 0x6 == 0x6   # fake vfio-pci parked it in D3hot
    assert fr.read(f"{DEV}/power/control") == "on"
    assert ["modprobe", "vfio-pci"] in kernel.commands
    written = [p.rsplit("/", 1)[-1] for p, _ in kernel.writes]
    assert written == ["driver_override", "unbind", "drivers_probe", "control"]
    assert not any("new_id" in p for p, _ in kernel.writes)

    r = cli("status", "--json")
    [row] = json.loads(r.stdout)["changes"]
    assert row["kind"] == "bind" and row["live"] == "driver vfio-pci, override vfio-pci"

    r = cli("restore", BDF, "--yes")
    assert r.exit_code == 0, r.stderr
    assert driver(fr) == "nvme" and fr.read(f"{DEV}/driver_override") == "(null)"
    assert fr.read(f"{DEV}/power/control") == "auto"
    with open(fr.p("/dev/nvme0n1"), "rb") as f:
        f.seek(1 << 20)
        assert f.read(4096) == nvme
    assert [e.state for e in Journal(fr.base).entries()] == ["restored"]
    assert "no active changes" in cli("status").stdout


def test_every_command_twice_changes_nothing_the_second_time(cli, fr, kernel, nvme):
    assert cli("bind", BDF, "--yes").exit_code == 0
    writes, commands = len(kernel.writes), len(kernel.commands)
    r = cli("bind", BDF, "--yes")
    assert r.exit_code == 0 and "already bound" in r.stdout
    assert (len(kernel.writes), len(kernel.commands)) == (writes, commands)
    assert len(Journal(fr.base).entries()) == 1
    assert cli("restore", "--all", "--yes").exit_code == 0
    writes = len(kernel.writes)
    r = cli("restore", "--all", "--yes")
    assert r.exit_code == 0 and "nothing to restore" in r.stdout and len(kernel.writes) == writes


@pytest.mark.parametrize("setup,code", [
    (lambda fr: (fr.add_partition("nvme0n1", "nvme0n1p1"), fr.add_mount("/dev/nvme0n1p1", "/mnt/data")), "mounted"),
    (lambda fr: (fr.add_partition("nvme0n1", "nvme0n1p1"), fr.add_mount("/dev/nvme0n1p1", "/")), "boot-disk"),
    (lambda fr: fr.add_swap("/dev/nvme0n1"), "swap"),
    (lambda fr: fr.add_holder("nvme0n1", "dm-0", dm_uuid="CRYPT-LUKS2-abc"), "holder"),
    (lambda fr: fr.add_opener(777, "fio", "nvme0n1"), "open"),
    (lambda fr: fr.add_pci("0000:01:00.1", vendor=0x10DE, device=0x2684, class_code=0x030000, driver="nvidia",
                           group="1"), "iommu-group"),
])
def test_guards_refuse_and_touch_nothing(cli, fr, kernel, nvme, setup, code):
    setup(fr)
    r = cli("bind", BDF, "--yes", "--force")     # --force must not override these
    assert r.exit_code == 1
    assert f"refused ({code})" in r.stderr and "fix:" in r.stderr
    assert kernel.writes == [] and kernel.commands == [] and driver(fr) == "nvme"
    assert Journal(fr.base).entries() == []


def test_not_nvme_refused(cli, fr, kernel):
    fr.add_pci("0000:03:00.0", vendor=0x10DE, device=0x2684, class_code=0x030000, driver="nvidia", group="3")
    r = cli("bind", "0000:03:00.0", "--yes", "--json")
    assert r.exit_code == 1 and "refused (not-nvme)" in r.stderr
    assert json.loads(r.stdout)["refusals"][0]["code"] == "not-nvme"
    assert kernel.writes == []


def test_signature_refused_unless_force(cli, fr, kernel, nvme):
    fr.dev_write("nvme0n1", b"LUKS\xba\xbe\x00\x02")
    r = cli("bind", BDF, "--yes")
    assert r.exit_code == 1 and "refused (signature)" in r.stderr and "crypto_LUKS" in r.stderr
    assert "--force overrides" in r.stderr and driver(fr) == "nvme"
    r = cli("bind", BDF, "--yes", "--force", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["overridden"][0]["code"] == "signature"
    assert driver(fr) == "vfio-pci"


def test_noiommu_needs_the_flag_and_warns(cli, fr, kernel):
    kernel.noiommu_supported = True
    fr.add_nvme(BDF, group=None)
    r = cli("bind", BDF, "--yes")
    assert r.exit_code == 1 and "refused (noiommu)" in r.stderr
    r = cli("bind", BDF, "--yes", "--noiommu")
    assert r.exit_code == 0, r.stderr
    assert "unchecked" in r.stdout or "DMA anywhere" in r.stdout
    assert ["modprobe", "vfio", "enable_unsafe_noiommu_mode=1"] in kernel.commands
    assert driver(fr) == "vfio-pci"
    assert any(p.name.startswith("noiommu-") for p in fr.p("/dev/vfio").iterdir())
    assert cli("restore", "--all", "--yes").exit_code == 0
    assert driver(fr) == "nvme"
    assert fr.read("/sys/module/vfio/parameters/enable_unsafe_noiommu_mode") == "N"


def test_noiommu_without_kernel_support_rolls_back(cli, fr, kernel):
    fr.add_nvme(BDF, group=None)                  # kernel.noiommu_supported is False
    r = cli("bind", BDF, "--yes", "--noiommu")
    assert r.exit_code == 1 and "CONFIG_VFIO_NOIOMMU" in r.stderr
    assert driver(fr) == "nvme"
    [e] = Journal(fr.base).entries()
    assert e.state == "rolled-back"


def test_noiommu_flag_with_iommu_on_is_a_usage_error(cli, fr, nvme):
    r = cli("bind", BDF, "--noiommu", "--yes")
    assert r.exit_code == 2 and "drop --noiommu" in r.stderr


def test_failure_mid_bind_rolls_back(cli, fr, kernel, nvme):
    def fail_probe(path, text):
        if path == "/sys/bus/pci/drivers_probe" and "vfio-pci" in fr.read(f"{DEV}/driver_override"):
            raise OSError(22, "Invalid argument")
    kernel.before_write = fail_probe
    r = cli("bind", BDF, "--yes")
    assert r.exit_code == 1 and "drivers_probe" in r.stderr
    assert driver(fr) == "nvme" and fr.p("/dev/nvme0n1").exists()
    assert fr.read(f"{DEV}/driver_override") == "(null)"
    assert [e.state for e in Journal(fr.base).entries()] == ["rolled-back"]


def test_restore_target_matching(cli, fr, nvme):
    assert cli("bind", BDF, "--yes").exit_code == 0
    r = cli("restore", "0000:09:00.0", "--yes")
    assert r.exit_code == 0 and "nothing to restore" in r.stdout and driver(fr) == "vfio-pci"
    assert cli("restore", "01:00.0", "--yes").exit_code == 0      # short BDF form
    assert driver(fr) == "nvme"
    assert cli("restore").exit_code == 2                          # neither target nor --all


def test_restore_refuses_while_a_process_holds_the_vfio_group(cli, fr, nvme):
    assert cli("bind", BDF, "--yes").exit_code == 0
    fr.write("/proc/999/comm", "ntx-run")
    fr.p("/proc/999/fd").mkdir(parents=True)
    fr.p("/proc/999/fd/5").symlink_to("/dev/vfio/1")
    r = cli("restore", "--all", "--yes")
    assert r.exit_code == 1 and "in use through /dev/vfio/1 by process 999 (ntx-run)" in r.stderr
    assert driver(fr) == "vfio-pci" and [e.state for e in Journal(fr.base).entries()] == ["done"]
    fr.p("/proc/999/fd/5").unlink()
    assert cli("restore", "--all", "--yes").exit_code == 0 and driver(fr) == "nvme"


def test_setup_imports_neither_io_nor_engine_and_help_is_light():
    """ntx-setup must work when CUDA/the engine are broken, and --help must not pull heavy modules."""
    import subprocess
    import sys

    code = ("import sys\n"
            "sys.modules['ntx_io'] = None; sys.modules['ntx_engine'] = None\n"
            "import ntx_setup.cli\n"
            "light = not {'psutil', 'pyudev', 'ntx_setup.check', 'ntx_setup.guards'} & set(sys.modules)\n"
            "import pkgutil, importlib, ntx_setup\n"
            "for mod in pkgutil.walk_packages(ntx_setup.__path__, 'ntx_setup.'):\n"
            "    importlib.import_module(mod.name)\n"
            "print('light' if light else 'heavy')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "light"
