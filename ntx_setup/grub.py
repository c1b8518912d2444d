"""Kernel parameters in /etc/default/grub, edited without disturbing anything else.

Only the value of the last `GRUB_CMDLINE_LINUX_DEFAULT=` (and, for removals and conflicting
keys, `GRUB_CMDLINE_LINUX=`) line changes; comments, quoting style, other variables and
trailing comments stay byte-identical. Values the shell would expand in ways we cannot see
(command substitution, line continuations) are refused rather than guessed at.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ntx_common.errors import SetupError, UsageError
from ntx_setup import filechange
from ntx_setup.change import Plan
from ntx_setup.journal import Entry, Journal
from ntx_setup.machine import Machine
from ntx_setup.sysfs import cpu_vendor, list_names, read_text

GRUB_FILE = "/etc/default/grub"
DEFAULT_VAR, ALL_VAR = "GRUB_CMDLINE_LINUX_DEFAULT", "GRUB_CMDLINE_LINUX"
_ASSIGN_RE = re.compile(r"^(\s*(?:export\s+)?(GRUB_CMDLINE_LINUX(?:_DEFAULT)?)=)(.*)$")
_PARAM_RE = re.compile(r"^[A-Za-z0-9_.,:/+=@%-]+$")
IOMMU_ON = {"intel": ["intel_iommu=on", "iommu=pt"], "amd": ["amd_iommu=on", "iommu=pt"]}
IOMMU_OFF = {"intel": ["intel_iommu=off"], "amd": ["amd_iommu=off"]}


@dataclass(frozen=True)
class Assignment:
    index: int       # line number (0-based)
    prefix: str      # `GRUB_CMDLINE_LINUX_DEFAULT=` with any indent/export
    quote: str       # '"', "'" or ""
    params: list[str]
    suffix: str      # everything after the closing quote (spaces, a comment)

    def render(self, params: list[str]) -> str:
        quote = self.quote or ('"' if len(params) != 1 else "")
        return f"{self.prefix}{quote}{' '.join(params)}{quote}{self.suffix}"


def _parse_value(rest: str, where: str) -> tuple[str, str, str]:
    """(quote, value, suffix) of a shell assignment's right-hand side."""
    q = rest[:1] if rest.startswith(('"', "'")) else ""
    if q == '"':
        m = re.match(r'"((?:[^"\\]|\\.)*)"(.*)$', rest)
    elif q == "'":
        m = re.match(r"'([^']*)'(.*)$", rest)
    else:
        m = re.match(r"([^\s#;]*)(.*)$", rest)
    if not m:
        raise SetupError(f"{where}: unterminated {q} quote (a multi-line value?); edit it by hand")
    value, suffix = m.group(1), m.group(2)
    if not q and any(c in value for c in "\"'\\$`"):
        raise SetupError(f"{where}: an unquoted value with quotes or expansions; edit it by hand")
    if "`" in value or "$(" in value or value.endswith("\\"):
        raise SetupError(f"{where}: the value uses command substitution or a line continuation; edit it by hand")
    if suffix.strip() and not suffix.lstrip().startswith("#"):
        raise SetupError(f"{where}: unexpected text after the value ({suffix.strip()!r}); edit it by hand")
    return q, value, suffix


def assignments(text: str) -> dict[str, Assignment]:
    """The effective (last) assignment of each cmdline variable."""
    found = {}
    for i, line in enumerate(text.splitlines()):
        m = _ASSIGN_RE.match(line)
        if m:
            quote, value, suffix = _parse_value(m.group(3), f"{GRUB_FILE} line {i + 1}")
            found[m.group(2)] = Assignment(i, m.group(1), quote, value.split(), suffix)
    return found


def _key(param: str) -> str:
    return param.split("=", 1)[0]


def edit_params(params: list[str], add: list[str], remove: list[str]) -> list[str]:
    """`remove` drops exact matches and, for a bare key, every `key=...`; `add` replaces same-key values."""
    out = [p for p in params if not any(p == r or ("=" not in r and _key(p) == r) for r in remove)]
    for a in add:
        if a in out:
            continue
        same = [i for i, p in enumerate(out) if "=" in a and _key(p) == _key(a)]
        if same:
            out[same[0]] = a
            out = [p for i, p in enumerate(out) if i not in same[1:]]
        else:
            out.append(a)
    return out


def edit_text(text: str, add: list[str], remove: list[str]) -> str:
    """The file with `add` in GRUB_CMDLINE_LINUX_DEFAULT and `remove` (and add's old values) gone from both."""
    keys = [_key(a) for a in add]
    if len(set(keys)) != len(keys) or any(r == a or r == _key(a) for r in remove for a in add):
        raise UsageError(f"contradictory parameters: add {' '.join(add)} / remove {' '.join(remove)}")
    lines = text.splitlines(True)
    found = assignments(text)
    conflicts = [_key(a) for a in add if "=" in a]
    for var in (ALL_VAR, DEFAULT_VAR):
        a = found.get(var)
        if a is None:
            continue
        extra = [p for p in a.params if _key(p) in conflicts and p not in add] if var == ALL_VAR else []
        new = edit_params(a.params, add if var == DEFAULT_VAR else [], remove + extra)
        if new != a.params:
            eol = lines[a.index][len(lines[a.index].rstrip("\r\n")):]
            lines[a.index] = a.render(new) + eol
    if DEFAULT_VAR not in found and add:
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        lines.append(f'{DEFAULT_VAR}="{" ".join(edit_params([], add, []))}"\n')
    return "".join(lines)


