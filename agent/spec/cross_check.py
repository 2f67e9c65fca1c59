"""Problems between valid manifests: two providers on one address, one model name claimed
twice, a pattern that matches another provider's name. Pure, and linear in the number of
manifests (addresses grouped by port or path; patterns tried on the names their literal
parts allow)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from agent.spec.patterns import Pattern, compile_pattern
from agent.spec.provider import Address, Problem, Provider


def _collide(a: Address, b: Address) -> bool:
    if a.is_unix or b.is_unix:
        return a.path == b.path
    if a.port != b.port:
        return False
    if a.host == b.host or "::" in (a.host, b.host):
        return True
    return "0.0.0.0" in (a.host, b.host) and ":" not in (a.host or "") + (b.host or "")


def _address_groups(providers: list[Provider]) -> list[list[tuple[Provider, Address]]]:
    """Addresses that may collide, grouped by port or path (linear, for many manifests)."""
    groups: dict[object, list[tuple[Provider, Address]]] = {}
    for p in providers:
        for a in p.addresses:
            groups.setdefault(a.path if a.is_unix else a.port, []).append((p, a))
    return [g for g in groups.values() if len({id(p) for p, _ in g}) > 1]


def _candidate_names(rx: Pattern, names: list[str]) -> Iterable[str]:
    """The names of `names` (sorted) that `rx` may match: those that start with its
    literal prefix (a binary search), else those that contain its literal. Each match
    then takes time linear in the name (agent.spec.patterns), so no pattern can hang this."""
    prefix = rx.literal_prefix
    if prefix:
        for i in range(bisect.bisect_left(names, prefix), len(names)):
            if not names[i].startswith(prefix):
                return
            yield names[i]
    elif rx.literal:
        literal = rx.literal
        yield from (n for n in names if literal in n)
    else:
        yield from names


def cross_check(providers: list[Provider]) -> list[Problem]:
    """Problems between valid providers: shared addresses and model names. Pure."""
    out: list[Problem] = []

    def both(x: Provider, x_key: str, x_msg: str, y: Provider, y_key: str, y_msg: str) -> None:
        out.append(Problem(str(x.source), x_key, x_msg))
        out.append(Problem(str(y.source), y_key, y_msg))

    for group in _address_groups(providers):
        for i, (p, a) in enumerate(group):
            for q, b in group[i + 1 :]:
                if p is not q and _collide(a, b):
                    both(
                        p, "listen.address",
                        f'"{a}" is also used by provider "{q.slug}" ({q.source}); give each provider its own address',
                        q, "listen.address",
                        f'"{b}" is also used by provider "{p.slug}" ({p.source}); give each provider its own address',
                    )  # fmt: skip
    owners: dict[str, Provider] = {}
    for p in providers:
        for n in p.model_names:
            q = owners.setdefault(n, p)
            if q is not p:
                claim = "is also claimed by provider"
                both(
                    q, "models.names", f'"{n}" {claim} "{p.slug}" ({p.source}); a model name belongs to one provider',
                    p, "models.names", f'"{n}" {claim} "{q.slug}" ({q.source}); a model name belongs to one provider',
                )  # fmt: skip
    names = sorted(owners)
    for x in providers:
        for pat in x.model_patterns:
            rx = compile_pattern(pat)
            for n in _candidate_names(rx, names):
                y = owners[n]
                if y is not x and rx.fullmatch(n):
                    both(
                        x, "models.patterns",
                        f'"{pat}" matches "{n}", a name of provider "{y.slug}" ({y.source}); narrow the pattern',
                        y, "models.names",
                        f'"{n}" is also matched by pattern "{pat}" of provider "{x.slug}" ({x.source})',
                    )  # fmt: skip
    return out
