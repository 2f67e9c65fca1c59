"""`providerctl generate --dry-run` and `providerctl reload`.

`plan` is pure: what the generator wrote last time (its index, providerd.json)
and what the manifests say now → the actions to take. `reload` runs them
through `SystemdOps` (the `Systemctl` implementation calls systemctl; tests use
an in-memory fake) and prints what it did.

Decisions:
- A manifest with problems is reported and skipped; every other provider is
  reloaded, and the exit status is 1. A provider that was generated before and
  whose manifest now has problems is left running as it is (its drop-ins are
  gone after the reload, so fix the manifest and reload again) — a typo never
  stops a serving provider.
- Providers whose manifest was removed: their socket and front are stopped
  before the reload (the worker follows its front), while their units still
  have their configuration.
- After `daemon-reload`: sockets of new or newly enabled providers are started
  (a reload alone does not); active sockets whose addresses changed are
  restarted (a reload alone leaves them closed), which also restarts an active
  front. A provider that became disabled is left running.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from agent.errors import ProviderdError
from agent.spec import manifest
from agent.spec.provider import Provider
from agent.systemd import generator, manifests, units
from agent.systemd.names import ROUTER_DROPIN, ROUTER_SOCKET, SOCKET_TEMPLATE_NAME, TEMPLATES

GENERATOR_DIR = Path("/run/systemd/generator")


def generator_dir() -> Path:
    """Where systemd's generators write (moved by PROVIDERD_GENERATOR_DIR for tests)."""
    return Path(os.environ.get("PROVIDERD_GENERATOR_DIR", GENERATOR_DIR))


class SystemdError(ProviderdError):
    """A systemd operation failed; the message is systemd's own."""

    code = "systemd_failed"


class SystemdOps(Protocol):
    def daemon_reload(self) -> None: ...
    def start(self, unit: str) -> None: ...
    def restart(self, unit: str) -> None: ...
    def stop(self, unit: str) -> None: ...
    def reload(self, unit: str) -> None: ...
    def is_active(self, unit: str) -> bool: ...


