"""`ntx-setup grub ...`: edits that keep everything else byte-identical, and byte-identical restore."""

import json
import os

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ntx_common.errors import SetupError, UsageError
from ntx_setup.grub import assignments, edit_params, edit_text
from ntx_setup.journal import Journal

GRUB = """# If you change this file, run 'update-grub' afterwards to update
# /boot/grub/grub.cfg.
#   info -f grub -n 'Simple configuration'

GRUB_DEFAULT=0
GRUB_TIMEOUT=5
GRUB_DISTRIBUTOR=`( . /etc/os-release; echo ${NAME:-Debian} ) 2>/dev/null || echo Debian`
GRUB_CMDLINE_LINUX_DEFAULT="quiet splash"   # keep this comment
GRUB_CMDLINE_LINUX=""

# Uncomment to disable graphical terminal
#GRUB_TERMINAL=console
"""


@pytest.fixture
def grub(fr):
    fr.write("/etc/default/grub", GRUB)
    os.chmod(fr.p("/etc/default/grub"), 0o644)
    fr.write("/usr/sbin/update-grub", "#!/bin/sh\n")
    os.chmod(fr.p("/usr/sbin/update-grub"), 0o755)
    return fr.p("/etc/default/grub")


def changed_lines(old: str, new: str) -> list[tuple[str, str]]:
    return [(a, b) for a, b in zip(old.splitlines(), new.splitlines()) if a != b]


def test_enable_iommu_intel_edits_one_line_and_runs_update_grub(cli, fr, kernel, grub):
    r = cli("grub", "enable-iommu", "--yes")
    assert r.exit_code == 0, r.stderr
    new = grub.read_text()
    assert changed_lines(GRUB, new) == [(
        'GRUB_CMDLINE_LINUX_DEFAULT="quiet splash"   # keep this comment',
        'GRUB_CMDLINE_LINUX_DEFAULT="quiet splash intel_iommu=on iommu=pt"   # keep this comment')]
    assert len(new.splitlines()) == len(GRUB.splitlines())
    assert "+GRUB_CMDLINE_LINUX_DEFAULT=" in r.stdout and "-GRUB_CMDLINE_LINUX_DEFAULT=" in r.stdout  # the diff
    assert kernel.commands == [["update-grub"]]
    assert "reboot" in r.stderr
    [e] = Journal(fr.base).entries()
    backup = Journal(fr.base).backups / f"{e.id:06d}-grub"
    assert backup.read_text() == GRUB and e.state == "done"
    assert oct(grub.stat().st_mode & 0o777) == "0o644"


def test_amd_and_disable(cli, fr, kernel, grub):
    fr.write("/proc/cpuinfo", "vendor_id\t: AuthenticAMD\n")
    assert cli("grub", "enable-iommu", "--yes").exit_code == 0
    assert assignments(grub.read_text())["GRUB_CMDLINE_LINUX_DEFAULT"].params == ["quiet", "splash", "amd_iommu=on", "iommu=pt"]
    assert cli("grub", "disable-iommu", "--yes").exit_code == 0
    assert assignments(grub.read_text())["GRUB_CMDLINE_LINUX_DEFAULT"].params == ["quiet", "splash", "amd_iommu=off"]


def test_twice_is_a_noop_and_restore_is_byte_identical(cli, fr, kernel, grub):
    assert cli("grub", "enable-iommu", "--yes").exit_code == 0
    r = cli("grub", "enable-iommu", "--yes")
    assert r.exit_code == 0 and "nothing to do" in r.stdout
    assert kernel.commands == [["update-grub"]] and len(Journal(fr.base).entries()) == 1
    assert cli("grub", "add", "hugepagesz=1G", "hugepages=4", "--yes").exit_code == 0
    assert cli("grub", "remove", "splash", "--yes").exit_code == 0
    assert "splash" not in grub.read_text()
    r = cli("restore", "grub", "--yes", "--json")
    assert r.exit_code == 0, r.stderr
    assert [x["id"] for x in json.loads(r.stdout)["restored"]] == [3, 2, 1]   # newest first
    assert grub.read_bytes() == GRUB.encode()
    assert kernel.commands.count(["update-grub"]) == 6
    assert cli("restore", "grub", "--yes").stdout.strip() == "nothing to restore"


