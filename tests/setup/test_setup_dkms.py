"""`ntx-setup dkms ...` on a fake DKMS tree; the patched C is compiled and run against stubs."""

import json
import shutil
import subprocess

import pytest

from ntx_setup.dkms import MARKER
from ntx_setup.journal import Journal

VER = "580.65.06"
SRC = f"/usr/src/nvidia-{VER}"
MLOCK = f"{SRC}/nvidia/os-mlock.c"

# The nv_follow_pfn() regions as NVIDIA's open-gpu-kernel-modules releases spell them
# (570.133 .. 595: "flavors"; 550.90 .. 570.86: "pte"), around filler of our own.
FLAVORS = """static inline int nv_follow_pfn(struct vm_area_struct *vma,
                                unsigned long address,
                                unsigned long *pfn)
{
#if defined(NV_FOLLOW_PFN_PRESENT)
    return follow_pfn(vma, address, pfn);
#else
    return nv_follow_flavors(vma, address, pfn);
#endif
}
"""
PTE = """static inline int nv_follow_pfn(struct vm_area_struct *vma,
                                unsigned long address,
                                unsigned long *pfn)
{
#if defined(NV_FOLLOW_PFN_PRESENT)
    return follow_pfn(vma, address, pfn);
#else
#if NV_IS_EXPORT_SYMBOL_PRESENT_follow_pte
    return follow_pte_somehow(vma, address, pfn);
#else // NV_IS_EXPORT_SYMBOL_PRESENT_follow_pte
    return -1;
#endif // NV_IS_EXPORT_SYMBOL_PRESENT_follow_pte
#endif
}
"""
BEFORE = "/* fake os-mlock.c for tests */\n#include \"os-interface.h\"\n\nstatic int unrelated(void) { return 0; }\n\n"
AFTER = "\nstatic int get_io_ptes(void) { return nv_follow_pfn(0, 0, 0); }\n"


def make_tree(fr, region=FLAVORS, license_="Dual MIT/GPL", version=VER):
    src = f"/usr/src/nvidia-{version}"
    fr.write(f"{src}/nvidia/os-mlock.c", BEFORE + region + AFTER)
    fr.write(f"{src}/nvidia/nv.c", f'MODULE_LICENSE("{license_}");\n')
    fr.write(f"{src}/dkms.conf", 'PACKAGE_NAME="nvidia"\n')
    link = fr.p(f"/var/lib/dkms/nvidia/{version}/source")
    link.parent.mkdir(parents=True)
    link.symlink_to(src)    # dkms writes an absolute in-machine link
    return fr.p(f"{src}/nvidia/os-mlock.c")


@pytest.fixture
def dkms_ok(kernel):
    def dkms(argv):
        if argv[1] == "status":
            return 0, f"nvidia/{VER}, 6.12.9-amd64, x86_64: installed"
        return 0, ""
    kernel.handlers["dkms"] = dkms
    return dkms


def test_status_reports_layout_and_flavor(cli, fr):
    make_tree(fr)
    doc = json.loads(cli("dkms", "status", "--json").stdout)
    assert doc["modules"] == [{"name": "nvidia", "version": VER, "source": SRC, "os_mlock": MLOCK,
                               "flavor": "open", "patched": False, "layout": "follow-flavors"}]
    assert cli("dkms", "status").stdout.strip() == f"nvidia/{VER}: open module, os-mlock.c {MLOCK}, layout follow-flavors"


@pytest.mark.parametrize("region,layout", [(FLAVORS, "follow-flavors"), (PTE, "follow-pte")])
def test_patch_rebuild_verify_and_revert_byte_identical(cli, fr, kernel, dkms_ok, region, layout):
    mlock = make_tree(fr, region)
    original = mlock.read_bytes()
    r = cli("dkms", "patch", "--yes")
    assert r.exit_code == 0, r.stderr
    assert f"({layout} layout)" in r.stdout and "+    return ntx_pfn_from_pgoff(vma, address, pfn);" in r.stdout
    assert "unsigned" in r.stdout and "Secure Boot" in r.stdout
    text = mlock.read_text()
    assert text.count(MARKER) == 2 and text.startswith(BEFORE) and text.endswith(AFTER)
    assert kernel.commands == [["dkms", "build", "-m", "nvidia", "-v", VER, "-k", "6.12.9-amd64", "--force"],
                               ["dkms", "install", "-m", "nvidia", "-v", VER, "-k", "6.12.9-amd64", "--force"],
                               ["dkms", "status", "-m", "nvidia", "-v", VER, "-k", "6.12.9-amd64"]]
    r = cli("dkms", "patch", "--yes")                          # twice: nothing to do
    assert r.exit_code == 0 and "already patched" in r.stdout and len(kernel.commands) == 3
    assert json.loads(cli("dkms", "status", "--json").stdout)["modules"][0]["patched"] is True
    r = cli("dkms", "revert", "--yes")
    assert r.exit_code == 0, r.stderr
    assert mlock.read_bytes() == original
    assert kernel.commands[3][:2] == ["dkms", "build"] and len(kernel.commands) == 6
    assert [e.state for e in Journal(fr.base).entries()] == ["restored"]


