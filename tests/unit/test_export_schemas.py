"""The Kubernetes export against the engine's own schemas: golden output for every shipped
example, validated strictly (built-in kinds with the official schemas, custom resources
with the vendored CRDs, their defaults and CEL rules); property tests that any accepted
manifest either exports to valid objects or is refused with a problem line; and tests
that the validator itself refuses what an API server would."""

from __future__ import annotations

import copy
import hashlib
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.export import kubernetes as k
from agent.export import yamltext
from agent.export.k8s_values import duration, is_dns_label
from agent.spec import manifest
from agent.spec.provider import Provider, fill_placeholders
from agent.spec.values import Host
from tests.cases.harness import CASES, EXAMPLES
from tests.kubernetes import schema
from tests.kubernetes.oracles import expand

GOLDEN = CASES / "kubernetes"
UPDATE = os.environ.get("PROVIDERD_UPDATE_GOLDEN") == "1"
HOST = Host(cpu_count=64, exists=lambda p: True)
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.toml"))


def example(path: Path) -> Provider:
    raw = path.read_bytes()
    slug = manifest.slug_of(path)
    p = manifest.parse_bytes(raw, Path(f"/etc/providerd/providers/{slug}.toml"), slug, HOST)
    assert isinstance(p, Provider), p
    return p


def golden_text(p: Provider) -> str:
    opts = k.Options(f"registry.example/{p.slug}:1")
    strict = k.export([p], opts)
    lossy = k.export([p], k.Options(opts.image, lossy=True))
    out = [f"## providerctl export kubernetes {p.source} --image {opts.image}"]
    out.append(f"## without --lossy: {'refused' if strict.refused else 'exported'}")
    out += [f"# {x}" for x in strict.lines]
    out.append("## with --lossy:")
    out += [f"# {x}" for x in lossy.lines]
    return "\n".join(out) + "\n" + yamltext.documents(lossy.objects)


# -- golden: every shipped example ----------------------------------------------------------


def test_every_example_has_a_golden_file() -> None:
    assert EXAMPLE_FILES
    assert sorted(p.stem for p in GOLDEN.glob("*.expected")) == [p.stem for p in EXAMPLE_FILES]


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.stem for p in EXAMPLE_FILES])
def test_golden_example(path: Path) -> None:
    text = golden_text(example(path))
    expected = GOLDEN / f"{path.stem}.expected"
    if UPDATE:
        expected.write_text(text, encoding="utf-8")
    assert text == expected.read_text(encoding="utf-8"), (
        f"{path.name}: export differs; review, then refresh with PROVIDERD_UPDATE_GOLDEN=1"
    )


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.stem for p in EXAMPLE_FILES])
@pytest.mark.parametrize("sharing", ["whole", "hami"])
def test_example_validates_strictly(path: Path, sharing: k.GpuSharing) -> None:
    p = example(path)
    e = k.export([p], k.Options("registry.example/m:1", "ml", sharing, lossy=True))
    report = schema.validate_all(e.objects)
    assert report.errors == []
    assert report.not_checked == [], "every CEL rule of these CRDs runs under cel-python"
    assert report.rules_passed > 0
    assert {o["kind"] for o in e.objects} >= {
        "Deployment", "Service", "InterceptorRoute", "ScaledObject", "HTTPRoute", "ReferenceGrant",
    }  # fmt: skip


def test_all_examples_together_validate() -> None:
    e = k.export([example(p) for p in EXAMPLE_FILES], k.Options("i", lossy=True))
    assert e.refused == []
    report = schema.validate_all(e.objects)
    assert report.errors == [] and report.not_checked == []
    names = [(o["kind"], o["metadata"]["name"]) for o in e.objects]
    assert len(set(names)) == len(names)


def test_vendored_crds_are_unchanged() -> None:
    sums = (schema.CRDS / "SHA256SUMS").read_text(encoding="utf-8").splitlines()
    recorded = dict(reversed(line.split("  ", 1)) for line in sums)
    assert sorted(recorded) == sorted(
        p.name for p in schema.CRDS.iterdir() if p.suffix == ".yaml" or p.name == "LICENSE"
    )
    for name, digest in recorded.items():
        assert hashlib.sha256((schema.CRDS / name).read_bytes()).hexdigest() == digest, name


