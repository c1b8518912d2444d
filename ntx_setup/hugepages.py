"""Hugepage pools: read them, size one, give the pages back."""

from __future__ import annotations

from ntx_common.errors import SetupError, UsageError
from ntx_setup.change import Plan
from ntx_setup.journal import Entry
from ntx_setup.machine import Machine
from ntx_setup.sysfs import list_names, read_int, under

SIZES_KB = {"2M": 2048, "1G": 1048576}


def pool_dir(size_kb: int, node: int | None) -> str:
    if node is None:
        return f"/sys/kernel/mm/hugepages/hugepages-{size_kb}kB"
    return f"/sys/devices/system/node/node{node}/hugepages/hugepages-{size_kb}kB"


def pools(root) -> list[dict]:
    """Every system-wide pool: size, total, free (pages)."""
    found = []
    for name in list_names(under(root, "/sys/kernel/mm/hugepages")):
        if name.startswith("hugepages-") and name.endswith("kB"):
            kb = int(name[len("hugepages-"):-2])
            d = under(root, pool_dir(kb, None))
            found.append({"size_kb": kb, "total": read_int(d / "nr_hugepages", 0),
                          "free": read_int(d / "free_hugepages", 0)})
    return found


def plan_hugepages(m: Machine, count: int, size: str, node: int | None) -> Plan:
    if count < 0:
        raise UsageError(f"hugepages: count must be >= 0, got {count}")
    if size not in SIZES_KB:
        raise UsageError(f"hugepages: --size must be one of {', '.join(SIZES_KB)}, got {size!r}")
    kb = SIZES_KB[size]
    path = pool_dir(kb, node) + "/nr_hugepages"
    current = read_int(m.path(path))
    if current is None:
        where = f"NUMA node {node}" if node is not None else "this kernel"
        raise SetupError(f"{path} does not exist: {where} has no {size} hugepage pool"
                         + (" (the CPU may lack 1 GiB page support, flag pdpe1gb)" if size == "1G" else ""))
    target = f"hugepages-{kb}kB" + (f"/node{node}" if node is not None else "")
    if current == count:
        return Plan("hugepages", target, notes=[f"{target} already has {count} pages: nothing to do"])
    _check_memory(m, (count - current) * kb * 1024)
    return Plan("hugepages", target, [f"echo {count} > {path}   (now {current})"],
                before={"path": path, "nr": current, "count": count, "size_kb": kb})


def _check_memory(m: Machine, extra: int) -> None:
    from ntx_setup.block import _psutil_procfs

    with _psutil_procfs(m.root) as psutil:
        available = psutil.virtual_memory().available
    if extra > 0.9 * available:
        raise SetupError(f"reserving {extra / 2**30:.1f} GiB more hugepages would leave less than 10 % of "
                         f"MemAvailable ({available / 2**30:.1f} GiB): choose a smaller count")


def do_hugepages(m: Machine, plan: Plan) -> dict:
    path, want = plan.before["path"], plan.before["count"]
    m.write(m.path(path), str(want))
    got = read_int(m.path(path))
    if got != want:
        raise SetupError(f"the kernel reserved {got} of {want} hugepages in {path} (memory too fragmented); "
                         "reserve them at boot instead, e.g. `ntx-setup grub add hugepagesz=1G hugepages=N`")
    return {"nr": got}


def undo_hugepages(m: Machine, entry: Entry) -> None:
    path, nr = entry.before["path"], entry.before["nr"]
    if read_int(m.path(path)) != nr:
        m.write(m.path(path), str(nr))
    got = read_int(m.path(path))
    if got != nr:
        raise SetupError(f"{path} is {got} after writing {nr}: pages are in use; stop what uses them and retry")


def live_state(m: Machine, entry: Entry) -> str:
    return f"nr_hugepages {read_int(m.path(entry.before['path']))}"