def test_refuses_proprietary_module(cli, fr, kernel, dkms_ok):
    mlock = make_tree(fr, license_="NVIDIA")
    r = cli("dkms", "patch", "--yes")
    assert r.exit_code == 1 and "proprietary" in r.stderr
    assert kernel.commands == [] and MARKER not in mlock.read_text()


@pytest.mark.parametrize("region", [FLAVORS.replace("address, pfn);\n#endif", "address,  pfn);\n#endif"),
                                    FLAVORS + FLAVORS, "static int nv_follow_pfn(void) { return 0; }\n"])
def test_refuses_unknown_layout(cli, fr, kernel, dkms_ok, region):
    mlock = make_tree(fr, region)
    before = mlock.read_bytes()
    r = cli("dkms", "patch", "--yes")
    assert r.exit_code == 1 and "unknown layout" in r.stderr
    assert mlock.read_bytes() == before and kernel.commands == []


def test_build_failure_rolls_back(cli, fr, kernel):
    mlock = make_tree(fr)
    original = mlock.read_bytes()
    kernel.handlers["dkms"] = lambda argv: (10, "make: *** [Makefile:82: modules] Error 2") if argv[1] == "build" \
        and MARKER in mlock.read_text() else (0, f"nvidia/{VER}, 6.12.9-amd64, x86_64: installed")
    r = cli("dkms", "patch", "--yes")
    assert r.exit_code == 1 and "Error 2" in r.stderr
    assert mlock.read_bytes() == original
    assert [e.state for e in Journal(fr.base).entries()] == ["rolled-back"]


def test_several_versions_need_a_choice(cli, fr, dkms_ok):
    make_tree(fr)
    make_tree(fr, version="570.133.07")
    r = cli("dkms", "patch", "--yes")
    assert r.exit_code == 2 and "--version" in r.stderr
    assert cli("dkms", "patch", "--version", VER, "--dry-run").exit_code == 0


def test_no_module(cli):
    r = cli("dkms", "patch", "--yes")
    assert r.exit_code == 1 and "no NVIDIA module" in r.stderr
    assert "no NVIDIA module" in cli("dkms", "status").stdout


STUBS = r"""
#include <stdio.h>
#define VM_IO     0x00004000UL
#define VM_PFNMAP 0x00000400UL
#define PAGE_SHIFT 12
struct vm_area_struct { unsigned long vm_start, vm_end, vm_pgoff, vm_flags; };
static int follow_result = -1;
static inline int nv_follow_flavors(struct vm_area_struct *vma, unsigned long address, unsigned long *pfn)
{ (void)vma; (void)address; if (follow_result == 0) *pfn = 42; return follow_result; }
"""
MAIN = r"""
int main(void)
{
    struct vm_area_struct bar = { 0x7f0000000000UL, 0x7f0000010000UL, 0xfe000UL, VM_IO | VM_PFNMAP };
    struct vm_area_struct anon = { 0x7f0000000000UL, 0x7f0000010000UL, 0xfe000UL, 0 };
    unsigned long pfn = 0;
    int a = nv_follow_pfn(&bar, 0x7f0000003005UL, &pfn);
    printf("bar %d %lx\n", a, pfn);
    printf("outside %d\n", nv_follow_pfn(&bar, 0x7f0000010000UL, &pfn));
    printf("anon %d\n", nv_follow_pfn(&anon, 0x7f0000003005UL, &pfn));
    follow_result = 0;
    a = nv_follow_pfn(&bar, 0x7f0000003005UL, &pfn);
    printf("followed %d %lu\n", a, pfn);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_patched_lookup_computes_pfn_from_vm_pgoff(cli, fr, dkms_ok, tmp_path):
    """Compile the patched functions against stub kernel types and run them (-Wall -Wextra clean)."""
    mlock = make_tree(fr)
    assert cli("dkms", "patch", "--yes").exit_code == 0
    text = mlock.read_text()
    patched = text[text.index("/* " + MARKER):text.index(AFTER)]
    src = tmp_path / "t.c"
    src.write_text(STUBS + patched + MAIN)
    build = subprocess.run(["gcc", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-o", str(tmp_path / "t"), str(src)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    out = subprocess.run([str(tmp_path / "t")], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:4] == ["bar 0 fe003", "outside -1", "anon -1", "followed 0 42"]