# -- the validator refuses what an API server would ------------------------------------------


@pytest.fixture(scope="module")
def good() -> list[dict[str, Any]]:
    return k.export([example(EXAMPLES / "vllm.toml")], k.Options("i", lossy=True)).objects


def find(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(o for o in objects if o["kind"] == kind))


def errors(obj: dict[str, Any]) -> list[str]:
    return schema.validate_object(obj, ("1.30.0", "1.37.0")).errors


def test_validator_refuses_unknown_fields(good: list[dict[str, Any]]) -> None:
    for kind, place in [
        ("Deployment", lambda o: o["spec"]["template"]["spec"]),
        ("Service", lambda o: o["spec"]),
        ("InterceptorRoute", lambda o: o["spec"]["target"]),
        ("ScaledObject", lambda o: o["spec"]),
        ("HTTPRoute", lambda o: o["spec"]["rules"][0]),
        ("ReferenceGrant", lambda o: o["spec"]),
    ]:
        obj = find(good, kind)
        place(obj)["surplus"] = 1
        assert any("surplus" in e for e in errors(obj)), kind


def test_validator_runs_cel_rules(good: list[dict[str, Any]]) -> None:
    route = find(good, "InterceptorRoute")
    route["spec"]["target"]["portName"] = "http"
    assert any("exactly one of 'port' or 'portName'" in e for e in errors(route))
    route = find(good, "InterceptorRoute")
    route["spec"]["scalingMetric"] = {}
    assert any("at least one of 'concurrency'" in e for e in errors(route))
    http = find(good, "HTTPRoute")
    http["spec"]["rules"][0]["timeouts"]["backendRequest"] = "999h"
    assert any("backendRequest timeout cannot be longer" in e for e in errors(http))


def test_validator_applies_defaults_before_cel(good: list[dict[str, Any]]) -> None:
    http = find(good, "HTTPRoute")
    del http["spec"]["rules"][0]["backendRefs"][0]["port"]
    # Only after `group: ""` and `kind: Service` are defaulted does the rule apply.
    assert any("Must have port for Service reference" in e for e in errors(http))
    route = find(good, "InterceptorRoute")
    route["spec"]["scalingMetric"]["concurrency"] = {}
    assert errors(route) == []  # targetValue defaults to 100


def test_validator_checks_bounds_types_and_patterns(good: list[dict[str, Any]]) -> None:
    route = find(good, "InterceptorRoute")
    route["spec"]["scalingMetric"]["concurrency"]["targetValue"] = 0
    assert any("below the minimum" in e for e in errors(route))
    so = find(good, "ScaledObject")
    so["spec"]["maxReplicaCount"] = 1 << 40
    assert any("int32" in e for e in errors(so))
    so = find(good, "ScaledObject")
    so["spec"]["cooldownPeriod"] = "600"
    assert any("expected integer" in e for e in errors(so))
    http = find(good, "HTTPRoute")
    http["spec"]["rules"][0]["timeouts"]["request"] = "900000s"
    assert any("does not match" in e for e in errors(http))
    dep = find(good, "Deployment")
    dep["metadata"]["name"] = "Not_A_Name"
    assert any("metadata.name" in e for e in errors(dep))


def test_validator_escapes_cel_reserved_property_names(good: list[dict[str, Any]]) -> None:
    http = find(good, "HTTPRoute")
    http["spec"]["parentRefs"] = [{"name": "gw", "namespace": "infra"}] * 2
    assert any("sectionName or port must be unique" in e for e in errors(http))
    # The rules read `p.__namespace__`: these two differ only if `namespace` reaches CEL
    # under that escaped name; unescaped, both would look namespace-less, hence the same.
    http["spec"]["parentRefs"] = [{"name": "gw", "namespace": "infra"}, {"name": "gw"}]
    assert errors(http) == []


