"""What the Kubernetes export shares: its options, a `Loss`, the constants of the add-on it
targets, and the conversions from manifest values to Kubernetes names and quantities. Pure.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from agent.spec.sizes import KUBERNETES_SUFFIXES, format_size

GpuSharing = Literal["whole", "hami"]
Obj = dict[str, Any]

# The KEDA HTTP add-on as its Helm chart installs it (docs/kubernetes.md).
KEDA_NAMESPACE = "keda"
INTERCEPTOR_SERVICE = "keda-add-ons-http-interceptor-proxy"
INTERCEPTOR_PORT = 8080
INTERCEPTOR_LABELS = {
    "app.kubernetes.io/component": "interceptor",
    "app.kubernetes.io/name": "http-add-on",
}
SCALER_ADDRESS = f"keda-add-ons-http-external-scaler.{KEDA_NAMESPACE}:9090"

# The header the gateway's body-to-header step fills with the request's "model", and the
# one that selects a provider (set by the HTTPRoute, matched by the InterceptorRoute).
MODEL_HEADER = "X-Gateway-Model-Name"
PROVIDER_HEADER = "X-Providerd-Provider"

DEFAULT_PORT = 8080  # the worker's port when the manifest lets the front choose one
STARTUP_PERIOD_S = 2
MAX_RULES, MAX_MATCHES_PER_RULE, MAX_MATCHES_PER_ROUTE = 16, 64, 128
MAX_HEADER_VALUE = 4096

_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@dataclass(frozen=True)
class Options:
    image: str
    namespace: str = "default"
    gpu_sharing: GpuSharing = "whole"
    lossy: bool = False
    gateway: str = "providerd"


@dataclass(frozen=True)
class Loss:
    """One thing a key means that the export cannot carry."""

    key: str
    what: str
    weakens: bool = False  # refuses unless --lossy
    hard: bool = False  # refuses even with --lossy


# -- names and values ----------------------------------------------------------------------


def object_name(slug: str) -> str:
    """The slug as a DNS-1035 label (Service names must be one)."""
    name = slug.replace("_", "-")
    if not name[:1].isalpha():
        name = "p-" + name
    if name.endswith("-"):
        name += "x"
    return name


def is_dns_label(text: str) -> bool:
    return len(text) <= 63 and _DNS_LABEL.fullmatch(text) is not None


def escape_dollars(text: str) -> str:
    """`$` → `$$`, so that Kubernetes' `$(VAR)` expansion gives back `text` unchanged."""
    return text.replace("$", "$$")


def duration(seconds: float) -> str:
    """Whole seconds, rounded up, as a Gateway API / Go duration ("15m", "1h30m5s")."""
    total = max(1, math.ceil(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(hours, "h"), (minutes, "m"), (secs, "s")]
    return "".join(f"{n}{unit}" for n, unit in parts if n) or "0s"


def memory_quantity(size: int) -> str:
    return format_size(size, KUBERNETES_SUFFIXES)


def cpu_quantity(percent: int) -> str:
    return str(percent // 100) if percent % 100 == 0 else f"{percent * 10}m"


def mebibytes(gib: float) -> int:
    return math.ceil(gib * 1024)


def python_only_regex(pattern: str) -> str | None:
    """What in `pattern` an RE2-style gateway cannot run, or None."""
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 < n and pattern[i + 1] in "123456789":
                return "a backreference"
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern.startswith("[]", i) or pattern.startswith("[^]", i):
                i += 2 if pattern[i + 1] == "]" else 3
                continue
        elif c == "(" and pattern.startswith("(?", i):
            rest = pattern[i + 2 : i + 4]
            if rest[:1] in ("=", "!") or rest in ("<=", "<!"):
                return "a lookaround"
            if rest[:1] == ">" or rest.startswith("P="):
                return "an atomic group" if rest[:1] == ">" else "a backreference"
        elif c in "*+?}" and i + 1 < n and pattern[i + 1] == "+":
            return "a possessive quantifier"
        i += 1
    return None


# -- metadata ------------------------------------------------------------------------------


def labels(name: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": name,
        "app.kubernetes.io/part-of": "providerd",
        "app.kubernetes.io/managed-by": "providerctl",
    }


def selector(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "providerd"}


def meta(name: str, opts: Options, extra: Obj | None = None) -> Obj:
    meta: Obj = {"name": name, "namespace": opts.namespace, "labels": labels(name)}
    if extra:
        meta["annotations"] = extra
    return meta
