"""What the property-based tests share: a count of the cases they tried (printed at
the end of the run), and the seeds their mutations start from."""

from __future__ import annotations

from collections import Counter

from cases.harness import CASES, EXAMPLES

TRIED: Counter[str] = Counter()


def tried(name: str) -> None:
    """Count one case of the property test `name`."""
    TRIED[name] += 1


def seeds() -> list[bytes]:
    """Every example and case manifest: the starting points of mutated input."""
    paths = sorted(EXAMPLES.glob("*.toml")) + sorted(CASES.glob("*/*.toml"))
    return [p.read_bytes() for p in paths]