def test_rules_with_kubernetes_only_functions_are_not_checked() -> None:
    rules = [
        {"rule": "self.name.lowerAscii() == self.name", "message": "lower"},
        {"rule": "self.name == oldSelf.name", "message": "immutable"},
        {"rule": "self.name.size() > 0", "message": "non-empty"},
    ]
    s = {"type": "object", "properties": {"name": {"type": "string"}}}
    report = schema.Report()
    schema.walk({"name": "a"}, {**s, "x-kubernetes-validations": rules}, "x", report)
    assert report.rules_passed == 1 and report.errors == []
    assert len(report.not_checked) == 2
    assert "Kubernetes-only function lowerAscii()" in report.not_checked[0]
    assert "transition rule" in report.not_checked[1]


# -- properties: any accepted manifest exports to valid objects or is refused with a line ------

_arg = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="{}\x00"),
    max_size=12,
)
_arg_with_placeholder = st.lists(
    st.one_of(_arg, st.sampled_from(["{port}", "{host}", "{slug}", "{python}", "{{", "}}"])),
    min_size=1,
    max_size=3,
).map("".join)
_env_value = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=16
)
_seconds = st.one_of(st.integers(1, 7 * 24 * 3600), st.floats(1, 7 * 24 * 3600, allow_nan=False))
_name = st.from_regex(r"[a-z0-9][a-z0-9._:-]{0,20}", fullmatch=True)
_patterns = st.sampled_from(["m-.*", "llama-3(\\.1)?-8b", "a(?=b)", "x{2,3}", "(a)\\1", "q.*+"])


@st.composite
def manifests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    slug = draw(st.from_regex(r"[a-z0-9_]{1,48}", fullmatch=True))
    port = draw(st.integers(1, 65535))
    address = draw(
        st.sampled_from(
            [f"127.0.0.1:{port}", f"0.0.0.0:{port}", f"[::1]:{port}", f"/run/s/{slug}.sock"]
        )
    )
    listen: dict[str, Any] = {"address": address}
    if draw(st.booleans()):
        listen["protocol"] = draw(st.sampled_from(["http", "tcp"]))
    if draw(st.booleans()):
        listen["allow"] = draw(
            st.lists(st.sampled_from(["10.0.0.0/8", "::1", "127.0.0.1"]), max_size=2)
        )
    if draw(st.booleans()):
        listen["max_held"] = draw(st.integers(1, 1_000_000))
    runtime: dict[str, Any] = {}
    if draw(st.integers(0, 5)) == 0:
        runtime["launch"] = "pkg.mod:fn"
    else:
        runtime["command"] = ["/srv/serve", *draw(st.lists(_arg_with_placeholder, max_size=4))]
    runtime["ready"] = draw(
        st.sampled_from(["tcp", "notify", "http:/health", "http:/v1/models?x=$(A)"])
    )
    for key in ("start_timeout_s", "request_timeout_s", "idle_timeout_s"):
        if draw(st.booleans()):
            runtime[key] = draw(_seconds)
    if draw(st.booleans()):
        runtime["stop_timeout_s"] = draw(st.integers(1, 3600))
    if draw(st.booleans()):
        runtime["worker_port"] = draw(st.integers(0, 65535))
    if draw(st.booleans()):
        names = draw(
            st.lists(
                st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True), max_size=3, unique=True
            )
        )
        runtime["environment"] = {
            n: draw(_env_value) for n in names if not n.startswith("PROVIDERD_")
        }
    if draw(st.booleans()):
        runtime["idle_ignore_paths"] = ["/health"]
    data: dict[str, Any] = {"listen": listen, "runtime": runtime}
    if draw(st.booleans()):
        data["enabled"] = draw(st.booleans())
    if draw(st.booleans()):
        data["description"] = draw(_env_value)
    limits: dict[str, Any] = {}
    if draw(st.booleans()):
        limits["memory_max"] = draw(st.sampled_from(["512M", "32G", "1.5G", 3 << 20]))
    if draw(st.booleans()):
        limits["memory_high"] = "256M"
    if draw(st.booleans()):
        limits["cpu_quota"] = f"{draw(st.integers(1, 6400))}%"
    if draw(st.booleans()):
        limits["tasks_max"] = draw(st.integers(1, 4_194_304))
    if limits:
        data["limits"] = limits
    if draw(st.booleans()):
        gpu: dict[str, Any] = {
            "devices": draw(st.sampled_from(["auto", [0], ["GPU-0123abcd-ef"], [0, 1]]))
        }
        if draw(st.booleans()):
            gpu["count"] = 1
        if draw(st.booleans()):
            gpu["vram_budget_gb"] = draw(st.floats(0.001, 100_000, allow_nan=False))
        if draw(st.booleans()):
            gpu["enforce"] = draw(st.sampled_from(["stop", "warn"]))
        data["gpu"] = gpu
    if draw(st.booleans()):
        data["weights"] = {"paths": ["/srv/models/w"]}
    if draw(st.booleans()):
        data["isolation"] = {"network": draw(st.sampled_from(["private", "host"]))}
    if draw(st.booleans()):
        data["models"] = {
            "names": draw(st.lists(_name, max_size=70, unique=True)),
            "patterns": draw(st.lists(_patterns, max_size=2, unique=True)),
        }
    return slug, data


