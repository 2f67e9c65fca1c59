"""The manifests as the generator takes them: `agent.spec.manifest`'s reading and checks,
and then the renderer's last guard, so that a manifest whose units cannot be written
safely is a problem of that manifest like any other (and never reaches a unit).

Everything that lists or loads providers for use (the generator, reload, check, the
front, the router, metrics, export) reads them through here, so all agree on which
providers are valid.
"""

from __future__ import annotations

from pathlib import Path

from agent.spec import manifest
from agent.spec.manifest import Discovery
from agent.spec.provider import Provider
from agent.spec.values import Host
from agent.systemd import units


def renderable(provider: Provider) -> str | None:
    """None when the provider's units can be written as they are; else why not."""
    try:
        units.render(provider)
    except units.Unrenderable as e:
        return str(e)
    return None


class Rendering:
    """The same guard, keeping what it rendered: the generator writes those files without
    rendering each provider a second time."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[Provider, dict[str, str | units.Link]]] = {}

    def __call__(self, provider: Provider) -> str | None:
        try:
            self.files[provider.slug] = (provider, units.render(provider))
        except units.Unrenderable as e:
            return str(e)
        return None

    def of(self, provider: Provider) -> dict[str, str | units.Link] | None:
        """What was rendered for this very provider, if it was."""
        made = self.files.get(provider.slug)
        return made[1] if made is not None and made[0] is provider else None


def discover_rendered() -> tuple[Discovery, Rendering]:
    """`discover()`, and the files of each valid provider as rendered by its check."""
    rendering = Rendering()
    return manifest.discover(check=rendering), rendering


def discover(dirs: list[Path] | None = None, host: Host | None = None) -> Discovery:
    """Every manifest in the manifest directories (highest priority first)."""
    return manifest.discover(dirs, host, renderable)


def check_paths(items: list[Path], host: Host | None = None) -> Discovery:
    """`providerctl check PATH...`: files, `<slug>/` directories or manifest directories."""
    return manifest.check_paths(items, host, renderable)


def load(slug: str) -> Provider:
    """The manifest of one provider, for the front at start. Raises ManifestError."""
    return manifest.load(slug, renderable)
