"""providerctl: systemctl-like verbs for providerd.

Exit codes follow systemctl's: 0 ok, 1 failure, 2 usage, 3 inactive, 4 no such provider.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn, TextIO

from agent import __version__
from agent.errors import ProviderdError
from agent.front.status import STATUS_VERSION, ProviderStatus, inactive
from agent.net import counters, rpc
from agent.spec import paths
from agent.spec.provider import Provider
from agent.spec.sizes import approx_size
from agent.systemd import names, preload

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INACTIVE, EXIT_NO_SUCH = 0, 1, 2, 3, 4


class Usage(ProviderdError):
    """A command line argparse refuses; the message is argparse's."""

    code = "usage"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise Usage(message)


def fail(message: str, hint: str | None = None, code: int = EXIT_FAILURE) -> int:
    print(f"providerctl: {message}", file=sys.stderr)
    if hint:
        print(f"Hint: {hint}", file=sys.stderr)
    return code


def systemd_booted() -> bool:
    return os.path.isdir("/run/systemd/system")


# ---------------------------------------------------------------------------- verbs


def cmd_check(args: argparse.Namespace) -> int:
    from agent.cli.check import main_check

    return main_check(args.paths, sys.stdout, sys.stderr)


def cmd_export(args: argparse.Namespace) -> int:
    from agent.export.main import UsageError, main_export, options

    try:
        opts = options(args.image, args.namespace, args.gpu_sharing, args.lossy, args.gateway)
    except UsageError as e:
        return fail(str(e), "'providerctl export --help' lists the options", EXIT_USAGE)
    return main_export(args.paths, opts, args.output, sys.stdout, sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    from agent.systemd.reload import dry_run

    if not args.dry_run:
        return fail(
            "generate only previews; systemd runs the generator itself",
            "use 'providerctl generate --dry-run', then 'providerctl reload' to apply",
            EXIT_USAGE,
        )
    return dry_run(sys.stdout)


def cmd_reload(args: argparse.Namespace) -> int:
    from agent.cli.keys import push
    from agent.systemd.reload import Systemctl, reload

    if not systemd_booted():
        return fail(
            "systemd is not running on this host; there is nothing to reload",
            "run providers in the foreground with 'providerctl serve PATH...'",
        )
    rc = reload(Systemctl(), sys.stdout)
    if push(sys.stdout, sys.stderr) and rc == 0:  # keys: to the fronts that run now
        rc = 1
    return rc


def _discover() -> tuple[dict[str, Provider], list[str], int]:
    """Providers from the manifests, the fronts that answer on a control socket, and how
    many manifest files have problems."""
    from agent.systemd.manifests import discover

    found = discover()
    running = sorted(
        p.parent.name for p in paths.runtime_dir().glob("*/control.sock") if p.is_socket()
    )
    broken = len({problem.file for problem in found.problems})
    return dict(found.providers), running, broken


def print_no_providers(broken: int, out: TextIO) -> None:
    """What `status` says when there is nothing to show: where manifests go."""
    dirs = paths.manifest_dirs()
    where = " or ".join(str(d) for d in dirs) or "no manifest directory"
    if broken:
        print(f"No providers: {broken} manifest(s) in {where} have problems.", file=out)
        print("Hint: 'providerctl check' lists them.", file=out)
        return
    print(f"No providers: no manifests in {where}.", file=out)
    first = dirs[0] if dirs else paths.MANIFEST_DIRS[0]
    print(
        f"Hint: declare one in {first}/<slug>.toml (see provider.toml(5)), "
        "then run 'providerctl reload'.",
        file=out,
    )


def _unit_active(unit: str) -> str:
    if not systemd_booted() or shutil.which("systemctl") is None:
        return "unknown"
    result = subprocess.run(
        ["systemctl", "is-active", unit], capture_output=True, text=True, check=False
    )
    return result.stdout.strip() or "unknown"


def provider_status(slug: str, provider: Provider | None) -> ProviderStatus:
    """One provider's status: from its front when it runs, else what the manifest says."""
    try:
        answer = rpc.call(paths.control_socket(slug), {"op": "status"}, timeout=5)
        record = replace(ProviderStatus.from_json(answer), front="running")
    except rpc.RpcError:
        pinned = bool(provider is not None and provider.pinned)
        record = inactive(slug, pinned, counters.read(slug))
    record = replace(record, preloaded=preload.read(slug))
    if provider is not None:
        listen = [str(a) for a in provider.addresses]
        socket = _unit_active(names.socket_unit(slug))
        record = record.with_manifest(listen, provider.description, socket)
    return record


def _size(n: int | None) -> str:
    return "-" if n is None else approx_size(n)


def print_status(status: ProviderStatus, out: TextIO) -> None:
    dot = {"ready": "●", "starting": "◐", "backoff": "x"}.get(status.state, "○")
    title = f"{dot} {status.slug}"
    if status.description:
        title += f" — {status.description}"
    print(title, file=out)
    if status.listen:
        sock = status.socket or "unknown"
        sock_text = "" if sock == "unknown" else f" (socket {sock})"
        print(f"      Listen: {', '.join(status.listen)}{sock_text}", file=out)
    line = f"{status.state}, {status.in_flight} in flight, {status.waiting} waiting"
    if status.served is not None:
        line += f", {status.served} served"
    if status.idle_for_s is not None:
        line += f", idle for {status.idle_for_s:g} s"
    print(f"       State: {line}", file=out)
    if status.failure:
        retry = status.retry_after_s
        extra = f" (next try in {retry:g} s)" if retry else ""
        print(f"     Failure: {status.failure}{extra}", file=out)
    if status.last_start:
        ls = status.last_start
        ago = time.time() - ls["at"]
        print(f"  Last start: {ago:.0f} s ago, took {ls['took_s']:g} s ({ls['result']})", file=out)
    if status.preloaded:
        pl = status.preloaded
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(pl.get("at") or 0))
        took = pl.get("took_s")
        took_text = f", took {took:g} s" if isinstance(took, (int, float)) else ""
        print(f"   Preloaded: at boot, {when}{took_text} ({pl.get('result')})", file=out)
    if status.pinned:
        print(
            "      Pinned: never released when idle, never retired for another provider", file=out
        )
    memory = status.memory
    if memory.current is not None or memory.max is not None:
        limit = f" (max {_size(memory.max)})" if memory.max else ""
        print(f"      Memory: {_size(memory.current)}{limit}", file=out)
    gpu = status.gpu
    if gpu:
        used = _size(gpu.get("used_bytes"))
        budget = _size(gpu.get("budget_bytes"))
        peak = _size(gpu.get("peak_bytes"))
        cards = ", ".join(gpu.get("uuids", [])) or "-"
        print(f"         GPU: {cards}; VRAM {used} used, budget {budget}, peak {peak}", file=out)