def test_dry_run_shows_diff_and_writes_nothing(cli, fr, kernel, grub):
    r = cli("grub", "add", "iommu=pt", "--dry-run", "--json")
    assert r.exit_code == 0
    doc = json.loads(r.stdout)
    assert doc["applied"] is False and '+GRUB_CMDLINE_LINUX_DEFAULT="quiet splash iommu=pt"' in doc["plan"]["diff"]
    assert grub.read_text() == GRUB and kernel.commands == [] and Journal(fr.base).entries() == []


def test_update_failure_rolls_back_byte_identically(cli, fr, kernel, grub):
    calls = []

    def update_grub(argv):   # fails on the new file, works again on the original
        calls.append(argv)
        return (1, "/usr/sbin/grub-probe: error: failed to get canonical path") if len(calls) == 1 else (0, "")
    kernel.handlers["update-grub"] = update_grub
    r = cli("grub", "enable-iommu", "--yes")
    assert r.exit_code == 1 and "canonical path" in r.stderr
    assert grub.read_bytes() == GRUB.encode() and len(calls) == 2
    assert [e.state for e in Journal(fr.base).entries()] == ["rolled-back"]


def test_failed_rollback_keeps_the_entry_for_restore(cli, fr, kernel, grub):
    kernel.handlers["update-grub"] = lambda argv: (1, "grub-probe: error")
    r = cli("grub", "enable-iommu", "--yes")
    assert r.exit_code == 1 and "rolling it back failed too" in r.stderr and "restore --all" in r.stderr
    assert grub.read_bytes() == GRUB.encode()
    assert [e.state for e in Journal(fr.base).entries()] == ["pending"]
    del kernel.handlers["update-grub"]
    assert cli("restore", "--all", "--yes").exit_code == 0
    assert [e.state for e in Journal(fr.base).entries()] == ["restored"]
    assert kernel.commands[-1] == ["update-grub"]


def test_restore_refuses_a_file_edited_since_unless_forced(cli, fr, grub):
    assert cli("grub", "enable-iommu", "--yes").exit_code == 0
    grub.write_text(grub.read_text() + "GRUB_TIMEOUT=1\n")
    r = cli("restore", "--all", "--yes")
    assert r.exit_code == 1 and "changed after ntx-setup edited it" in r.stderr
    assert cli("restore", "--all", "--yes", "--force").exit_code == 0
    assert grub.read_bytes() == GRUB.encode()


def test_distribution_tools(cli, fr, kernel, grub):
    fr.p("/usr/sbin/update-grub").unlink()
    fr.write("/usr/sbin/grub2-mkconfig", "")
    os.chmod(fr.p("/usr/sbin/grub2-mkconfig"), 0o755)
    assert cli("grub", "enable-iommu", "--yes").exit_code == 0
    assert kernel.commands == [["grub2-mkconfig", "-o", "/boot/grub2/grub.cfg"]]
    fr.p("/usr/sbin/grub2-mkconfig").unlink()
    r = cli("grub", "add", "iommu=pt", "--yes")       # already there: no tool needed
    assert r.exit_code == 0
    r = cli("grub", "add", "quiet2", "--yes")
    assert r.exit_code == 1 and "grub-mkconfig" in r.stderr


def test_dropin_override_is_noted(cli, fr, grub):
    fr.write("/etc/default/grub.d/50-cloudimg-settings.cfg", 'GRUB_CMDLINE_LINUX_DEFAULT="console=tty1"\n')
    r = cli("grub", "enable-iommu", "--dry-run")
    assert "50-cloudimg-settings.cfg" in r.stdout and "override" in r.stdout


def test_bad_params_are_usage_errors(cli, grub):
    assert cli("grub", "add", "a b", "--yes").exit_code == 2
    assert cli("grub", "add", 'x="1"', "--yes").exit_code == 2
    assert cli("grub", "add", "$(reboot)", "--yes").exit_code == 2


