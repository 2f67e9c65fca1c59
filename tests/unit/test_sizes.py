"""The one size parser and formatter: exact forms for systemd, Kubernetes and messages,
and the approximate forms people read."""

from __future__ import annotations

from agent.spec.sizes import (
    HUMAN_MEBI,
    KUBERNETES_SUFFIXES,
    approx_size,
    format_size,
    size_bytes,
)


def test_exact_forms() -> None:
    sizes = (1 << 30, 1536 << 20, (1 << 20) + 1, 32 << 30, 3 << 60)
    assert [format_size(n) for n in sizes] == ["1G", "1536M", "1048577", "32G", "3E"]
    assert [format_size(n, KUBERNETES_SUFFIXES) for n in sizes[:4]] == [
        "1Gi",
        "1536Mi",
        "1048577",
        "32Gi",
    ]
    assert format_size(1 << 20, ((" MiB", 20),), "{} bytes") == "1 MiB"
    assert format_size(1000, ((" MiB", 20),), "{} bytes") == "1000 bytes"


def test_exact_forms_read_back() -> None:
    for n in (1 << 20, 1536 << 20, 5 << 40, (1 << 20) + 1):
        assert size_bytes(format_size(n)) == n


def test_parsing() -> None:
    assert size_bytes("1.5G") == 3 << 29
    assert size_bytes(" 24G ") == 24 << 30
    assert size_bytes("1T", "KMG") is None
    assert size_bytes("16 megs") is None
    assert size_bytes(True) is None
    assert size_bytes("9" * 50) == 1 << 200


def test_approximate_forms() -> None:
    assert [approx_size(n) for n in (0, 1023, 1024, 1536 << 20, 5 << 40)] == [
        "0B",
        "1023B",
        "1.0K",
        "1.5G",
        "5.0T",
    ]
    assert [approx_size(n, HUMAN_MEBI) for n in (512 << 20, (1 << 30) - 1, 3 << 29)] == [
        "512 MiB",
        "1024 MiB",
        "1.5 GiB",
    ]