def cmd_status(args: argparse.Namespace) -> int:
    providers, running, broken = _discover()
    slugs = args.slugs or sorted(set(providers) | set(running))
    for slug in args.slugs:
        if slug not in providers and slug not in running:
            return fail(f"no such provider: {slug}", "'providerctl check' lists them", EXIT_NO_SUCH)
    statuses = [provider_status(slug, providers.get(slug)) for slug in slugs]
    cards = _gpu_cards()
    if args.json:
        providers_json = [s.to_json() for s in statuses]
        doc = {"version": STATUS_VERSION, "providers": providers_json, "gpus": cards}
        json.dump(doc, sys.stdout, indent=2)
        print()
    else:
        if not statuses:
            print_no_providers(broken, sys.stdout)
        for i, record in enumerate(statuses):
            if i:
                print()
            print_status(record, sys.stdout)
        for card in cards:
            holders = ", ".join(card.get("held_by", [])) or "nobody"
            print(
                f"\nGPU {card['index']} {card.get('name', '')} {card['uuid']}: "
                f"{_size(card['free_bytes'])} free of {_size(card['total_bytes'])}, held by {holders}"
            )
    if args.slugs and all(s.state == "inactive" for s in statuses):
        return EXIT_INACTIVE
    return EXIT_OK


def _gpu_cards() -> list[dict[str, Any]]:
    try:
        from agent.gpu.admission import cards_status
    except ImportError:
        return []
    return cards_status()