def _startup_budget(container: dict[str, Any]) -> int:
    probe = container["startupProbe"]
    return int(
        probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(manifests(), st.booleans(), st.sampled_from(["whole", "hami"]))
def test_any_accepted_manifest_exports_valid_objects_or_says_why_not(
    case: tuple[str, dict[str, Any]], lossy: bool, sharing: k.GpuSharing
) -> None:
    slug, data = case
    p = manifest.validate(data, slug, Path(f"/etc/providerd/providers/{slug}.toml"), HOST)
    if not isinstance(p, Provider):
        return  # the manifest itself is refused, as `check` refuses it
    e = k.export([p], k.Options("registry.example/m:1", "ml", sharing, lossy))
    if e.refused:
        assert e.objects == []
        refusals = [
            x
            for x in e.lines
            if "refusing to export" in x.message or "is not exported" in x.message
        ]
        assert refusals and all(str(x).startswith(f"{p.source}: ") for x in refusals)
        assert all(x.key and x.message.startswith("not carried by Kubernetes: ") for x in refusals)
        return
    report = schema.validate_all(e.objects, ("1.30.0", "1.37.0"))
    assert report.errors == []
    assert report.not_checked == []
    for obj in e.objects:
        name = obj["metadata"]["name"]
        if obj["kind"] not in ("HTTPRoute", "ReferenceGrant"):
            assert is_dns_label(name), name
    objs = {o["kind"]: o for o in e.objects}
    deployment = objs["Deployment"]["spec"]
    assert deployment["strategy"] == {"type": "Recreate"}
    assert "replicas" not in deployment or deployment["replicas"] <= 1
    so = objs["ScaledObject"]["spec"]
    assert so["maxReplicaCount"] == 1 and so["minReplicaCount"] == 0
    assert p.idle_timeout_s <= so["cooldownPeriod"] and so["cooldownPeriod"] - 1 < p.idle_timeout_s
    (container,) = deployment["template"]["spec"]["containers"]
    assert _startup_budget(container) >= p.start_timeout_s
    readiness = objs["InterceptorRoute"]["spec"]["timeouts"]["readiness"]
    assert _seconds_of(readiness) >= p.start_timeout_s
    env = {v["name"]: v["value"] for v in container["env"]}
    lookup = lambda name: "EXPANDED"  # noqa: E731  (any variable: the worst case)
    if p.command:
        port = str(p.worker_port or 8080)
        values = {"port": port, "host": "0.0.0.0", "slug": p.slug, "python": "python3"}
        want = [fill_placeholders(a, values) for a in p.command]
        assert [expand(a, lookup) for a in container["command"]] == want
    for name, value in p.environment:
        assert expand(env[name], lookup) == value
    text = yamltext.documents(e.objects)
    assert list(yaml.safe_load_all(text)) == e.objects
    assert text == yamltext.documents(
        k.export([p], k.Options("registry.example/m:1", "ml", sharing, lossy)).objects
    )


def _seconds_of(text: str) -> int:
    units = {"h": 3600, "m": 60, "s": 1}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([hms])", text))


def test_seconds_of_reads_durations() -> None:
    assert _seconds_of("1h5m6s") == 3906
    assert math.isclose(_seconds_of(duration(899.2)), 900)
