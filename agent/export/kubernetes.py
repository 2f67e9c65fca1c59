"""`Provider` → the Kubernetes objects that carry it, and what they cannot carry.

The target is KEDA with its HTTP add-on (0.14 or later) behind a Gateway API gateway
(docs/kubernetes.md). Per provider: a Deployment, a Service, the add-on's
InterceptorRoute, a KEDA ScaledObject and, for `isolation.network = "private"`, a
NetworkPolicy. Once per export: the HTTPRoute(s) of the model endpoint and the
ReferenceGrant that lets them reach the add-on's interceptor in its own namespace.

Every key the engine cannot carry becomes a `Loss`. A loss that would silently weaken a
guarantee (`weakens`) refuses the provider unless `lossy` is set; a `hard` one refuses it
in any case. Pure: no I/O, and output depends only on the input (same bytes every run).

Why this module is over 400 lines: it is the one table of what each manifest key becomes
in Kubernetes, or why it cannot; the objects' shapes are in k8s_workload.py, the
fixed values in k8s_values.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import MISSING, dataclass, field, fields

from agent.export.k8s_values import (
    DEFAULT_PORT,
    INTERCEPTOR_LABELS,
    INTERCEPTOR_PORT,
    INTERCEPTOR_SERVICE,
    KEDA_NAMESPACE,
    MAX_HEADER_VALUE,
    MAX_MATCHES_PER_ROUTE,
    MAX_MATCHES_PER_RULE,
    MAX_RULES,
    MODEL_HEADER,
    PROVIDER_HEADER,
    SCALER_ADDRESS,
    GpuSharing,
    Loss,
    Obj,
    Options,
    duration,
    meta,
    object_name,
    python_only_regex,
    selector,
)
from agent.export.k8s_workload import deployment
from agent.spec.keys import KEYS
from agent.spec.provider import Address, Problem, Provider

__all__ = ["Export", "GpuSharing", "Options", "export", "file_name"]

_DEFAULTS = {f.name: f.default for f in fields(Provider) if f.default is not MISSING}
KEY_ORDER = {k.dotted: i for i, k in enumerate(KEYS)}


@dataclass
class Exported:
    """The objects of one provider, or why it was refused."""

    provider: Provider
    name: str
    objects: list[Obj]
    losses: list[Loss]
    refused: bool = False
    matches: list[Obj] = field(default_factory=list)  # its HTTPRoute matches


@dataclass
class Export:
    objects: list[Obj]  # in output order
    lines: list[Problem]  # one per loss, in provider order, then in key-table order
    refused: list[str]  # slugs of providers left out


# -- one provider --------------------------------------------------------------------------


def _changed(p: Provider, name: str) -> bool:
    return bool(getattr(p, name) != _DEFAULTS.get(name))


def _service_ports(p: Provider, port: int, losses: list[Loss]) -> list[int]:
    ports: list[int] = []
    unix = [a for a in p.addresses if a.is_unix]
    local = [a for a in p.addresses if not a.is_unix and _loopback(a)]
    for a in p.addresses:
        if a.port is not None and a.port not in ports:
            ports.append(a.port)
    if unix:
        losses.append(
            Loss(
                "listen.address",
                f'the unix socket "{unix[0]}" and its file permissions; clients reach the '
                f"provider through the gateway (Service port {ports[0] if ports else port})",
            )
        )
    if local:
        losses.append(
            Loss(
                "listen.address",
                f'"{local[0]}" admits only clients on this host; in the cluster any client of '
                "the gateway reaches the provider (restrict access at the Gateway)",
            )
        )
    return ports or [port]


def _loopback(a: Address) -> bool:
    return a.host is not None and (a.host.startswith("127.") or a.host == "::1")


def _service(name: str, opts: Options, ports: list[int]) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(name, opts),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(name),
            "ports": [
                {
                    "name": "http" if i == 0 else f"http-{i + 1}",
                    "port": port,
                    "targetPort": "http",
                    "protocol": "TCP",
                }
                for i, port in enumerate(ports)
            ],
        },
    }


def _interceptor_route(p: Provider, name: str, opts: Options, port: int) -> Obj:
    return {
        "apiVersion": "http.keda.sh/v1beta1",
        "kind": "InterceptorRoute",
        "metadata": meta(name, opts),
        "spec": {
            "target": {"service": name, "port": port},
            # Any host ("*" is the add-on's catch-all), this provider's header.
            "rules": [{"hosts": ["*"], "headers": [{"name": PROVIDER_HEADER, "value": p.slug}]}],
            "scalingMetric": {"concurrency": {"targetValue": 100}},
            "timeouts": {
                "readiness": duration(p.start_timeout_s),
                "responseHeader": duration(p.request_timeout_s),
            },
        },
    }


def _scaled_object(p: Provider, name: str, opts: Options) -> Obj:
    notes = None if p.enabled else {"autoscaling.keda.sh/paused-replicas": "0"}
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": meta(name, opts, notes),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": 0,
            "maxReplicaCount": 1,
            "cooldownPeriod": max(1, math.ceil(p.idle_timeout_s)),
            "triggers": [
                {
                    "type": "external-push",
                    "metadata": {"scalerAddress": SCALER_ADDRESS, "interceptorRoute": name},
                }
            ],
        },
    }


def _network_policy(name: str, opts: Options) -> Obj:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(name, opts),
        "spec": {
            "podSelector": {"matchLabels": selector(name)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": KEDA_NAMESPACE}
                            },
                            "podSelector": {"matchLabels": dict(INTERCEPTOR_LABELS)},
                        }
                    ],
                    "ports": [{"port": "http", "protocol": "TCP"}],
                }
            ],
            "egress": [],
        },
    }


def _matches(p: Provider, losses: list[Loss]) -> list[Obj]:
    def header(name: str, value: str, kind: str = "Exact") -> Obj:
        return {"headers": [{"type": kind, "name": name, "value": value}]}

    out = [header(PROVIDER_HEADER, p.slug)]
    for n in p.model_names:
        if len(n) > MAX_HEADER_VALUE:
            losses.append(
                Loss("models.names", f"a name longer than {MAX_HEADER_VALUE} characters", hard=True)
            )
            continue
        out.append(header(MODEL_HEADER, n))
    for pat in p.model_patterns:
        anchored = f"^(?:{pat})$"
        why = python_only_regex(pat)
        if why is not None:
            losses.append(
                Loss(
                    "models.patterns",
                    f'"{pat}" uses {why}, which RE2-style gateways do not run '
                    "(with --lossy the pattern is left out)",
                    weakens=True,
                )
            )
            continue
        if len(anchored) > MAX_HEADER_VALUE:
            losses.append(
                Loss(
                    "models.patterns",
                    f"a pattern longer than {MAX_HEADER_VALUE - 6} characters",
                    hard=True,
                )
            )
            continue
        out.append(header(MODEL_HEADER, anchored, "RegularExpression"))
    if p.model_patterns:
        losses.append(
            Loss(
                "models.patterns",
                "matching is the gateway's RegularExpression dialect (implementation-specific), "
                "and a name that two providers' patterns match goes to one of them instead of "
                "the 409 model_ambiguous answer",
            )
        )
    return out


def _other_losses(p: Provider, losses: list[Loss]) -> None:
    if p.protocol == "tcp":
        losses.append(
            Loss(
                "listen.protocol",
                'opaque TCP ("tcp"): the add-on\'s interceptor speaks HTTP only '
                "(with --lossy the provider is exported as HTTP)",
                weakens=True,
            )
        )
    if p.allow:
        losses.append(
            Loss(
                "listen.allow",
                "the client allow-list: the worker sees only the interceptor, so a "
                "NetworkPolicy cannot tell clients apart (restrict clients at the Gateway)",
                weakens=True,
            )
        )
    if p.network == "host":
        losses.append(
            Loss(
                "isolation.network",
                'the host network keeps the worker on its own loopback address ("{host}"), '
                "denied every other; as a hostNetwork pod it listens on the node's addresses, "
                "reachable by anything that reaches the node, and no NetworkPolicy applies",
                weakens=True,
            )
        )
    if p.credentials:
        names = ", ".join(name for name, _ in p.credentials)
        losses.append(
            Loss(
                "runtime.credentials",
                f"the credentials ({names}) are files on this host; give the pod a Secret "
                "with them (with --lossy the provider is exported without them)",
                weakens=True,
            )
        )
    if _changed(p, "max_held"):
        losses.append(
            Loss(
                "listen.max_held", "the bound on held connections: the interceptor holds any number"
            )
        )
    losses.append(
        Loss(
            "runtime.request_timeout_s",
            "the limit on the whole response: it bounds the time to the response's headers "
            "(InterceptorRoute timeouts.responseHeader)",
        )
    )
    if p.idle_ignore_paths:
        paths = ", ".join(p.idle_ignore_paths)
        losses.append(
            Loss(
                "runtime.idle_ignore_paths",
                f"requests to {paths} keep the model up as well (the add-on counts every request)",
            )
        )
    if p.pinned:
        losses.append(
            Loss("runtime.pinned", "pinning: the add-on scales an idle model to zero all the same")
        )
    if p.preload:
        losses.append(Loss("runtime.preload", "loading at boot: the first request loads the model"))
    if p.gpu_priority:
        losses.append(
            Loss("gpu.priority", "GPU admission priorities: the scheduler places pods on its own")
        )


def export_provider(p: Provider, opts: Options) -> Exported:
    name = object_name(p.slug)
    port = p.worker_port or DEFAULT_PORT
    losses: list[Loss] = []
    _other_losses(p, losses)
    ports = _service_ports(p, port, losses)
    objects = [deployment(p, name, opts, port, losses), _service(name, opts, ports)]
    objects.append(_interceptor_route(p, name, opts, ports[0]))
    objects.append(_scaled_object(p, name, opts))
    if p.network == "private":
        objects.append(_network_policy(name, opts))
    matches = _matches(p, losses)
    refused = any(x.hard or (x.weakens and not opts.lossy) for x in losses)
    return Exported(p, name, [] if refused else objects, losses, refused, matches)


# -- the model endpoint ----------------------------------------------------------------------


def _rules(done: list[Exported], opts: Options) -> Iterator[Obj]:
    for e in done:
        for i in range(0, len(e.matches), MAX_MATCHES_PER_RULE):
            rule_timeout = duration(e.provider.start_timeout_s + e.provider.request_timeout_s)
            yield {
                "matches": e.matches[i : i + MAX_MATCHES_PER_RULE],
                "filters": [
                    {
                        "type": "RequestHeaderModifier",
                        "requestHeaderModifier": {
                            "set": [{"name": PROVIDER_HEADER, "value": e.provider.slug}]
                        },
                    }
                ],
                "backendRefs": [
                    {
                        "name": INTERCEPTOR_SERVICE,
                        "namespace": KEDA_NAMESPACE,
                        "port": INTERCEPTOR_PORT,
                    }
                ],
                "timeouts": {"request": rule_timeout},
            }


def routes(done: list[Exported], opts: Options) -> list[Obj]:
    """The model endpoint's HTTPRoute(s): as few as Gateway API's size rules allow."""
    groups: list[list[Obj]] = []
    count = 0
    for rule in _rules(done, opts):
        n = len(rule["matches"])
        if not groups or len(groups[-1]) == MAX_RULES or count + n > MAX_MATCHES_PER_ROUTE:
            groups.append([])
            count = 0
        groups[-1].append(rule)
        count += n
    out = []
    for i, rules in enumerate(groups):
        name = "providerd-models" if i == 0 else f"providerd-models-{i + 1}"
        out.append(
            {
                "apiVersion": "gateway.networking.k8s.io/v1",
                "kind": "HTTPRoute",
                "metadata": {
                    "name": name,
                    "namespace": opts.namespace,
                    "labels": {
                        "app.kubernetes.io/part-of": "providerd",
                        "app.kubernetes.io/managed-by": "providerctl",
                    },
                },
                "spec": {"parentRefs": [_parent(opts)], "rules": rules},
            }
        )
    return out


def _parent(opts: Options) -> Obj:
    namespace, _, name = opts.gateway.rpartition("/")
    return {"name": name, "namespace": namespace} if namespace else {"name": name}


def reference_grant(opts: Options) -> Obj:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1beta1",
        "kind": "ReferenceGrant",
        "metadata": {
            "name": f"providerd-{opts.namespace}",
            "namespace": KEDA_NAMESPACE,
            "labels": {
                "app.kubernetes.io/part-of": "providerd",
                "app.kubernetes.io/managed-by": "providerctl",
            },
        },
        "spec": {
            "from": [
                {
                    "group": "gateway.networking.k8s.io",
                    "kind": "HTTPRoute",
                    "namespace": opts.namespace,
                }
            ],
            "to": [{"group": "", "kind": "Service", "name": INTERCEPTOR_SERVICE}],
        },
    }


# -- everything ------------------------------------------------------------------------------


def _line(p: Provider, loss: Loss, opts: Options) -> Problem:
    text = f"not carried by Kubernetes: {loss.what}"
    if loss.hard:
        text += f'; "{p.slug}" is not exported'
    elif loss.weakens and opts.lossy:
        text += "; given up (--lossy)"
    elif loss.weakens:
        text += f'; refusing to export "{p.slug}" (--lossy exports it without this)'
    return Problem(str(p.source), loss.key, text)


def _collisions(providers: list[Provider]) -> dict[str, Problem]:
    by_name: dict[str, list[Provider]] = {}
    for p in providers:
        by_name.setdefault(object_name(p.slug), []).append(p)
    out: dict[str, Problem] = {}
    for name, same in by_name.items():
        for p in same if len(same) > 1 else []:
            others = ", ".join(f'"{q.slug}"' for q in same if q is not p)
            out[p.slug] = Problem(
                str(p.source),
                "",
                f'its Kubernetes name "{name}" is also the name of provider {others}; '
                "rename one of them",
            )
    return out


def export(providers: list[Provider], opts: Options) -> Export:
    """Every provider's objects (sorted by slug), then the model endpoint's."""
    providers = sorted(providers, key=lambda p: p.slug)
    collisions = _collisions(providers)
    lines: list[Problem] = []
    refused: list[str] = []
    done: list[Exported] = []
    objects: list[Obj] = []
    for p in providers:
        if p.slug in collisions:
            lines.append(collisions[p.slug])
            refused.append(p.slug)
            continue
        e = export_provider(p, opts)
        ordered = sorted(e.losses, key=lambda x: KEY_ORDER.get(x.key, len(KEY_ORDER)))
        lines += [_line(p, x, opts) for x in ordered]
        if e.refused:
            refused.append(p.slug)
            continue
        done.append(e)
        objects += e.objects
    if done:
        objects += routes(done, opts)
        if opts.namespace != KEDA_NAMESPACE:
            objects.append(reference_grant(opts))
    return Export(objects, lines, refused)


def file_name(obj: Obj) -> str:
    """`<name>.<kind>.yaml`, unique within one export."""
    return f"{obj['metadata']['name']}.{obj['kind'].lower()}.yaml"