@pytest.mark.parametrize("line,expected", [
    ("GRUB_CMDLINE_LINUX_DEFAULT='quiet'", "GRUB_CMDLINE_LINUX_DEFAULT='quiet iommu=pt'"),
    ("GRUB_CMDLINE_LINUX_DEFAULT=quiet", 'GRUB_CMDLINE_LINUX_DEFAULT="quiet iommu=pt"'),
    ('export GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_CMDLINE_LINUX_DEFAULT quiet"',
     'export GRUB_CMDLINE_LINUX_DEFAULT="$GRUB_CMDLINE_LINUX_DEFAULT quiet iommu=pt"'),
    ('GRUB_CMDLINE_LINUX_DEFAULT=""', 'GRUB_CMDLINE_LINUX_DEFAULT="iommu=pt"'),
])
def test_quoting_styles_are_kept(line, expected):
    assert edit_text(line + "\n", ["iommu=pt"], []) == expected + "\n"


def test_missing_variable_is_appended_and_conflicts_in_linux_var_removed():
    text = 'GRUB_CMDLINE_LINUX="intel_iommu=off rd.lvm.lv=vg/root"'   # no trailing newline
    new = edit_text(text, ["intel_iommu=on"], [])
    assert new == 'GRUB_CMDLINE_LINUX="rd.lvm.lv=vg/root"\nGRUB_CMDLINE_LINUX_DEFAULT="intel_iommu=on"\n'


@pytest.mark.parametrize("line", ['GRUB_CMDLINE_LINUX_DEFAULT="$(cat /x)"', "GRUB_CMDLINE_LINUX_DEFAULT=`cat /x`",
                                  'GRUB_CMDLINE_LINUX_DEFAULT="quiet \\', 'GRUB_CMDLINE_LINUX_DEFAULT="quiet',
                                  'GRUB_CMDLINE_LINUX_DEFAULT="quiet"; reboot'])
def test_unsafe_values_are_refused(line):
    with pytest.raises(SetupError, match="edit it by hand"):
        edit_text(line + "\n", ["iommu=pt"], [])


def test_contradictions_are_refused():
    with pytest.raises(UsageError):
        edit_text("", ["iommu=pt", "iommu=soft"], [])
    with pytest.raises(UsageError):
        edit_text("", ["iommu=pt"], ["iommu"])


def test_edit_params_semantics():
    assert edit_params(["intel_iommu=off", "quiet", "intel_iommu=igfx_off"], ["intel_iommu=on"], []) == ["intel_iommu=on", "quiet"]
    assert edit_params(["iommu=pt", "iommu=soft"], [], ["iommu=pt"]) == ["iommu=soft"]
    assert edit_params(["iommu=pt", "iommu=soft", "quiet"], [], ["iommu"]) == ["quiet"]


_token = st.from_regex(r"[a-z_]{1,6}(=[a-z0-9]{1,3})?", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(_token, max_size=6), st.lists(_token, max_size=3), st.lists(_token, max_size=3))
def test_edit_is_idempotent_and_leaves_other_lines_alone(existing, add, remove):
    assume(len({a.split("=")[0] for a in add}) == len(add))
    assume(not any(r == a or r == a.split("=")[0] for r in remove for a in add))
    text = f'# c\nGRUB_TIMEOUT=5\nGRUB_CMDLINE_LINUX_DEFAULT="{" ".join(existing)}" # t\nGRUB_CMDLINE_LINUX=""\n'
    once = edit_text(text, add, remove)
    assert edit_text(once, add, remove) == once
    params = assignments(once)["GRUB_CMDLINE_LINUX_DEFAULT"].params
    assert all(a in params for a in add)
    removed_exact = [r for r in remove if r not in add]
    assert not any(p in removed_exact for p in params)
    assert once.splitlines()[:2] == ["# c", "GRUB_TIMEOUT=5"] and once.splitlines()[2].endswith('" # t')
