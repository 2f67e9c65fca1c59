"""`providerctl export kubernetes`: read manifests, print or write the objects, decide
the exit code (0 ok, 1 a manifest has a problem or was refused, 2 usage, 4 no such
manifest). The mapping itself is `agent.export.kubernetes`, the text `agent.export.yamltext`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TextIO

from agent.errors import ProviderdError
from agent.export import kubernetes, yamltext
from agent.spec import paths
from agent.spec.files import write_atomic
from agent.spec.provider import has_control
from agent.systemd.manifests import check_paths, discover

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_NO_SUCH = 0, 1, 2, 4

_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class UsageError(ProviderdError):
    """An option value that cannot be used; the message says what is expected."""

    code = "usage"


def options(
    image: str, namespace: str, gpu_sharing: str, lossy: bool, gateway: str
) -> kubernetes.Options:
    if not image or has_control(image) or any(c.isspace() for c in image):
        raise UsageError(
            f"--image: expected a container image such as registry.example/llama:1.0, got {image!r}"
        )
    if len(namespace) > 63 or not _NAMESPACE.fullmatch(namespace):
        raise UsageError(
            f"--namespace: expected a Kubernetes namespace (lowercase letters, digits and '-', "
            f"at most 63 characters), got {namespace!r}"
        )
    gw_namespace, _, gw_name = gateway.rpartition("/")
    if (
        len(gw_name) > 253
        or not _SUBDOMAIN.fullmatch(gw_name)
        or (gw_namespace and (len(gw_namespace) > 63 or not _NAMESPACE.fullmatch(gw_namespace)))
    ):
        raise UsageError(
            f"--gateway: expected a Gateway as NAME or NAMESPACE/NAME, got {gateway!r}"
        )
    if gpu_sharing not in ("whole", "hami"):
        raise UsageError(f'--gpu-sharing: expected "whole" or "hami", got {gpu_sharing!r}')
    sharing: kubernetes.GpuSharing = "hami" if gpu_sharing == "hami" else "whole"
    return kubernetes.Options(image, namespace, sharing, lossy, gateway)


def main_export(
    items: list[str],
    opts: kubernetes.Options,
    out_dir: str | None,
    out: TextIO,
    err: TextIO,
) -> int:
    missing = [i for i in items if not os.path.lexists(i)]
    found = check_paths([Path(i) for i in items]) if items else discover()
    for problem in found.problems:
        err.write(f"{problem}\n")
    if missing or not found.providers:
        if not found.problems:
            where = ", ".join(items) if items else ", ".join(map(str, paths.manifest_dirs()))
            err.write(f"providerctl: no manifests found in {where}\n")
        return EXIT_NO_SUCH if missing or not found.problems else EXIT_FAILURE
    result = kubernetes.export(list(found.providers.values()), opts)
    for line in result.lines:
        err.write(f"{line}\n")
    if out_dir is None:
        out.write(yamltext.documents(result.objects))
    elif result.objects:
        directory = Path(out_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for obj in result.objects:
                path = directory / kubernetes.file_name(obj)
                write_atomic(path, yamltext.document(obj), mode=0o644)
                out.write(f"{path}\n")
        except OSError as e:
            err.write(f"providerctl: Failed to write {out_dir}: {e.strerror or e}\n")
            return EXIT_FAILURE
    if result.refused:
        err.write(f"providerctl: not exported: {', '.join(result.refused)}\n")
        if not opts.lossy and any("--lossy" in str(x) for x in result.lines):
            err.write("Hint: --lossy exports them without what Kubernetes cannot carry\n")
    return EXIT_FAILURE if found.problems or result.refused else EXIT_OK
