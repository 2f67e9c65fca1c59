"""`providerctl check [PATH...]`: every problem of every manifest (and of the keys file),
one line each, then a summary line per valid provider and the warnings of
`agent.spec.check_warnings`."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import TextIO

from agent.spec import paths
from agent.spec.check_warnings import front_read_warnings, front_reader, secret_warnings
from agent.spec.manifest import Discovery
from agent.spec.provider import Provider, printable
from agent.systemd.manifests import check_paths, discover


def _shell_word(arg: str) -> str:
    return arg if re.fullmatch(r"[\w@%+=:,./{}-]+", arg) else shlex.quote(arg)


def summary(p: Provider) -> str:
    """One line for a valid provider: slug, address(es), command."""
    addresses = ", ".join(str(a) for a in p.addresses)
    run = f"launch {p.launch}" if p.launch else " ".join(_shell_word(a) for a in p.command)
    state = "" if p.enabled else " (disabled)"
    return f"{p.slug}: {addresses} ({p.protocol}){state} -> {run}"


def main_check(items: list[str], out: TextIO, err: TextIO) -> int:
    """Every problem one line on `out`, warnings on `err`; exit 1 if any problem. The keys
    file (`paths.keys_file()`) is checked too, or alone when it is the only PATH."""
    from agent.spec.apikeys import check as check_keys

    key_problems, keys_line = check_keys(items)
    keys_file = os.path.abspath(paths.keys_file())
    only_keys = bool(items) and all(os.path.abspath(i) == keys_file for i in items)
    items = [i for i in items if os.path.abspath(i) != keys_file]
    if only_keys:
        found = Discovery()
    else:
        found = check_paths([Path(i) for i in items]) if items else discover()
    for problem in [*found.problems, *key_problems]:
        out.write(f"{problem}\n")
    reader = front_reader() if found.providers else None
    for p in found.providers.values():
        for line in front_read_warnings(p, reader) + secret_warnings(p):
            err.write(line + "\n")
    if found.problems or key_problems:
        return 1
    for p in found.providers.values():
        out.write(printable(summary(p)) + "\n")
    if keys_line is not None:
        out.write(printable(keys_line) + "\n")
    if not found.providers and not only_keys:
        where = ", ".join(items) if items else ", ".join(str(d) for d in paths.manifest_dirs())
        err.write(printable(f"providerctl: no manifests found in {where}") + "\n")
    return 0
