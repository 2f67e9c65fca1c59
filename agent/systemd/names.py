"""The names of providerd's units and where their templates live: spelt here once.

Per provider three instances of the templates under `units/`: the socket (PID 1 holds the
listening addresses), the front (socket-activated; holds connections and starts the
worker) and the worker (the model's own server). The router and the metrics service have
static units. Pure: no I/O.
"""

from __future__ import annotations

UNIT_DIR = "/lib/systemd/system"
GENERATOR = "providerd-generator"
DROPIN = "50-manifest.conf"  # the generator's drop-in for each provider unit
ROUTER_DROPIN = (
    "50-config.conf"  # the generator's drop-in for the router's socket, from providerd.toml
)

SOCKET_TEMPLATE_NAME = "provider@.socket"
FRONT_TEMPLATE_NAME = "provider@.service"
WORKER_TEMPLATE_NAME = "provider-worker@.service"
TEMPLATES = (SOCKET_TEMPLATE_NAME, FRONT_TEMPLATE_NAME, WORKER_TEMPLATE_NAME)
SOCKET_TEMPLATE = f"{UNIT_DIR}/{SOCKET_TEMPLATE_NAME}"
FRONT_TEMPLATE = f"{UNIT_DIR}/{FRONT_TEMPLATE_NAME}"

ROUTER_SOCKET = "providerd-router.socket"
ROUTER_SERVICE = "providerd-router.service"
METRICS_SOCKET = "providerd-metrics.socket"


def socket_unit(slug: str) -> str:
    return f"provider@{slug}.socket"


def front_unit(slug: str) -> str:
    return f"provider@{slug}.service"


def worker_unit(slug: str) -> str:
    return f"provider-worker@{slug}.service"
