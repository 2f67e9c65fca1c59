"""systemd's own verdict on the generated units: verify, and the security exposure."""

from __future__ import annotations

import re

from .conftest import FIGURES, Provider, demo_manifest, probe_manifest
from .nspawn import Container

LIMITS = {"provider@{}.service": 1.5, "provider-worker@{}.service": 2.5}


def test_systemd_analyze_verify_is_clean(ct: Container, provider: Provider) -> None:
    provider.add("verified", demo_manifest(18030, 30))
    provider.add(
        "probed", probe_manifest(18031, extra='[limits]\nmemory_max = "256M"\ntasks_max = 32\n')
    )
    for slug in ("verified", "probed"):
        units = f"provider@{slug}.socket provider@{slug}.service provider-worker@{slug}.service"
        # The generator's output directory joins the search path (trailing ':' keeps the
        # default ones); man pages are checked by the package tests (no man-db here).
        r = ct.sh(
            f"SYSTEMD_UNIT_PATH=/run/systemd/generator: systemd-analyze verify --man=no {units}",
            check=False,
        )
        assert r.rc == 0 and not r.out.strip() and not r.err.strip(), str(r)


def test_systemd_analyze_security_exposure(ct: Container, provider: Provider) -> None:
    provider.add("secured", demo_manifest(18032, 30))
    for pattern, limit in LIMITS.items():
        unit = pattern.format("secured")
        r = ct.sh(f"systemd-analyze security --no-pager {unit}", check=False)
        m = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", r.out)
        assert m, str(r)
        exposure = float(m.group(1))
        FIGURES.append(f"systemd-analyze security {unit}: {exposure} {m.group(2)} (limit {limit})")
        assert exposure <= limit, r.out
