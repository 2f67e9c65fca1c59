"""What `providerctl check` warns of in a valid manifest: credential files that are missing
or readable by others, environment variables that look like secrets, and a manifest the
front's user cannot read. Warnings, not problems: the generator still generates it."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from agent.spec import paths
from agent.spec.provider import Provider

SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
FRONT_USER = "providerd"  # the fronts and the router run as this user (the package makes it)


def credential_warnings(p: Provider) -> list[str]:
    """One line per credential file that is missing or readable by others than root."""
    lines = []
    trusted = paths.trusted_uids()
    for name, path in p.credentials:
        where = f"{p.source}: runtime.credentials.{name}: warning: {path}"
        try:
            st = os.stat(path)
        except OSError as e:
            lines.append(f"{where}: {e.strerror or e}; the worker will not start without it")
            continue
        if st.st_mode & 0o077 or st.st_uid not in trusted:
            lines.append(
                f"{where} is mode {stat.S_IMODE(st.st_mode):04o} owned by uid {st.st_uid}; "
                "make it root's, mode 0600 (systemd gives the worker its own copy)"
            )
    return lines


@dataclass(frozen=True)
class Reader:
    """A user as file permissions see it."""

    name: str
    uid: int
    gids: frozenset[int]


def front_reader() -> Reader | None:
    """The front's user and its groups (None where the user does not exist). The group
    database is read once here, not once per manifest."""
    import grp
    import pwd

    try:
        user = pwd.getpwnam(FRONT_USER)
    except KeyError:
        return None
    gids = {user.pw_gid} | {g.gr_gid for g in grp.getgrall() if FRONT_USER in g.gr_mem}
    return Reader(FRONT_USER, user.pw_uid, frozenset(gids))


def _can_read(path: Path, who: Reader, need: int) -> bool:
    st = os.stat(path)
    if st.st_uid == who.uid:
        return bool(st.st_mode & (need << 6))
    if st.st_gid in who.gids:
        return bool(st.st_mode & (need << 3))
    return bool(st.st_mode & need)


def front_read_warnings(p: Provider, who: Reader | None) -> list[str]:
    """A line when `who` (the front's user) cannot read this manifest (where it exists)."""
    if who is None:
        return []
    try:
        ok = _can_read(p.source, who, 4) and all(_can_read(d, who, 1) for d in p.source.parents)
    except OSError:
        return []
    if ok:
        return []
    return [
        f"{p.source}: warning: the user {who.name} cannot read this manifest, so the "
        f"provider's front cannot start; make it 0644, or 0640 with group {who.name}"
    ]


def secret_warnings(p: Provider) -> list[str]:
    """One line per environment variable whose name looks like a secret, and per
    credential file that is missing or not root's alone."""
    lines = credential_warnings(p)
    for name, _ in p.environment:
        if any(word in name.upper() for word in SECRET_WORDS):
            lines.append(
                f"{p.source}: runtime.environment.{name}: warning: looks like a secret; "
                "environment values are shown to every local user by systemctl show. Put it in a "
                f'root-only file and name it in [runtime] credentials = {{ {name} = "/etc/providerd/'
                f'credentials/{p.slug}-{name.lower()}" }} (the model gets the same variable)'
            )
    return lines