class Systemctl:
    """`SystemdOps` through the systemctl command."""

    def _run(self, *args: str) -> None:
        r = subprocess.run(["systemctl", *args], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise SystemdError(
                r.stderr.strip() or f"systemctl {' '.join(args)} exited {r.returncode}"
            )

    def daemon_reload(self) -> None:
        self._run("daemon-reload")

    def start(self, unit: str) -> None:
        self._run("start", unit)

    def restart(self, unit: str) -> None:
        self._run("restart", unit)

    def stop(self, unit: str) -> None:
        self._run("stop", unit)

    def reload(self, unit: str) -> None:
        self._run("reload", unit)

    def is_active(self, unit: str) -> bool:
        r = subprocess.run(["systemctl", "is-active", "--quiet", unit], check=False)
        return r.returncode == 0


# -- the index the generator leaves behind ---------------------------------------------------


def read_index(directory: Path) -> dict[str, dict[str, Any]]:
    """slug → {"addresses", "enabled", "source", "digest"} as last generated; {} if none."""
    try:
        data = json.loads((directory / units.INDEX).read_text(encoding="utf-8"))
        providers = data["providers"]
        return providers if isinstance(providers, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


# -- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    verb: str  # "stop", "start", "restart", "reload" (these two: only if active), or "note"
    units: tuple[str, ...]
    why: str


def plan(
    before: dict[str, dict[str, Any]], after: dict[str, Provider], bad: set[str]
) -> tuple[list[Action], list[Action]]:
    """(actions before daemon-reload, actions after it). Pure."""
    pre: list[Action] = []
    post: list[Action] = []
    for slug in sorted(before):
        if slug in after:
            continue
        if slug in bad:
            post.append(
                Action(
                    "note", (), f"{slug}: manifest has problems; its running units were left alone"
                )
            )
        else:
            pre.append(
                Action(
                    "stop",
                    (units.socket_unit(slug), units.front_unit(slug)),
                    f"{slug}: manifest removed",
                )
            )
    for slug, p in after.items():
        old = before.get(slug)
        new_addresses = [str(a) for a in p.addresses]
        if old is None:
            if p.enabled:
                post.append(Action("start", (units.socket_unit(slug),), f"{slug}: new provider"))
            else:
                post.append(
                    Action(
                        "note",
                        (),
                        f"{slug}: new provider, not enabled; start it with "
                        f"systemctl start {units.socket_unit(slug)}",
                    )
                )
            continue
        moved = list(old.get("addresses", [])) != new_addresses
        if p.enabled and not old.get("enabled", False):
            post.append(Action("start", (units.socket_unit(slug),), f"{slug}: enabled"))
        elif moved:
            what = f"{slug}: address {', '.join(old.get('addresses', []))} -> {', '.join(new_addresses)}"
            post.append(Action("restart", (units.socket_unit(slug),), what))
        elif not p.enabled and old.get("enabled", False):
            post.append(
                Action(
                    "note",
                    (),
                    f"{slug}: disabled; left running (systemctl stop {units.socket_unit(slug)} stops it)",
                )
            )
        if not moved and old.get("digest") not in (None, units.digest(p)):
            post.append(
                Action(
                    "note",
                    (),
                    f"{slug}: configuration changed; it applies at the next start of the "
                    f"provider (providerctl stop {slug} applies it now)",
                )
            )
    return pre, post


def _run(action: Action, systemd: SystemdOps, out: TextIO) -> bool:
    if action.verb == "note":
        out.write(action.why + "\n")
        return True
    ok = True
    done: list[str] = []
    for unit in action.units:
        try:
            if action.verb in ("restart", "reload"):
                if not systemd.is_active(unit):
                    continue
                if action.verb == "restart":
                    systemd.restart(unit)
                else:
                    systemd.reload(unit)
            elif action.verb == "start":
                systemd.start(unit)
            else:
                systemd.stop(unit)
            done.append(unit)
        except SystemdError as e:
            out.write(f"Failed to {action.verb} {unit}: {e}\n")
            ok = False
    past = {"stop": "Stopped", "start": "Started", "restart": "Restarted", "reload": "Reloaded"}[
        action.verb
    ]
    if done:
        out.write(f"{past} {', '.join(done)} ({action.why}).\n")
    return ok


def _router_dropin() -> str | None:
    path = generator_dir() / f"{ROUTER_SOCKET}.d" / ROUTER_DROPIN
    try:
        return path.read_text()
    except OSError:
        return None


def router_actions(
    before: dict[str, dict[str, Any]],
    after: dict[str, Provider],
    dropin_before: str | None,
    dropin_after: str | None,
) -> list[Action]:
    """What the router needs after a reload: its socket restarted when its address moved
    (a reload leaves a moved socket closed), and a re-read of the manifests when they
    changed. Pure."""
    out = []
    if dropin_before != dropin_after:
        out.append(Action("restart", (ROUTER_SOCKET,), "router: address changed"))
    changed = set(before) != set(after) or any(
        before[slug].get("digest") != units.digest(p) for slug, p in after.items()
    )
    if changed:
        out.append(Action("reload", (units.ROUTER_SERVICE,), "router: manifests changed"))
    return out


def reload(systemd: SystemdOps, out: TextIO) -> int:
    """Check manifests, reload systemd, and start/restart/stop what changed."""
    before = read_index(generator_dir())
    dropin_before = _router_dropin()
    found = manifests.discover()
    for line in generator.skipped_lines(found.problems):
        out.write(line + "\n")
    bad = {manifest.slug_of(Path(p.file)) for p in found.problems}
    pre, post = plan(before, found.providers, bad)
    ok = not found.problems
    for action in pre:
        ok = _run(action, systemd, out) and ok
    try:
        systemd.daemon_reload()
    except SystemdError as e:
        out.write(f"Failed to reload systemd: {e}\n")
        return 1
    out.write("Reloaded systemd.\n")
    for action in post + router_actions(before, found.providers, dropin_before, _router_dropin()):
        ok = _run(action, systemd, out) and ok
    return 0 if ok else 1


# -- generate --dry-run ----------------------------------------------------------------------


def templates_dir() -> Path | None:
    """units/ beside the package in a source tree; installed templates are found by systemd."""
    here = Path(__file__).resolve().parents[2] / "units"
    return here if (here / SOCKET_TEMPLATE_NAME).is_file() else None


def verify(providers: list[Provider], out: TextIO) -> bool:
    """Run `systemd-analyze verify` on the generated instances; True when clean or unavailable."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None or not providers:
        if providers:
            out.write("systemd-analyze not found; the units were not verified.\n")
        return True
    with tempfile.TemporaryDirectory(prefix="providerd-verify.") as tmp:
        root = Path(tmp)
        src = templates_dir()
        if src is not None:
            for t in TEMPLATES:
                shutil.copyfile(src / t, root / t)
        for line in generator.generate(providers, root):
            out.write(line + "\n")
        names = [
            n
            for p in providers
            for n in (
                units.socket_unit(p.slug),
                units.front_unit(p.slug),
                units.worker_unit(p.slug),
            )
        ]
        env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{root}:", SYSTEMD_LOG_LEVEL="warning")
        r = subprocess.run(
            [analyze, "verify", "--man=no", *names],
            capture_output=True,
            text=True,
            env=env,
            cwd=root,
            check=False,
        )
    lines = (r.stdout + r.stderr).strip().splitlines()
    # The worker runs the model's program itself: one not installed (yet) is the operator's
    # to know, not a fault of the units.
    missing = [m for m in map(_MISSING_PROGRAM.fullmatch, lines) if m]
    rest = [line for line in lines if not _MISSING_PROGRAM.fullmatch(line)]
    if rest or (r.returncode != 0 and not missing):
        out.write(
            f"Failed to verify the generated units (systemd-analyze verify exited {r.returncode}):\n"
        )
        out.write("\n".join(lines) + "\n")
        return False
    for m in missing:
        out.write(
            f"Warning: provider {m['slug']}: its command {m['path']} cannot be run here "
            f"({m['why']}); its worker fails to start until it can.\n"
        )
    out.write(f"Verified {len(names)} units with systemd-analyze.\n")
    return True


_MISSING_PROGRAM = re.compile(
    r"provider-worker@(?P<slug>[^.]+)\.service: Command (?P<path>.+) is not executable: (?P<why>.+)"
)


def dry_run(out: TextIO) -> int:
    """Print what the generator would write, `---path---` then the content; then verify."""
    found = manifests.discover()
    providers = list(found.providers.values())
    for path, content in units.render_all(providers).items():
        if isinstance(content, units.Link):
            out.write(f"---{path} -> {content.target}---\n")
        else:
            out.write(f"---{path}---\n{content}\n")
    for line in generator.skipped_lines(found.problems):
        out.write(line + "\n")
    ok = verify(providers, out)
    return 0 if ok and not found.problems else 1
