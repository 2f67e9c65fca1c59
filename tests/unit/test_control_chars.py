"""One predicate for control characters (C0, DEL and C1): every value that may not hold
one refuses all three ranges, the C1 ones (U+0080 to U+009F) included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.export.main import UsageError, options
from agent.spec import manifest
from agent.spec.provider import Provider, has_control, printable
from agent.spec.values import Host

HOST = Host(cpu_count=4, exists=lambda path: True)
BASE: dict[str, Any] = {
    "listen": {"address": "127.0.0.1:18300"},
    "runtime": {"command": ["/bin/true"]},
}


def test_the_predicate() -> None:
    assert [has_control(c) for c in ("\x00", "\n", "\x1f", "\x7f", "\x80", "\x9f")] == [True] * 6
    assert not any(has_control(c) for c in (" ", "~", "\xa0", "é", "—"))
    assert printable("a\x85b\x1bc") == "a\\x85b\\x1bc"


@pytest.mark.parametrize("c", ["\x07", "\x7f", "\x85", "\x9b"])
@pytest.mark.parametrize(
    ("where", "value"),
    [
        (("models", "names"), lambda c: [f"model{c}x"]),
        (("runtime", "ready"), lambda c: f"http:/health{c}"),
        (("listen", "address"), lambda c: f"/run/prov{c}.sock"),
        (("", "description"), lambda c: f"a{c}b"),
    ],
    ids=["model name", "ready path", "unix socket path", "description"],
)
def test_a_manifest_value_with_a_control_character_is_refused(
    c: str, where: tuple[str, str], value: Any
) -> None:
    data = {k: dict(v) for k, v in BASE.items()}
    section, key = where
    (data.setdefault(section, {}) if section else data)[key] = value(c)
    result = manifest.validate(data, "c", Path("/etc/providerd/providers/c.toml"), HOST)
    assert not isinstance(result, Provider), f"{where} accepted {c!r}"
    assert [p.key for p in result] == [".".join(k for k in where if k)]


def test_an_image_with_a_control_character_is_refused() -> None:
    with pytest.raises(UsageError, match="--image"):
        options("registry.example/llama:1.0\x85", "default", "whole", False, "providerd")
