"""The bench's relays in C (relay.c), built on first use with the system's gcc against the
running interpreter's headers (Debian: gcc, python3-dev) into bench/native/build/.

    module, reason = load()   # module None when it cannot be built; reason says why
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "relay.c"
NAME = "_bench_relay"
FLAGS = ["-O2", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter", "-shared", "-fPIC"]


def built_path() -> Path:
    """Where this source, built for this interpreter, lives: its name says both."""
    key = hashlib.sha256(SOURCE.read_bytes() + sys.version.encode()).hexdigest()[:12]
    return HERE / "build" / f"{NAME}-{key}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def build() -> tuple[Path | None, str]:
    """Build relay.c unless it is built already: (the shared object, "") or (None, why)."""
    out = built_path()
    if out.exists():
        return out, ""
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        return None, f"no C compiler ({cc}; Debian package gcc)"
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").exists():
        return None, f"no Python.h in {include} (Debian package python3-dev)"
    out.parent.mkdir(exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    argv = [cc, *FLAGS, f"-I{include}", str(SOURCE), "-o", str(tmp), "-lpthread"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{cc} failed: {e}"
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        first = (done.stderr.strip().splitlines() or ["no output"])[0]
        return None, f"{cc} failed: {first}"
    tmp.replace(out)
    return out, ""


def load() -> tuple[ModuleType | None, str]:
    """The built module, or (None, why it could not be built or loaded)."""
    path, why = build()
    if path is None:
        return None, why
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        return None, f"cannot load {path}"
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        return None, f"cannot load {path}: {e}"
    return module, ""