def validate_params(params: list[str]) -> list[str]:
    bad = [p for p in params if not _PARAM_RE.match(p)]
    if bad or not params:
        raise UsageError(f"not a plain kernel parameter: {', '.join(map(repr, bad)) or '(none given)'} "
                         "(letters, digits and _ . , : / + = @ % - only)")
    return params


def action_params(m: Machine, action: str, params: list[str]) -> tuple[list[str], list[str]]:
    """(add, remove) for one `ntx-setup grub` action, vendor-aware for the IOMMU ones."""
    if action in ("enable-iommu", "disable-iommu"):
        vendor = cpu_vendor(m.root)
        if vendor not in IOMMU_ON:
            raise SetupError("unknown CPU vendor in /proc/cpuinfo; add the IOMMU parameters by hand with "
                             "`ntx-setup grub add intel_iommu=on iommu=pt` (or amd_iommu=on)")
        return (IOMMU_ON[vendor], []) if action == "enable-iommu" else (IOMMU_OFF[vendor], ["iommu=pt"])
    if action == "add":
        return validate_params(params), []
    if action == "remove":
        return [], validate_params(params)
    raise UsageError(f"unknown grub action {action!r} (enable-iommu, disable-iommu, add, remove)")


def update_command(m: Machine) -> list[str]:
    """How this distribution regenerates grub.cfg from /etc/default/grub."""
    if m.tool("update-grub"):
        return ["update-grub"]
    if m.tool("grub2-mkconfig"):
        return ["grub2-mkconfig", "-o", "/boot/grub2/grub.cfg"]
    if m.tool("grub-mkconfig"):
        return ["grub-mkconfig", "-o", "/boot/grub/grub.cfg"]
    raise SetupError("none of update-grub, grub2-mkconfig, grub-mkconfig found: is GRUB this machine's boot loader? "
                     "(systemd-boot keeps the command line in /etc/kernel/cmdline; edit it there)")


def _overrides(m: Machine) -> list[str]:
    """Drop-ins in /etc/default/grub.d that set the cmdline variables after our file is read."""
    notes = []
    for name in list_names(m.path("/etc/default/grub.d")):
        text = read_text(m.path(f"/etc/default/grub.d/{name}"), "") or ""
        if name.endswith(".cfg") and re.search(r"^\s*(export\s+)?GRUB_CMDLINE_LINUX", text, re.M):
            notes.append(f"/etc/default/grub.d/{name} also sets GRUB_CMDLINE_LINUX*: it is read after "
                         f"{GRUB_FILE} and may override this edit")
    return notes


def plan_grub(m: Machine, action: str, params: list[str]) -> tuple[Plan, bytes]:
    """The plan (with its unified diff) and the new file bytes."""
    add, remove = action_params(m, action, params)
    path = m.path(GRUB_FILE)
    try:
        old = path.read_bytes()
    except OSError as exc:
        raise SetupError(f"{GRUB_FILE}: cannot read it ({exc.strerror}); is GRUB installed?") from exc
    old_text = old.decode("utf-8", errors="surrogateescape")
    new_text = edit_text(old_text, add, remove)
    new = new_text.encode("utf-8", errors="surrogateescape")
    if new == old:
        return Plan("grub", GRUB_FILE, notes=[f"{GRUB_FILE} already has this: nothing to do"]), new
    update = update_command(m)
    steps = [f"back up {GRUB_FILE} under /var/lib/ntx/backups", f"write the new {GRUB_FILE}",
             f"run {' '.join(update)}", "verify; a reboot is then required"]
    before = filechange.before_record(m, GRUB_FILE, old, new, "grub") | {"update": update}
    notes = _overrides(m) + ["the new kernel parameters take effect after a reboot"]
    return Plan("grub", GRUB_FILE, steps, filechange.unified_diff(GRUB_FILE, old_text, new_text), notes, before), new


def do_grub(m: Machine, journal: Journal, entry: Entry, old: bytes, new: bytes) -> dict:
    filechange.write_new(m, journal, entry, old, new)
    m.run(entry.before["update"], timeout=300)
    if filechange.sha256(m.path(GRUB_FILE).read_bytes()) != entry.before["new_sha256"]:
        raise SetupError(f"{GRUB_FILE} does not hold the new contents after {' '.join(entry.before['update'])}")
    return {"sha256": entry.before["new_sha256"], "reboot_required": True}


def undo_grub(m: Machine, journal: Journal, entry: Entry, force: bool = False) -> None:
    rewritten = filechange.restore_original(m, journal, entry, force)
    if rewritten or entry.state == "done":
        m.run(entry.before["update"], timeout=300)
