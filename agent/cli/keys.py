"""`providerctl reload`, last step: the API keys as the file says now, to what runs now.

Fronts and the router read their keys when they start (a systemd credential cannot
change while a unit runs), so without this a revoked key would keep working on a busy
provider until its front exits. Each running front gets the keys over its control socket
(`{"op": "keys"}`, hashes only, accepted from root alone) and uses them from its next
request on, its model untouched. The router holds no model: it is restarted when the
credential it started with differs from the file (the socket holds new connections
meanwhile; requests in flight get its stop grace).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import TextIO

from agent.net import rpc
from agent.spec import apikeys, paths
from agent.systemd.units import ROUTER_SERVICE

CREDENTIALS = Path("/run/credentials")


def _router_is_stale() -> bool:
    """The running router's keys credential differs from the keys file (or its absence)."""
    try:
        had = (CREDENTIALS / ROUTER_SERVICE / apikeys.CREDENTIAL).read_bytes()
    except OSError:
        return False  # not running, or not under systemd
    try:
        now = paths.keys_file().read_bytes()
    except FileNotFoundError:
        now = apikeys.ABSENT
    except OSError:
        return True
    return had != now


def push(out: TextIO, err: TextIO) -> int:
    """Hand the keys to every running front; restart a router with stale keys. Returns
    how many fronts answered with an error (0: all in force)."""
    keys = apikeys.load({})
    wire = apikeys.to_wire(keys)
    applied, failed = 0, 0
    for sock in sorted(paths.runtime_dir().glob("*/control.sock")):
        try:
            answer = rpc.call(sock, {"op": "keys", "keys": wire}, timeout=5.0)
        except rpc.NotRunning:
            continue  # it reads the keys when it starts
        except (rpc.RpcError, ValueError) as e:  # running, but the keys may not be in force
            err.write(f"providerctl: {sock.parent.name}: failed to hand over the keys: {e}\n")
            failed += 1
            continue
        if "error" in answer:
            err.write(f"providerctl: {sock.parent.name}: {answer['error']}\n")
            failed += 1
        else:
            applied += 1
    if keys is not None:
        out.write(f"API keys: {len(keys.keys)} key(s) in force in {applied} running front(s)\n")
    if _router_is_stale():
        r = subprocess.run(
            ["systemctl", "try-restart", ROUTER_SERVICE],
            capture_output=True,
            text=True,
            check=False,
        )
        if r.returncode == 0:
            out.write(f"API keys changed: restarted {ROUTER_SERVICE}\n")
        else:
            err.write(f"providerctl: Failed to restart {ROUTER_SERVICE}: {r.stderr.strip()}\n")
            failed += 1
    return failed
