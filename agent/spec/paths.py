"""Every filesystem location providerd uses, and the variables that move them."""

from __future__ import annotations

import os
from pathlib import Path

from agent.spec import locations

MANIFEST_DIRS = (Path("/etc/providerd/providers"), Path("/usr/lib/providerd/providers"))
CONFIG = Path("/etc/providerd/providerd.toml")
RUNTIME_DIR = Path(locations.RUNTIME_DIR)
STATE_DIR = Path(locations.STATE_DIR)
KEYS = Path(locations.KEYS)


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
    return Path(locations.keys_file())


def runtime_dir() -> Path:
    return Path(locations.runtime_dir())


def state_dir() -> Path:
    return Path(locations.state_dir())


def provider_runtime_dir(slug: str) -> Path:
    return runtime_dir() / slug


def control_socket(slug: str) -> Path:
    return provider_runtime_dir(slug) / "control.sock"


def worker_env_file(slug: str) -> Path:
    return Path(locations.worker_env_file(slug))


def backoff_file(slug: str) -> Path:
    """The front's backoff after a failed start (`locations.backoff_file`)."""
    return Path(locations.backoff_file(slug))


def trusted_uids() -> frozenset[int]:
    """Owners a manifest may have: root, plus PROVIDERD_TRUSTED_UID if set (for tests)."""
    return locations.trusted_uids()


def preload_record(slug: str) -> Path:
    """What the boot-time load of a `preload` provider did. Beside, not in, the provider's
    runtime directory, which systemd removes when the front exits; /run is empty at boot."""
    return runtime_dir() / f"{slug}.preloaded"
