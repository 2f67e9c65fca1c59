"""The locations the front's early start needs, as strings and with `os` alone
(`pathlib` costs milliseconds to import on the way to the worker's StartUnit).
`agent.spec.paths` gives the same locations as `Path`s, from these."""

from __future__ import annotations

import os

RUNTIME_DIR = "/run/providerd"
STATE_DIR = "/var/lib/providerd"
KEYS = "/etc/providerd/keys.toml"


def keys_file() -> str:
    """The API keys file; its existence turns keys on (agent.spec.apikeys)."""
    return os.environ.get("PROVIDERD_KEYS", KEYS)


def keys_on(path: str | None = None) -> bool:
    """Whether API keys are on: the keys file exists (whatever it holds). The worker's unit
    conditions test the same path. A file that cannot be looked at (a directory on its
    way that we may not search) counts as there: keys fail closed, never open."""
    try:
        os.lstat(path if path is not None else keys_file())
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True
    return True


def runtime_dir() -> str:
    return os.environ.get("PROVIDERD_RUNTIME_DIR", RUNTIME_DIR)


def state_dir() -> str:
    return os.environ.get("PROVIDERD_STATE_DIR", STATE_DIR)


def worker_env_file(slug: str) -> str:
    return os.path.join(runtime_dir(), slug, "worker.env")


def backoff_file(slug: str) -> str:
    """The front's backoff after a failed start, kept between activations (beside, not in,
    the provider's runtime directory, which goes with the front); while it exists,
    `ConditionPathExists=!` keeps systemd from starting the worker with the front."""
    return os.path.join(runtime_dir(), f"{slug}.backoff")


def trusted_uids() -> frozenset[int]:
    """Owners a manifest (or the generator's record of one) may have: root, plus
    PROVIDERD_TRUSTED_UID if set (for tests)."""
    uids = {0}
    value = os.environ.get("PROVIDERD_TRUSTED_UID", "").strip()
    if value.isascii() and value.isdigit():
        uids.add(int(value))
    return frozenset(uids)
