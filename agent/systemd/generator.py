"""The systemd generator: manifests → drop-ins and links in the normal output dir.

Installed as /usr/lib/systemd/system-generators/providerd-generator (see
units/providerd-generator). systemd runs it at boot and on every daemon-reload
with three output directories; it writes to the first (the normal one, below
/etc and above /usr). A bad manifest is skipped with its problems logged to
/dev/kmsg (stderr where that cannot be written); every other provider is still
generated; the exit status is always 0 so the boot never fails here. Each file
is written to a temporary name and renamed, so none is ever half-written.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

from agent import atomic
from agent.atomic import link_atomic
from agent.spec import manifest, paths
from agent.spec import settings as config
from agent.spec.provider import Problem, Provider, printable
from agent.systemd import early_record, manifests, router_units, units
from agent.systemd.names import ROUTER_SOCKET

PROG = units.GENERATOR


class Log:
    """Lines to /dev/kmsg as `<3>providerd-generator[pid]: …`, or to a stream."""

    def __init__(self, kmsg: str = "/dev/kmsg", fallback: TextIO | None = None) -> None:
        self.fallback = fallback or sys.stderr
        self.fd: int | None = None
        try:
            self.fd = os.open(kmsg, os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:
            self.fd = None

    def __call__(self, message: str, level: int = 3) -> None:
        line = printable(f"{PROG}[{os.getpid()}]: {message}")  # one line, whatever names hold
        if self.fd is not None:
            try:
                os.write(self.fd, f"<{level}>{line}\n".encode())
                return
            except OSError:
                pass
        self.fallback.write(line + "\n")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def skipped_lines(problems: list[Problem]) -> list[str]:
    """Each problem, then one `Skipping …` line per manifest."""
    lines: list[str] = []
    by_file: dict[str, int] = {}
    for p in problems:
        lines.append(str(p))
        by_file[p.file] = by_file.get(p.file, 0) + 1
    for file, n in by_file.items():
        slug = manifest.slug_of(Path(file))
        what = "problem" if n == 1 else "problems"
        lines.append(
            f'Skipping provider "{slug}": {n} {what}; run "providerctl check {file}" for details'
        )
    return lines


def write_atomic(path: Path, content: str | units.Link, make_parent: bool = True) -> None:
    """Write `content` (text or a link) at `path` through a temporary name and a rename."""
    if isinstance(content, units.Link):
        link_atomic(path, content.target, make_parent=make_parent)
    else:  # under /run: no fsync, the next boot writes it afresh
        atomic.write_atomic(path, content, 0o644, durable=False, make_parent=make_parent)


def generate(
    providers: list[Provider], out: Path, rendering: manifests.Rendering | None = None
) -> list[str]:
    """Write every provider's files under `out` (those `rendering` made as they are); the
    paths that failed, with why."""
    failures: list[str] = []
    made: set[Path] = set()
    files = units.render_all(providers, rendered=rendering.of if rendering else lambda p: None)
    for path, content in files.items():
        target = out / path
        try:
            if target.parent not in made:
                target.parent.mkdir(parents=True, exist_ok=True)
                made.add(target.parent)
            write_atomic(target, content, make_parent=False)
        except OSError as e:
            failures.append(f"Failed to write {target}: {e.strerror or e}")
    return failures


Settings = config.Config | config.ConfigError  # providerd.toml, or why it could not be read


def load_settings() -> Settings:
    """providerd.toml, read once per run for the router's settings and the early records."""
    try:
        return config.load()
    except config.ConfigError as e:
        return e


def generate_early(
    providers: list[Provider], out: Path, taken: dict[str, str], settings: Settings | None
) -> list[str]:
    """The early start's record of each provider whose start its front decides
    (`agent.systemd.early_record`), from the stat of its files `taken` before they were
    read; the paths that failed, with why."""
    # Without settings the early start reads providerd.toml itself, and says what is wrong.
    headroom = settings.gpu.headroom_bytes if isinstance(settings, config.Config) else None
    failures: list[str] = []
    for provider in providers:
        text = early_record.render(provider, str(paths.config_file()), headroom, taken)
        if text is None:
            continue
        target = Path(early_record.record_path(provider.slug, str(out)))
        try:
            write_atomic(target, text)
        except OSError as e:
            failures.append(f"Failed to write {target}: {e.strerror or e}")
    return failures


def generate_router(out: Path, settings: Settings) -> list[str]:
    """The router socket's address, and its sockets.target link when enabled, from
    providerd.toml (`settings`); the lines to log. Without the file (or with a bad one) the
    socket keeps the default address of its static unit."""
    if isinstance(settings, config.ConfigError):
        return [str(p) for p in settings.problems] + [
            f"Skipping the router's settings: {ROUTER_SOCKET} keeps its default address"
        ]
    if settings.source is None:
        return []
    try:
        files = router_units.render_router(settings)
    except units.Unrenderable as e:
        return [
            f"{settings.source}: {e}",
            f"Skipping the router's settings: {ROUTER_SOCKET} keeps its default address",
        ]
    failures = []
    for path, content in files.items():
        try:
            write_atomic(out / path, content)
        except OSError as e:
            failures.append(f"Failed to write {out / path}: {e.strerror or e}")
    return failures


def main(argv: list[str], log: Log | None = None) -> int:
    """The generator: `argv` is what follows the program name (normal [early late])."""
    log = log or Log()
    try:
        if not argv:
            log("Failed to run: expected the output directory as the first argument")
            return 0
        out = Path(argv[0])
        settings: Settings | None = None
        try:
            settings = load_settings()
            for line in generate_router(out, settings):
                log(line)
        except Exception as e:  # never fail the boot; the providers still get their units
            log(f"Failed to generate the router's settings: {e}")
        try:
            # Before the manifests are read: a change from here on makes a record not match.
            taken = early_record.snapshot([str(d) for d in paths.manifest_dirs()])
            found, rendering = manifests.discover_rendered()  # each file is its own boundary
        except Exception as e:  # never fail the boot
            log(f"Failed to read manifests: {e}")
            return 0
        for line in skipped_lines(found.problems):
            log(line)
        providers = list(found.providers.values())
        for line in generate(providers, out, rendering):
            log(line)
        try:
            for line in generate_early(providers, out, taken, settings):
                log(line)
        except Exception as e:  # the early start then validates each manifest itself
            log(f"Failed to write the early start's records: {e}")
        return 0
    finally:
        log.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
