"""The workload of one provider: its Deployment (container, command, probes, resources,
GPU, weights), and the losses found on the way. Pure.
"""

from __future__ import annotations

import math

from agent.export.k8s_values import (
    STARTUP_PERIOD_S,
    Loss,
    Obj,
    Options,
    cpu_quantity,
    escape_dollars,
    labels,
    mebibytes,
    memory_quantity,
    meta,
    selector,
)
from agent.spec.placeholders import fill_placeholders, placeholder_values
from agent.spec.provider import Provider


def _command(p: Provider, port: int, losses: list[Loss]) -> list[str] | None:
    if p.launch is not None:
        losses.append(
            Loss(
                "runtime.launch",
                f'the worker wrapper resolves "{p.launch}" to the command when the worker '
                "starts; Kubernetes has no such step (with --lossy the image's own entrypoint runs)",
                weakens=True,
            )
        )
        return None
    values = placeholder_values(port=str(port), host="0.0.0.0", slug=p.slug, python="python3")
    return [escape_dollars(fill_placeholders(a, values)) for a in p.command]


def _probes(p: Provider, losses: list[Loss]) -> dict[str, Obj]:
    if p.ready.kind == "notify":
        losses.append(
            Loss(
                "runtime.ready",
                'the model\'s own READY=1 ("notify") has no Kubernetes equivalent '
                "(with --lossy the port is probed over TCP instead)",
                weakens=True,
            )
        )
    action: Obj = (
        {"httpGet": {"path": p.ready.path, "port": "http"}}
        if p.ready.kind == "http"
        else {"tcpSocket": {"port": "http"}}
    )
    threshold = max(1, math.ceil(p.start_timeout_s / STARTUP_PERIOD_S))
    return {
        "startupProbe": {
            **action,
            "periodSeconds": STARTUP_PERIOD_S,
            "timeoutSeconds": 1,
            "failureThreshold": threshold,
        },
        "readinessProbe": {
            **action,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
    }


def _resources(p: Provider, opts: Options, losses: list[Loss]) -> Obj:
    limits: Obj = {}
    requests: Obj = {}
    if p.memory_max is not None:
        limits["memory"] = memory_quantity(p.memory_max)
    if p.memory_high is not None:
        requests["memory"] = memory_quantity(p.memory_high)
        losses.append(
            Loss(
                "limits.memory_high",
                "throttling and reclaim above it; it becomes the memory request the "
                "scheduler reserves",
            )
        )
    elif p.memory_max is not None:
        requests["memory"] = limits["memory"]
    if p.cpu_quota is not None:
        limits["cpu"] = cpu_quantity(p.cpu_quota)
    if p.tasks_max is not None:
        losses.append(
            Loss("limits.tasks_max", "the limit on processes and threads (PID limits are per node)")
        )
    if p.uses_gpu:
        limits["nvidia.com/gpu"] = p.gpu_count
        if opts.gpu_sharing == "hami" and p.vram_budget_gb is not None:
            limits["nvidia.com/gpumem"] = mebibytes(p.vram_budget_gb)
    out: Obj = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _gpu_losses(p: Provider, opts: Options, losses: list[Loss]) -> None:
    if not p.uses_gpu:
        return
    if isinstance(p.gpu_devices, tuple):
        listed = ", ".join(str(d) for d in p.gpu_devices)
        losses.append(
            Loss(
                "gpu.devices",
                f"the listed card(s) ({listed}); the scheduler picks any {p.gpu_count} free "
                "card(s) on any node",
                weakens=True,
            )
        )
    if p.vram_budget_gb is None:
        return
    if opts.gpu_sharing == "whole":
        losses.append(
            Loss(
                "gpu.enforce",
                f"nothing {'stops' if p.enforce == 'stop' else 'warns about'} a worker over its "
                f"{p.vram_budget_gb:g} GiB budget: a whole card has no VRAM limit (the budget only "
                "selects nodes by nvidia.com/gpu.memory; --gpu-sharing hami caps it)",
                weakens=True,
            )
        )
    else:
        what = "stopping" if p.enforce == "stop" else "a warning about"
        losses.append(
            Loss(
                "gpu.enforce",
                f"{what} the worker over budget; HAMi makes allocations beyond "
                f"{mebibytes(p.vram_budget_gb)} MiB per card fail instead",
            )
        )


def _affinity(p: Provider, opts: Options) -> Obj | None:
    if not p.uses_gpu or p.vram_budget_gb is None or opts.gpu_sharing != "whole":
        return None
    term = {
        "key": "nvidia.com/gpu.memory",
        "operator": "Gt",
        "values": [str(mebibytes(p.vram_budget_gb) - 1)],
    }
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [term]}]
            }
        }
    }


def _working_directory(p: Provider, losses: list[Loss]) -> str | None:
    wd = p.working_directory
    if wd is not None and p.source.name == "provider.toml" and wd == str(p.source.parent):
        losses.append(
            Loss(
                "runtime.working_directory",
                f"the manifest's directory \"{wd}\" (a host path); the image's working "
                "directory is used",
            )
        )
        return None
    return wd


def _container(p: Provider, opts: Options, port: int, losses: list[Loss]) -> Obj:
    c: Obj = {"name": "worker", "image": opts.image}
    command = _command(p, port, losses)
    if command is not None:
        c["command"] = command
    env = [{"name": k, "value": escape_dollars(v)} for k, v in p.environment]
    env += [
        {"name": "PROVIDERD_WORKER_PORT", "value": str(port)},
        {"name": "PROVIDERD_WORKER_HOST", "value": "0.0.0.0"},
    ]
    c["env"] = env
    wd = _working_directory(p, losses)
    if wd is not None:
        c["workingDir"] = wd
    c["ports"] = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    c.update(_probes(p, losses))
    resources = _resources(p, opts, losses)
    if resources:
        c["resources"] = resources
    c["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if p.weight_paths:
        c["volumeMounts"] = [
            {"name": f"weights-{i}", "mountPath": path, "readOnly": True}
            for i, path in enumerate(p.weight_paths)
        ]
    return c


def deployment(p: Provider, name: str, opts: Options, port: int, losses: list[Loss]) -> Obj:
    container = _container(p, opts, port, losses)
    _gpu_losses(p, opts, losses)
    spec: Obj = {
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": max(1, math.ceil(p.stop_timeout_s)),
    }
    if p.network == "host":
        spec["hostNetwork"] = True
    affinity = _affinity(p, opts)
    if affinity:
        spec["affinity"] = affinity
    if p.uses_gpu:
        spec["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    spec["containers"] = [container]
    if p.weight_paths:
        spec["volumes"] = [
            {"name": f"weights-{i}", "hostPath": {"path": path}}
            for i, path in enumerate(p.weight_paths)
        ]
    notes = {"providerd/description": p.description} if p.description else None
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(name, opts, notes),
        "spec": {
            "selector": {"matchLabels": selector(name)},
            "strategy": {"type": "Recreate"},
            "template": {"metadata": {"labels": labels(name)}, "spec": spec},
        },
    }
