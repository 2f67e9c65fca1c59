"""The key table drives rendering: every key that the table says becomes a directive is
rendered as that directive, in that unit, and its value decides the directive's value;
and what the reference documents (`Key.directive`) names exactly those directives.

Each key is rendered twice, with two values (`SAMPLES`), and the drop-ins are read back
with systemd's syntax (tests/cases/harness.py), not with the renderer's own code.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from cases.harness import parse_unit

from agent.spec import keys, manifest
from agent.spec.provider import Provider
from agent.spec.values import Host
from agent.systemd import units

HOST = Host(cpu_count=4, exists=lambda path: True)
SOURCE = Path("/etc/providerd/providers/k.toml")
BASE: dict[str, Any] = {
    "listen.address": "127.0.0.1:18000",
    "runtime.command": ["/bin/true"],
}
UNIX = {"listen.address": "/run/k.sock"}

# dotted key → (settings A, settings B): the key at two values (with what it needs besides).
SAMPLES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "enabled": ({"enabled": True}, {"enabled": False}),
    "listen.address": ({"listen.address": "127.0.0.1:18001"}, {"listen.address": "/run/k.sock"}),
    "listen.allow": ({"listen.allow": ["10.0.0.0/8"]}, {"listen.allow": []}),
    "listen.socket_mode": (
        {**UNIX, "listen.socket_mode": "0600"},
        {**UNIX, "listen.socket_mode": "0666"},
    ),
    "listen.socket_group": (
        {**UNIX, "listen.socket_group": "group_a"},
        {**UNIX, "listen.socket_group": "group_b"},
    ),
    "runtime.command": ({"runtime.command": ["/bin/a"]}, {"runtime.command": ["/bin/b"]}),
    "runtime.launch": (
        {"runtime.command": None, "runtime.launch": "pkg.mod:one"},
        {"runtime.command": None, "runtime.launch": "pkg.mod:two"},
    ),
    "runtime.ready": ({"runtime.ready": "tcp"}, {"runtime.ready": "notify"}),
    "runtime.environment": (
        {"runtime.environment": {"A": "1"}},
        {"runtime.environment": {"A": "2"}},
    ),
    "runtime.working_directory": (
        {"runtime.working_directory": "/srv/a"},
        {"runtime.working_directory": "/srv/b"},
    ),
    "runtime.start_timeout_s": ({"runtime.start_timeout_s": 10}, {"runtime.start_timeout_s": 20}),
    "runtime.stop_timeout_s": ({"runtime.stop_timeout_s": 10}, {"runtime.stop_timeout_s": 20}),
    "runtime.preload": (
        {"enabled": True, "runtime.preload": True},
        {"enabled": True, "runtime.preload": False},
    ),
    "runtime.credentials": (
        {"runtime.credentials": {"T": "/etc/a"}},
        {"runtime.credentials": {"T": "/etc/b"}},
    ),
    "limits.memory_max": ({"limits.memory_max": "1G"}, {"limits.memory_max": "2G"}),
    "limits.memory_high": ({"limits.memory_high": "1G"}, {"limits.memory_high": "2G"}),
    "limits.cpu_quota": ({"limits.cpu_quota": "100%"}, {"limits.cpu_quota": "200%"}),
    "limits.tasks_max": ({"limits.tasks_max": 10}, {"limits.tasks_max": 20}),
    "gpu.devices": ({"gpu.devices": "auto"}, {"gpu.devices": "none"}),
    "weights.paths": ({"weights.paths": ["/srv/w1"]}, {"weights.paths": ["/srv/w2"]}),
    "isolation.network": ({"isolation.network": "host"}, {"isolation.network": "private"}),
}

RENDERED = [k for k in keys.KEYS if k.becomes]
DIRECTIVE_WORD = re.compile(r"\b([A-Z][A-Za-z]+)=")


def provider(settings: dict[str, Any]) -> Provider:
    data: dict[str, Any] = {}
    for dotted, value in {**BASE, **settings}.items():
        if value is None:
            continue
        section, _, name = dotted.rpartition(".")
        (data.setdefault(section, {}) if section else data)[name] = value
    result = manifest.validate(data, "k", SOURCE, HOST)
    assert isinstance(result, Provider), result
    return result


def rendered(settings: dict[str, Any], unit: str) -> dict[str, list[str]]:
    """The directives of one drop-in ("link": the paths of the links), with their values."""
    files = units.render(provider(settings))
    if unit == "link":
        return {
            path.partition("/")[0]: [path] for path in files if "/" in path and ".d/" not in path
        }
    name = {"socket": units.socket_unit, "front": units.front_unit, "worker": units.worker_unit}
    text = files[f"{name[unit]('k')}.d/{units.DROPIN}"]
    assert isinstance(text, str)
    out: dict[str, list[str]] = {}
    for _, directive, value in parse_unit(text):
        out.setdefault(directive, []).append(value)
    return out


def test_every_rendered_key_has_samples() -> None:
    assert sorted(SAMPLES) == sorted(k.dotted for k in RENDERED)


@pytest.mark.parametrize("key", RENDERED, ids=[k.dotted for k in RENDERED])
def test_a_key_becomes_the_directives_the_table_names(key: keys.Key) -> None:
    a, b = SAMPLES[key.dotted]
    for unit, directive in key.becomes:
        assert unit in (*keys.UNIT_ROLES, "link")
        with_a, with_b = rendered(a, unit), rendered(b, unit)
        assert directive in with_a, f"{key.dotted}: no {directive} in the {unit} unit"
        assert with_a.get(directive) != with_b.get(directive), (
            f"{key.dotted}: {directive} in the {unit} unit does not follow the key's value"
        )


@pytest.mark.parametrize("key", RENDERED, ids=[k.dotted for k in RENDERED])
def test_the_reference_documents_the_directives_rendered(key: keys.Key) -> None:
    documented = set(DIRECTIVE_WORD.findall(key.directive))
    directives = {d for unit, d in key.becomes if unit != "link"}
    links = {d for unit, d in key.becomes if unit == "link"}
    assert documented == directives, f"{key.dotted}: documented {key.directive!r}"
    assert all(f"{d}/" in key.directive for d in links), f"{key.dotted}: {key.directive!r}"
    for unit in {u for u, _ in key.becomes if u != "link"}:
        assert unit in key.directive, f"{key.dotted}: {key.directive!r} does not name the {unit}"


def test_keys_read_by_providerd_itself_become_nothing() -> None:
    for key in keys.KEYS:
        assert bool(key.directive) == bool(key.becomes), key.dotted


def test_a_key_the_table_does_not_render_there_is_an_error() -> None:
    with pytest.raises(KeyError, match="becomes nothing in the front unit"):
        keys.becomes("limits.memory_max", "front")
