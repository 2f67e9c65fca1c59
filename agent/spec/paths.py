"""Every filesystem location providerd uses, and the variables that move them."""

from __future__ import annotations

import os
from pathlib import Path

MANIFEST_DIRS = (Path("/etc/providerd/providers"), Path("/usr/lib/providerd/providers"))
CONFIG = Path("/etc/providerd/providerd.toml")
RUNTIME_DIR = Path("/run/providerd")
STATE_DIR = Path("/var/lib/providerd")
KEYS = Path("/etc/providerd/keys.toml")


def manifest_dirs() -> list[Path]:
    """The manifest directories, highest priority first."""
    value = os.environ.get("PROVIDERD_MANIFEST_DIRS")
    if value is None:
        return list(MANIFEST_DIRS)
    return [Path(p) for p in value.split(":") if p]


def config_file() -> Path:
    return Path(os.environ.get("PROVIDERD_CONFIG", CONFIG))


def keys_file() -> Path:
    """The API keys file; its existence turns keys on (agent.spec.apikeys)."""
    return Path(os.environ.get("PROVIDERD_KEYS", KEYS))


def runtime_dir() -> Path:
    return Path(os.environ.get("PROVIDERD_RUNTIME_DIR", RUNTIME_DIR))


def state_dir() -> Path:
    return Path(os.environ.get("PROVIDERD_STATE_DIR", STATE_DIR))


def provider_runtime_dir(slug: str) -> Path:
    return runtime_dir() / slug


def control_socket(slug: str) -> Path:
    return provider_runtime_dir(slug) / "control.sock"


def worker_env_file(slug: str) -> Path:
    return provider_runtime_dir(slug) / "worker.env"


def backoff_file(slug: str) -> Path:
    """The front's backoff after a failed start, kept between activations (beside, not in,
    the provider's runtime directory, which goes with the front); while it exists,
    `ConditionPathExists=!` keeps systemd from starting the worker with the front."""
    return runtime_dir() / f"{slug}.backoff"


def trusted_uids() -> frozenset[int]:
    """Owners a manifest may have: root, plus PROVIDERD_TRUSTED_UID if set (for tests)."""
    uids = {0}
    value = os.environ.get("PROVIDERD_TRUSTED_UID", "").strip()
    if value.isascii() and value.isdigit():
        uids.add(int(value))
    return frozenset(uids)


def preload_record(slug: str) -> Path:
    """What the boot-time load of a `preload` provider did. Beside, not in, the provider's
    runtime directory, which systemd removes when the front exits; /run is empty at boot."""
    return runtime_dir() / f"{slug}.preloaded"
