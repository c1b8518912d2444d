"""Dedicating one NVMe controller to vfio-pci, and giving it back.

Binding uses `driver_override` + `unbind` + `drivers_probe`, never `new_id` (which would also
grab every identical drive). The original driver, override and runtime-PM setting are
journaled first; `undo` puts them back and waits for the namespaces to reappear.
"""

from __future__ import annotations

from dataclasses import dataclass

from ntx_common.errors import SetupError, UsageError
from ntx_setup import block, pci
from ntx_setup.change import Plan
from ntx_setup.guards import Refusal, controller_refusals
from ntx_setup.journal import Entry
from ntx_setup.machine import Machine
from ntx_setup.sysfs import normalize_bdf, read_text

VFIO_DRIVER = "vfio-pci"
NOIOMMU_PARAM = "/sys/module/vfio/parameters/enable_unsafe_noiommu_mode"
NOIOMMU_WARNING = ("no-IOMMU mode: the device can DMA anywhere in RAM and the kernel is tainted; "
                   "a bug in the userspace driver can corrupt memory. Use it only on a machine without a usable IOMMU.")


@dataclass(frozen=True)
class BindPlan:
    plan: Plan
    device: pci.PciDevice
    refusals: list[Refusal]       # blocking: bind is refused while any remain
    overridden: list[Refusal]     # signatures --force chose to ignore
    noiommu: bool


def _dev_path(bdf: str, attr: str = "") -> str:
    return f"/sys/bus/pci/devices/{bdf}" + (f"/{attr}" if attr else "")


def plan_bind(m: Machine, bdf: str, *, noiommu: bool = False, force: bool = False) -> BindPlan:
    try:
        bdf = normalize_bdf(bdf)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    dev = pci.read_device(m.root, bdf)
    if dev is None:
        raise SetupError(f"no PCI device {bdf} (not in /sys/bus/pci/devices); list NVMe controllers with `ntx-setup check`")
    if dev.driver == VFIO_DRIVER:
        return BindPlan(Plan("bind", bdf, notes=[f"{bdf} is already bound to vfio-pci: nothing to do"]),
                        dev, [], [], noiommu)
    refusals = controller_refusals(bdf, m.root)
    iommu_off = any(r.code == "noiommu" for r in refusals)
    if noiommu and not iommu_off:
        raise UsageError(f"--noiommu given but {bdf} has IOMMU group {dev.iommu_group}: the IOMMU is on; drop --noiommu")
    if noiommu:
        refusals = [r for r in refusals if r.code != "noiommu"] + _noiommu_support(m)
    blocking = [r for r in refusals if not (force and r.overridable)]
    overridden = [r for r in refusals if force and r.overridable]
    before = {"bdf": bdf, "driver": dev.driver, "driver_override": dev.driver_override,
              "power_control": read_text(m.path(_dev_path(bdf, "power/control"))),
              "namespaces": block.namespaces_of(m.root, bdf), "noiommu": noiommu,
              "noiommu_param": read_text(m.path(NOIOMMU_PARAM))}
    notes = [NOIOMMU_WARNING] if noiommu else []
    notes += [f"--force: ignoring {r.message}" for r in overridden]
    return BindPlan(Plan("bind", bdf, _steps(m, dev, noiommu), notes=notes, before=before),
                    dev, blocking, overridden, noiommu)


def _noiommu_support(m: Machine) -> list[Refusal]:
    """vfio's no-IOMMU mode exists only with CONFIG_VFIO_NOIOMMU (off in Debian's kernel)."""
    loaded = m.path("/sys/module/vfio").is_dir()
    if loaded and not m.path(NOIOMMU_PARAM).exists():
        return [Refusal("noiommu", "the loaded vfio module has no enable_unsafe_noiommu_mode parameter "
                        "(kernel built without CONFIG_VFIO_NOIOMMU)",
                        "use a kernel with CONFIG_VFIO_NOIOMMU=y, or enable the IOMMU instead", False)]
    return []


def _steps(m: Machine, dev: pci.PciDevice, noiommu: bool) -> list[str]:
    d = _dev_path(dev.bdf)
    steps = []
    if noiommu:
        steps.append(f"enable vfio no-IOMMU mode (modprobe vfio enable_unsafe_noiommu_mode=1 / write 1 to {NOIOMMU_PARAM})")
    if not m.path("/sys/bus/pci/drivers/vfio-pci").is_dir():
        steps.append("modprobe vfio-pci")
    steps.append(f"echo vfio-pci > {d}/driver_override")
    if dev.driver:
        steps.append(f"echo {dev.bdf} > {d}/driver/unbind   (detach from {dev.driver})")
    steps += [f"echo {dev.bdf} > /sys/bus/pci/drivers_probe",
              f"echo on > {d}/power/control   (keep it out of runtime suspend)",
              "PCI power management capability: PowerState -> D0",
              "PCI command register: set Memory Space + Bus Master",
              "verify /dev/vfio/<group> exists"]
    return steps


def do_bind(m: Machine, bp: BindPlan) -> dict:
    """Apply a bind plan; returns the verified result for the journal."""
    bdf = bp.device.bdf
    if bp.noiommu:
        _enable_noiommu(m)
    if not m.path("/sys/bus/pci/drivers/vfio-pci").is_dir():
        m.run(["modprobe", "vfio-pci"], timeout=60)
        m.wait_for(lambda: m.path("/sys/bus/pci/drivers/vfio-pci").is_dir(), "the vfio-pci driver to register")
    m.write(m.path(_dev_path(bdf, "driver_override")), VFIO_DRIVER)
    if pci.read_device(m.root, bdf).driver:
        m.write(m.path(_dev_path(bdf, "driver/unbind")), bdf)
    m.write(m.path("/sys/bus/pci/drivers_probe"), bdf)
    m.wait_for(lambda: pci.read_device(m.root, bdf).driver == VFIO_DRIVER, f"{bdf} to bind to vfio-pci", 20)
    return _power_up(m, bdf) | {"vfio": str(_wait_vfio_node(m, bdf))}


