"""`providerctl export kubernetes`: the mapping key by key, the lines for what is not
carried, refusals and --lossy, names, sizes of the model endpoint, the CLI's files and
exit codes, and that the export stays on the spec side of `agent`."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli import main as cli
from agent.export import kubernetes as k
from agent.export.k8s_values import (
    cpu_quantity,
    duration,
    escape_dollars,
    is_dns_label,
    memory_quantity,
    object_name,
    python_only_regex,
)
from agent.spec import manifest
from agent.spec.provider import Provider
from tests.cases.harness import CASE_HOST, REPO, write
from tests.kubernetes.oracles import expand

BASE = """
[listen]
address = "0.0.0.0:8101"

[runtime]
command = ["/srv/serve", "--port", "{port}", "--host", "{host}"]
ready = "http:/health"
start_timeout_s = 300
request_timeout_s = 60
idle_timeout_s = 900
"""


@pytest.fixture(autouse=True)
def trusted_self(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))


def provider(tmp_path: Path, text: str, name: str = "m.toml") -> Provider:
    p = manifest.parse_file(write(tmp_path, name, BASE + text), host=CASE_HOST)
    assert isinstance(p, Provider), p
    return p


def run(p: Provider, **kw: Any) -> k.Export:
    return k.export([p], k.Options("registry.example/m:1", **kw))


def kinds(e: k.Export) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in e.objects}


def lines(e: k.Export) -> list[str]:
    return [str(x) for x in e.lines]


def container(e: k.Export) -> dict[str, Any]:
    c: dict[str, Any] = kinds(e)["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    return c


# -- values ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slug", "name"),
    [
        ("esm", "esm"),
        ("llama_server", "llama-server"),
        ("7b", "p-7b"),
        ("a_", "a-x"),
        ("_", "p--x"),
    ],
)
def test_object_names_are_dns_labels(slug: str, name: str) -> None:
    assert object_name(slug) == name
    assert is_dns_label(name)


def test_durations_fit_gateway_api() -> None:
    assert duration(900) == "15m"
    assert duration(0.2) == "1s"
    assert duration(3905.5) == "1h5m6s"
    assert duration(7 * 24 * 3600 * 2) == "336h"


def test_quantities() -> None:
    assert memory_quantity(32 << 30) == "32Gi"
    assert memory_quantity(512 << 20) == "512Mi"
    assert memory_quantity((1 << 20) + 1) == str((1 << 20) + 1)
    assert cpu_quantity(400) == "4"
    assert cpu_quantity(150) == "1500m"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("a(?=b)", "a lookaround"),
        ("(?<!x)y", "a lookaround"),
        ("(a)\\1", "a backreference"),
        ("(?P<n>a)(?P=n)", "a backreference"),
        ("(?>ab)", "an atomic group"),
        ("a*+", "a possessive quantifier"),
        ("qwen2\\.5-7b(:.*)?", None),
        ("[(?=]x", None),
        ("\\(?=", None),
        ("(?P<name>x)", None),
    ],
)
def test_regexes_an_re2_gateway_cannot_run(text: str, why: str | None) -> None:
    assert python_only_regex(text) == why


def test_dollar_escaping_survives_kubernetes_expansion() -> None:
    for text in ["$(HOME)", "$$(HOME)", "a$", "$", "$(", "x$(A)y$$z"]:
        assert expand(escape_dollars(text), lambda _: "EXPANDED") == text


# -- the mapping ----------------------------------------------------------------------------


def test_a_plain_http_provider(tmp_path: Path) -> None:
    e = run(provider(tmp_path, '[runtime.environment]\nTOKEN = "$(SECRET)"\n'))
    assert e.refused == []
    assert [o["kind"] for o in e.objects] == [
        "Deployment", "Service", "InterceptorRoute", "ScaledObject", "NetworkPolicy",
        "HTTPRoute", "ReferenceGrant",
    ]  # fmt: skip
    c = container(e)
    assert c["command"] == ["/srv/serve", "--port", "8080", "--host", "0.0.0.0"]
    assert {"name": "TOKEN", "value": "$$(SECRET)"} in c["env"]
    probe = c["startupProbe"]
    assert probe["httpGet"] == {"path": "/health", "port": "http"}
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 300
    so = kinds(e)["ScaledObject"]["spec"]
    assert (so["minReplicaCount"], so["maxReplicaCount"], so["cooldownPeriod"]) == (0, 1, 900)
    assert so["triggers"][0]["metadata"]["interceptorRoute"] == "m"
    ir = kinds(e)["InterceptorRoute"]["spec"]
    assert ir["target"] == {"service": "m", "port": 8101}
    assert ir["timeouts"] == {"readiness": "5m", "responseHeader": "1m"}
    assert "placeholder" not in str(ir)
    assert kinds(e)["Deployment"]["spec"]["strategy"] == {"type": "Recreate"}
    assert kinds(e)["Service"]["spec"]["ports"][0]["port"] == 8101
    route = kinds(e)["HTTPRoute"]["spec"]
    assert route["rules"][0]["timeouts"] == {"request": "6m"}


def test_limits_and_gpu_whole_card(tmp_path: Path) -> None:
    e = run(
        provider(
            tmp_path,
            '[limits]\nmemory_max = "16G"\ncpu_quota = "200%"\n'
            '[gpu]\ndevices = "auto"\ncount = 2\nvram_budget_gb = 7.5\nenforce = "warn"\n',
        ),
        lossy=True,
    )
    res = container(e)["resources"]
    assert res == {
        "requests": {"memory": "16Gi"},
        "limits": {"memory": "16Gi", "cpu": "2", "nvidia.com/gpu": 2},
    }
    spec = kinds(e)["Deployment"]["spec"]["template"]["spec"]
    term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"][0] == {
        "key": "nvidia.com/gpu.memory",
        "operator": "Gt",
        "values": ["7679"],
    }
    assert any("gpu.enforce: not carried by Kubernetes: nothing warns" in x for x in lines(e))


def test_gpu_hami_caps_memory_per_card(tmp_path: Path) -> None:
    e = run(provider(tmp_path, "[gpu]\nvram_budget_gb = 4\n"), gpu_sharing="hami")
    assert e.refused == []
    limits = container(e)["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 4096}
    assert "affinity" not in kinds(e)["Deployment"]["spec"]["template"]["spec"]


ADDRESS = 'address = "0.0.0.0:8101"'
READY = 'ready = "http:/health"'
COMMAND = 'command = ["/srv/serve", "--port", "{port}", "--host", "{host}"]'


@pytest.mark.parametrize(
    ("key", "old", "new", "text"),
    [
        ("gpu.enforce", "", "", "[gpu]\nvram_budget_gb = 4\n"),
        ("gpu.devices", "", "", "[gpu]\ndevices = [0]\n"),
        ("listen.allow", ADDRESS, ADDRESS + '\nallow = ["10.0.0.0/8"]', ""),
        ("listen.protocol", ADDRESS, ADDRESS + '\nprotocol = "tcp"', ""),
        ("runtime.ready", READY, 'ready = "notify"', ""),
        ("runtime.launch", COMMAND, 'launch = "m.launch:command"', ""),
        ("models.patterns", "", "", ""),
        ("runtime.credentials", "", "", '[runtime.credentials]\nHF_TOKEN = "/srv/present/hf"\n'),
    ],
)
def test_weakened_guarantees_refuse_unless_lossy(
    tmp_path: Path, key: str, old: str, new: str, text: str
) -> None:
    base = BASE.replace(old, new) if old else BASE
    path = write(tmp_path, "m.toml", base + text)
    p = manifest.parse_file(path, host=CASE_HOST)
    assert isinstance(p, Provider), p
    if key == "models.patterns":  # manifests refuse look-arounds; the export must too
        p = dataclasses.replace(p, model_patterns=("a(?=b)",))
    strict = run(p)
    assert strict.objects == [] and strict.refused == ["m"]
    mine = [x for x in lines(strict) if x.startswith(f"{path}: {key}: not carried by Kubernetes: ")]
    suffix = 'refusing to export "m" (--lossy exports it without this)'
    assert len([x for x in mine if x.endswith(suffix)]) == 1
    lossy = run(p, lossy=True)
    assert lossy.refused == [] and lossy.objects
    assert any(
        x.startswith(f"{path}: {key}: ") and x.endswith("given up (--lossy)") for x in lines(lossy)
    )
    c = container(lossy)
    if key == "runtime.launch":
        assert "command" not in c
    if key == "runtime.ready":
        assert c["startupProbe"]["tcpSocket"] == {"port": "http"}


def test_keys_that_are_lost_without_weakening_get_a_line_and_export(tmp_path: Path) -> None:
    text = BASE.replace('address = "0.0.0.0:8101"', 'address = "127.0.0.1:8101"\nmax_held = 8')
    text += 'idle_ignore_paths = ["/health"]\n[limits]\nmemory_max = "8G"\nmemory_high = "6G"\ntasks_max = 64\n'
    text += '[models]\npatterns = ["m-.*"]\n'
    path = write(tmp_path, "m.toml", text)
    p = manifest.parse_file(path, host=CASE_HOST)
    assert isinstance(p, Provider), p
    e = run(p)
    assert e.refused == []
    keys = [x.key for x in e.lines]
    assert keys == [
        "listen.address",
        "listen.max_held",
        "runtime.request_timeout_s",
        "runtime.idle_ignore_paths",
        "limits.memory_high",
        "limits.tasks_max",
        "models.patterns",
    ]  # fmt: skip   (in the key table's order)
    assert all(str(x).startswith(f"{path}: {x.key}: not carried by Kubernetes: ") for x in e.lines)
    assert container(e)["resources"]["requests"] == {"memory": "6Gi"}


def test_disabled_provider_is_paused_at_zero(tmp_path: Path) -> None:
    e = run(dataclasses.replace(provider(tmp_path, ""), enabled=False))
    notes = kinds(e)["ScaledObject"]["metadata"]["annotations"]
    assert notes == {"autoscaling.keda.sh/paused-replicas": "0"}


def test_host_network_has_no_network_policy(tmp_path: Path) -> None:
    e = run(provider(tmp_path, '[isolation]\nnetwork = "host"\n'), lossy=True)
    assert any(x.key == "isolation.network" and "given up" in x.message for x in e.lines)
    assert "NetworkPolicy" not in kinds(e)
    assert kinds(e)["Deployment"]["spec"]["template"]["spec"]["hostNetwork"] is True


def test_private_network_admits_only_the_interceptor(tmp_path: Path) -> None:
    policy = kinds(run(provider(tmp_path, "")))["NetworkPolicy"]["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"] and policy["egress"] == []
    source = policy["ingress"][0]["from"][0]
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "keda"}


def test_dir_manifest_working_directory_is_a_host_path(tmp_path: Path) -> None:
    p = provider(tmp_path, "", name="m/provider.toml")
    e = run(p)
    assert "workingDir" not in container(e)
    assert any(x.key == "runtime.working_directory" for x in e.lines)


def test_weights_are_read_only_host_paths(tmp_path: Path) -> None:
    e = run(provider(tmp_path, '[weights]\npaths = ["/srv/present/w"]\n'))
    assert container(e)["volumeMounts"] == [
        {"name": "weights-0", "mountPath": "/srv/present/w", "readOnly": True}
    ]


def test_models_route_by_header(tmp_path: Path) -> None:
    e = run(provider(tmp_path, '[models]\nnames = ["m-1"]\npatterns = ["m-2(:.*)?"]\n'))
    rule = kinds(e)["HTTPRoute"]["spec"]["rules"][0]
    headers = [m["headers"][0] for m in rule["matches"]]
    assert headers == [
        {"type": "Exact", "name": "X-Providerd-Provider", "value": "m"},
        {"type": "Exact", "name": "X-Gateway-Model-Name", "value": "m-1"},
        {"type": "RegularExpression", "name": "X-Gateway-Model-Name", "value": "^(?:m-2(:.*)?)$"},
    ]
    assert rule["filters"][0]["requestHeaderModifier"]["set"] == [
        {"name": "X-Providerd-Provider", "value": "m"}
    ]
    ir = kinds(e)["InterceptorRoute"]["spec"]["rules"]
    assert ir == [{"hosts": ["*"], "headers": [{"name": "X-Providerd-Provider", "value": "m"}]}]


def test_a_name_no_header_match_can_hold_refuses_even_lossy(tmp_path: Path) -> None:
    long = "m" * 5000  # manifests refuse names over 256 characters; the export must too
    p = dataclasses.replace(provider(tmp_path, '[models]\nnames = ["m1"]\n'), model_names=(long,))
    e = run(p, lossy=True)
    assert e.refused == ["m"] and e.objects == []
    assert any(
        x.key == "models.names" and x.message.endswith('"m" is not exported') for x in e.lines
    )


def test_many_models_spread_over_rules_and_routes(tmp_path: Path) -> None:
    names = ", ".join(f'"m-{i}"' for i in range(300))
    e = run(provider(tmp_path, f"[models]\nnames = [{names}]\n"))
    routes = [o for o in e.objects if o["kind"] == "HTTPRoute"]
    assert [r["metadata"]["name"] for r in routes] == [
        "providerd-models",
        "providerd-models-2",
        "providerd-models-3",
    ]
    total = 0
    for r in routes:
        rules = r["spec"]["rules"]
        assert len(rules) <= 16 and all(len(x["matches"]) <= 64 for x in rules)
        assert sum(len(x["matches"]) for x in rules) <= 128
        total += sum(len(x["matches"]) for x in rules)
    assert total == 301


def test_a_digit_slug_and_its_p_twin_collide(tmp_path: Path) -> None:
    one = provider(tmp_path / "a", "", name="1x.toml")
    twin = provider(tmp_path / "b", "", name="p_1x.toml")
    e = k.export([one, twin], k.Options("i"))
    assert sorted(e.refused) == ["1x", "p_1x"]
    assert [str(x) for x in e.lines] == [
        f'{one.source}: its Kubernetes name "p-1x" is also the name of provider "p_1x"; rename one of them',
        f'{twin.source}: its Kubernetes name "p-1x" is also the name of provider "1x"; rename one of them',
    ]
    assert e.objects == []


def test_no_reference_grant_in_the_add_ons_own_namespace(tmp_path: Path) -> None:
    e = run(provider(tmp_path, ""), namespace="keda")
    assert "ReferenceGrant" not in kinds(e)
    assert all(o["metadata"]["namespace"] == "keda" for o in e.objects)
    grant = kinds(run(provider(tmp_path, ""), namespace="ml"))["ReferenceGrant"]
    assert grant["metadata"]["namespace"] == "keda"
    assert grant["spec"]["from"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": "ml"}
    ]


def test_output_is_deterministic(tmp_path: Path) -> None:
    ps = [provider(tmp_path / str(i), "", name=f"m{i}.toml") for i in range(3)]
    a = k.export(ps, k.Options("i"))
    b = k.export(list(reversed(ps)), k.Options("i"))
    assert a == b


# -- the command -------------------------------------------------------------------------------


def export_cli(tmp_path: Path, *argv: str) -> tuple[int, str, str]:
    result = subprocess.run(
        [sys.executable, "-m", "agent", "export", "kubernetes", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PROVIDERD_TRUSTED_UID": str(os.getuid())},
        check=False,
    )
    return result.returncode, result.stdout, result.stderr


def test_cli_prints_yaml_and_exits_0(tmp_path: Path) -> None:
    path = write(tmp_path, "m.toml", BASE)
    rc, out, err = export_cli(tmp_path, str(path), "--image", "registry.example/m:1")
    assert rc == 0, err
    docs = list(yaml.safe_load_all(out))
    assert next(d["kind"] for d in docs) == "Deployment"
    assert "Traceback" not in err


def test_cli_writes_one_file_per_object(tmp_path: Path) -> None:
    path = write(tmp_path, "m.toml", BASE)
    out_dir = tmp_path / "out"
    rc, out, err = export_cli(
        tmp_path, str(path), "--image", "i", "-o", str(out_dir), "--namespace", "ml"
    )
    assert rc == 0, err
    names = sorted(os.listdir(out_dir))
    assert names == [
        "m.deployment.yaml", "m.interceptorroute.yaml", "m.networkpolicy.yaml", "m.scaledobject.yaml",
        "m.service.yaml", "providerd-ml.referencegrant.yaml", "providerd-models.httproute.yaml",
    ]  # fmt: skip
    assert sorted(out.splitlines()) == [str(out_dir / n) for n in names]  # each file, once
    doc = yaml.safe_load((out_dir / "m.service.yaml").read_text())
    assert doc["metadata"]["namespace"] == "ml"


def test_cli_bad_manifest_writes_nothing_and_exits_1(tmp_path: Path) -> None:
    good = write(tmp_path, "good.toml", BASE)
    bad = write(
        tmp_path, "bad.toml", BASE.replace("8101", "8102") + '[limits]\nmemory_max = "24 gigs"\n'
    )
    out_dir = tmp_path / "out"
    rc, _out, err = export_cli(tmp_path, str(good), str(bad), "--image", "i", "-o", str(out_dir))
    assert rc == 1
    assert f'{bad}: limits.memory_max: expected a size such as "24G"' in err
    assert not any(n.startswith("bad.") for n in os.listdir(out_dir))
    check = subprocess.run(
        [sys.executable, "-m", "agent", "check", str(bad)], capture_output=True, text=True,
        cwd=REPO, env={**os.environ, "PROVIDERD_TRUSTED_UID": str(os.getuid())}, check=False,
    )  # fmt: skip
    assert check.stdout.strip() in err  # the same problems as `check`


def test_gateway_in_another_namespace(tmp_path: Path) -> None:
    path = write(tmp_path, "m.toml", BASE)
    rc, out, err = export_cli(tmp_path, str(path), "--image", "i", "--gateway", "infra/shared")
    assert rc == 0, err
    route = next(d for d in yaml.safe_load_all(out) if d["kind"] == "HTTPRoute")
    assert route["spec"]["parentRefs"] == [{"name": "shared", "namespace": "infra"}]


def test_cli_output_onto_a_file_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "m.toml", BASE)
    (tmp_path / "taken").write_text("")
    rc, out, err = export_cli(tmp_path, str(path), "--image", "i", "-o", str(tmp_path / "taken"))
    assert rc == 1 and out == ""
    assert f"providerctl: Failed to write {tmp_path / 'taken'}: " in err and "Traceback" not in err


def test_cli_refusal_exits_1_with_a_hint(tmp_path: Path) -> None:
    path = write(
        tmp_path, "m.toml", BASE.replace('"0.0.0.0:8101"', '"0.0.0.0:8101"\nallow = ["10.0.0.0/8"]')
    )
    rc, out, err = export_cli(tmp_path, str(path), "--image", "i")
    assert rc == 1 and out == ""
    assert "providerctl: not exported: m" in err and "Hint: --lossy" in err
    rc, out, err = export_cli(tmp_path, str(path), "--image", "i", "--lossy")
    assert rc == 0 and "given up (--lossy)" in err and out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--image", ""], "--image: expected a container image"),
        (["--image", "a b"], "--image: expected a container image"),
        (["--image", "i", "--namespace", "Bad_NS"], "--namespace: expected a Kubernetes namespace"),
        (["--image", "i", "--gateway=-x"], "--gateway: expected a Gateway as NAME"),
        (["--image", "i", "--gateway", "a/b/c"], "--gateway: expected a Gateway as NAME"),
        (["--image", "i", "--gpu-sharing", "mig"], "invalid choice"),
        ([], "the following arguments are required: --image"),
    ],
)
def test_cli_usage_errors_exit_2(tmp_path: Path, argv: list[str], message: str) -> None:
    path = write(tmp_path, "m.toml", BASE)
    rc, _out, err = export_cli(tmp_path, str(path), *argv)
    assert rc == 2 and message in err and "Traceback" not in err


def test_cli_missing_path_exits_4(tmp_path: Path) -> None:
    rc, out, err = export_cli(tmp_path, str(tmp_path / "nope.toml"), "--image", "i")
    assert rc == 4 and "No such file or directory" in err and out == ""


def test_cli_in_process_matches_subprocess(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "m.toml", BASE)
    assert cli.main(["export", "kubernetes", str(path), "--image", "i"]) == 0
    assert capsys.readouterr().out == export_cli(tmp_path, str(path), "--image", "i")[1]


def test_export_reads_only_the_spec_side() -> None:
    code = (
        "import sys, agent.export.main, agent.export.kubernetes;"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('agent'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout.split()
    forbidden = {
        "agent.front.front", "agent.net.proxy", "agent.net.http", "agent.router.router", "agent.net.sockio",
        "agent.net.listeners", "agent.gpu.nvml", "agent.gpu.placement", "agent.gpu.admission",
        "agent.front.gpu_hooks", "agent.gpu.vram", "agent.worker.control", "agent.worker.wrapper",
        "agent.gpu.reservations",
    }  # fmt: skip
    assert not forbidden & set(loaded), loaded
    assert "agent.spec.manifest" in loaded
