"""Sizes in bytes: read from "24G" / "1.5M" and written back as few digits as say them
exactly. Powers of 1024 throughout. Pure: no I/O.

One formatter serves every place that writes a size: systemd's suffixes by default
("24G", as MemoryMax= takes it), Kubernetes' ("24Gi"), or words ("1 MiB").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

POWERS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40, "P": 50, "E": 60}
# Largest first: the formatter takes the first suffix that divides the size.
SYSTEMD_SUFFIXES = (("E", 60), ("P", 50), ("T", 40), ("G", 30), ("M", 20), ("K", 10))
KUBERNETES_SUFFIXES = (("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))

_SIZE_RE = re.compile(r"(\d+)(?:\.(\d+))?([KMGTPE]?)")
_SIZE_DIGITS = 40  # more than any size: a longer number is simply too large


def size_bytes(value: object, units: str = "KMGTPE") -> int | None:
    """Bytes for an integer or a text such as "1.5G" (powers of 1024, suffixes from
    `units`), exactly, without floats; None when `value` has neither form. Numbers too
    long to be a size come out larger than any limit."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str) or not (m := _SIZE_RE.fullmatch(value.strip())):
        return None
    whole, frac, unit = m.group(1), m.group(2) or "", m.group(3)
    if unit and unit not in units:
        return None
    if len(whole.lstrip("0")) > _SIZE_DIGITS:
        return 1 << 200
    number = Fraction(int(whole.lstrip("0") or "0")) + (
        Fraction(int(frac[:_SIZE_DIGITS]), 10 ** len(frac[:_SIZE_DIGITS])) if frac else 0
    )
    return int(number * (1 << POWERS[unit]))


def format_size(
    size: int, suffixes: Sequence[tuple[str, int]] = SYSTEMD_SUFFIXES, plain: str = "{}"
) -> str:
    """`size` with the largest of `suffixes` (name, power of two) that it is a whole
    multiple of, or as `plain` (formatted with the number) when none is."""
    for suffix, shift in suffixes:
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{suffix}"
    return plain.format(size)


# For people, approximately: the first suffix is the floor and is shown whole.
HUMAN_SUFFIXES = (("B", 0), ("K", 10), ("M", 20), ("G", 30), ("T", 40))
HUMAN_MEBI = ((" MiB", 20), (" GiB", 30))


def approx_size(size: int, suffixes: Sequence[tuple[str, int]] = HUMAN_SUFFIXES) -> str:
    """`size` in the largest of `suffixes` (smallest first) that it reaches, with one
    decimal; in the first (the floor) as a whole number: "512B", "1.5G", "900 MiB"."""
    name, shift = suffixes[0]
    floor = suffixes[0]
    for suffix in suffixes[1:]:
        if abs(size) >= 1 << suffix[1]:
            name, shift = suffix
    value = size / (1 << shift)
    return f"{value:.0f}{name}" if (name, shift) == floor else f"{value:.1f}{name}"