def _enable_noiommu(m: Machine) -> None:
    if not m.path("/sys/module/vfio").is_dir():
        m.run(["modprobe", "vfio", "enable_unsafe_noiommu_mode=1"], timeout=60)
    elif read_text(m.path(NOIOMMU_PARAM)) != "Y":
        m.write(m.path(NOIOMMU_PARAM), "1")
    if read_text(m.path(NOIOMMU_PARAM)) != "Y":
        raise SetupError(f"vfio no-IOMMU mode did not turn on ({NOIOMMU_PARAM} is "
                         f"{read_text(m.path(NOIOMMU_PARAM), 'missing')}); the kernel needs CONFIG_VFIO_NOIOMMU")


def _power_up(m: Machine, bdf: str) -> dict:
    control = m.path(_dev_path(bdf, "power/control"))
    if control.exists() and read_text(control) != "on":
        m.write(control, "on")
    cfg = pci.ConfigSpace(m.root, bdf)
    try:
        if cfg.set_d0():
            m.sleep(0.01)  # PCI PM 1.2 §5.6.1: 10 ms recovery after D3hot -> D0
        cfg.enable_memory_and_bus_master()
        state, command = cfg.power_state(), cfg.command()
    except OSError as exc:
        raise SetupError(f"{bdf}: PCI config space access failed: {exc}") from exc
    if state not in (None, "D0"):
        raise SetupError(f"{bdf} stayed in {state} after requesting D0")
    want = pci.CMD_MEMORY_SPACE | pci.CMD_BUS_MASTER
    if command & want != want:
        raise SetupError(f"{bdf}: command register 0x{command:04x} lacks Memory Space/Bus Master after enabling them")
    return {"driver": VFIO_DRIVER, "power_state": state or "no PM capability", "command": f"0x{command:04x}"}


def _wait_vfio_node(m: Machine, bdf: str):
    def node():
        return pci.vfio_node(m.root, pci.read_device(m.root, bdf).iommu_group)

    m.wait_for(lambda: node() is not None, f"/dev/vfio/<group> of {bdf}", timeout=5)
    return "/" + str(node().relative_to(m.root)) if m.is_fake else node()


def undo_bind(m: Machine, entry: Entry) -> None:
    """Give the controller back to its original driver; idempotent, works after a crash."""
    b = entry.before
    bdf, orig = b["bdf"], b.get("driver")
    dev = pci.read_device(m.root, bdf)
    if dev is None:
        raise SetupError(f"{bdf} is gone from /sys/bus/pci/devices; rescan (echo 1 > /sys/bus/pci/rescan) and retry")
    if dev.driver_override != b.get("driver_override"):
        m.write(m.path(_dev_path(bdf, "driver_override")), b.get("driver_override") or "\n")
    if dev.driver != orig:
        if dev.driver == VFIO_DRIVER:
            _refuse_if_in_use(m, dev)
        if dev.driver:
            m.write(m.path(_dev_path(bdf, "driver/unbind")), bdf)
        if orig:
            m.write(m.path("/sys/bus/pci/drivers_probe"), bdf)
            m.wait_for(lambda: pci.read_device(m.root, bdf).driver == orig, f"{bdf} to rebind to {orig}", 30)
    control = m.path(_dev_path(bdf, "power/control"))
    if b.get("power_control") and control.exists() and read_text(control) != b["power_control"]:
        m.write(control, b["power_control"])
    # Not loaded before (None) or off: either way no-IOMMU mode was not on before we came.
    if b.get("noiommu") and b.get("noiommu_param") in (None, "N") and read_text(m.path(NOIOMMU_PARAM)) == "Y":
        m.write(m.path(NOIOMMU_PARAM), "0")
    _wait_namespaces(m, bdf, len(b.get("namespaces") or []))


def _refuse_if_in_use(m: Machine, dev: pci.PciDevice) -> None:
    """Unbinding vfio-pci while a process holds the group blocks in the kernel until it lets go."""
    if dev.iommu_group is None:
        return
    users = block.openers(m.root, [f"vfio/{dev.iommu_group}", f"vfio/noiommu-{dev.iommu_group}"])
    if users:
        who = ", ".join(f"{pid} ({comm})" for pid, comm, _ in users)
        raise SetupError(f"{dev.bdf} is in use through {users[0][2]} by process {who}: unbinding it now would "
                         "block until that process exits; stop it first, then run restore again")


def _wait_namespaces(m: Machine, bdf: str, count: int) -> None:
    def back() -> bool:
        names = block.namespaces_of(m.root, bdf)
        return len(names) >= count and all(m.path(f"/dev/{n}").exists() for n in names)

    m.wait_for(back, f"{count} namespace block device(s) of {bdf} to reappear", timeout=60)


def live_state(m: Machine, entry: Entry) -> str:
    dev = pci.read_device(m.root, entry.target)
    if dev is None:
        return "device missing"
    return f"driver {dev.driver or 'none'}" + (f", override {dev.driver_override}" if dev.driver_override else "")