def cmd_warm(args: argparse.Namespace) -> int:
    providers, running, _ = _discover()
    slug = args.slug
    if slug not in providers and slug not in running:
        return fail(f"no such provider: {slug}", "'providerctl check' lists them", EXIT_NO_SUCH)
    sock = paths.control_socket(slug)
    if slug not in running:
        if not systemd_booted():
            return fail(f"{slug} is not being served", "start it with 'providerctl serve PATH...'")
        front = names.front_unit(slug)
        result = subprocess.run(["systemctl", "start", front], check=False)
        if result.returncode != 0:
            return fail(f"failed to start {front}")
        # Polling is the only way here: the control socket is the front's (another
        # process), which creates it just after READY=1, the point where `systemctl
        # start` returns, and the standard library has nothing (no inotify) to wait on
        # for a file to appear.
        for _ in range(100):
            if sock.is_socket():
                break
            time.sleep(0.05)
    try:
        answer = rpc.call(sock, {"op": "warm"}, timeout=3600)
    except rpc.RpcError as e:
        return fail(f"failed to warm {slug}: {e}")
    if answer.get("state") != "ready":
        return fail(f"failed to warm {slug}: {answer.get('error') or answer.get('state')}")
    print(f"{slug}: ready")
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    providers, running, _ = _discover()
    slug = args.slug
    if slug not in providers and slug not in running:
        return fail(f"no such provider: {slug}", "'providerctl check' lists them", EXIT_NO_SUCH)
    if slug not in running:
        print(f"{slug}: not running")
        return EXIT_OK
    request: dict[str, Any] = {"op": "stop"}
    if args.grace is not None:
        request["grace_s"] = args.grace
    try:
        answer = rpc.call(paths.control_socket(slug), request, timeout=(args.grace or 300) + 120)
    except rpc.RpcError as e:
        return fail(f"failed to stop {slug}: {e}")
    cut = answer.get("cut", 0)
    print(f"{slug}: released" + (f" ({cut} request(s) cut after the grace period)" if cut else ""))
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    if shutil.which("journalctl") is None:
        return fail("journalctl is not available on this host")
    argv = [
        "journalctl",
        "-u",
        names.front_unit(args.slug),
        "-u",
        names.worker_unit(args.slug),
    ]
    if args.follow:
        argv.append("-f")
    os.execvp(argv[0], argv)


def cmd_serve(args: argparse.Namespace) -> int:
    from agent.cli.serve import serve
    from agent.log import setup
    from agent.net import loop
    from agent.systemd.manifests import check_paths

    setup(journal=False, verbose=args.verbose)
    found = check_paths([Path(p) for p in args.paths])
    for problem in found.problems:
        print(problem, file=sys.stderr)
    if not found.providers:
        return fail("no valid provider to serve", "'providerctl check PATH...' explains why")
    if found.problems:
        print("providerctl: serving the valid providers only", file=sys.stderr)
    try:
        return loop.run(serve(list(found.providers.values())))
    except KeyboardInterrupt:
        return EXIT_OK


# ---------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="providerctl", description="Serve GPU model providers on demand.")
    p.add_argument("--version", action="version", version=f"providerd {__version__}")
    sub = p.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)

    s = sub.add_parser("check", help="validate manifests, every problem one line")
    s.add_argument("paths", nargs="*", metavar="PATH", help="manifest files or directories")
    s.set_defaults(func=cmd_check)

    s = sub.add_parser("generate", help="print what the generator would write")
    s.add_argument("--dry-run", action="store_true", help="print, verify, write nothing")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("export", help="write the manifests as objects of another engine")
    s.add_argument("engine", choices=["kubernetes"], help="the engine: kubernetes")
    s.add_argument("paths", nargs="*", metavar="PATH", help="manifest files or directories")
    s.add_argument("--image", required=True, help="the container image that runs the worker")
    s.add_argument("--namespace", default="default", metavar="NS", help="the objects' namespace")
    s.add_argument("--gpu-sharing", choices=["whole", "hami"], default="whole", help="GPU kind")
    s.add_argument(
        "--gateway", default="providerd", metavar="[NS/]NAME", help="the Gateway the route joins"
    )
    s.add_argument("--lossy", action="store_true", help="export what weakens a guarantee")
    s.add_argument("-o", "--output", metavar="DIR", help="one file per object in DIR")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser("reload", help="apply manifest changes to systemd")
    s.set_defaults(func=cmd_reload)

    s = sub.add_parser("status", help="state, requests, GPU and memory of providers")
    s.add_argument("slugs", nargs="*", metavar="SLUG")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("warm", help="load a provider's model now and hold it until idle")
    s.add_argument("slug", metavar="SLUG")
    s.set_defaults(func=cmd_warm)

    s = sub.add_parser("stop", help="release a provider now, letting requests finish")
    s.add_argument("slug", metavar="SLUG")
    s.add_argument("--grace", type=float, metavar="S", help="seconds to wait for requests")
    s.set_defaults(func=cmd_stop)

    s = sub.add_parser("logs", help="the front's and the worker's journal in one view")
    s.add_argument("slug", metavar="SLUG")
    s.add_argument("-f", "--follow", action="store_true")
    s.set_defaults(func=cmd_logs)

    s = sub.add_parser("serve", help="run providers in the foreground, without systemd")
    s.add_argument("paths", nargs="+", metavar="PATH", help="manifest files or directories")
    s.add_argument("-v", "--verbose", action="store_true")
    s.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except Usage as e:
        return fail(str(e), "'providerctl --help' lists the verbs", EXIT_USAGE)
    if args.verb is None:
        parser().print_help()
        return EXIT_USAGE
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except ProviderdError as e:  # one of ours a verb did not handle: its message and hint
        return fail(e.message, e.hint)
    return code


if __name__ == "__main__":
    sys.exit(main())
