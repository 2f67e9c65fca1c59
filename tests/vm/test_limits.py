"""Limits enforced by a real kernel: memory_max, tasks_max, DevicePolicy, and memory shown by status.

Every test reads one check of the single VM run (see conftest.py and payload/run_tests.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

MiB = 1 << 20


def body(response: dict[str, Any]) -> str:
    return str(response.get("body") or response.get("error") or "")


def test_the_vm_runs_pure_cgroup_v2_under_systemd(vm: dict[str, dict[str, Any]]) -> None:
    env = vm["env"]
    print(
        f"VM: {env['kernel']}, {env['systemd']}, image {vm['_timing']['image_s']} s, run {vm['_timing']['vm_s']} s"
    )
    assert env["cgroup_fs"] == "cgroup2fs"
    assert {"memory", "pids", "cpu"} <= set(env["controllers"])


def test_the_deb_installs_under_systemd(vm: dict[str, dict[str, Any]]) -> None:
    install = vm["install"]
    assert install["rc"] == 0, install["out"] + install["err"]
    assert vm["reload"]["rc"] == 0, vm["reload"]["out"] + vm["reload"]["err"]


def test_memory_max_while_loading_oom_kills_and_held_requests_learn_why(
    vm: dict[str, dict[str, Any]],
) -> None:
    oom = vm["oom_start"]
    assert oom["worker"]["Result"] == "oom-kill", oom
    assert oom["worker"]["MemoryMax"] == str(96 * MiB)
    for response in oom["responses"]:
        assert response["status"] == 503, response
        doc = json.loads(body(response))
        assert doc.get("error") == "start_failed", doc
        error = str(doc.get("message", ""))
        assert re.search(r"oom|out of memory|memory", error, re.I), (
            f"the error does not name the cause: {error!r}"
        )
    assert oom["socket_active"] == "active" and oom["listening"], oom
    assert "oom" in oom["kernel_log"].lower() or "oom" in oom["journal"].lower(), oom


def test_memory_max_while_serving_oom_kills_and_the_port_stays(
    vm: dict[str, dict[str, Any]],
) -> None:
    oom = vm["oom_serve"]
    assert oom["first"]["status"] == 200, oom["first"]
    assert oom["grow"]["status"] == 503, oom["grow"]
    doc = json.loads(body(oom["grow"]))
    assert doc.get("error") == "worker_gone", doc
    error = str(doc.get("message", ""))
    assert re.search(r"oom|memory", error, re.I), f"the error does not name the cause: {error!r}"
    assert oom["worker"]["Result"] == "oom-kill", oom["worker"]
    assert oom["listening"]
    assert oom["after"]["status"] in (200, 503), oom[
        "after"
    ]  # served again, or in backoff with a reason


def test_tasks_max_is_enforced(vm: dict[str, dict[str, Any]]) -> None:
    tasks = vm["tasks"]
    assert tasks["worker"]["TasksMax"] == "24"
    assert tasks["response"]["status"] == 200, tasks["response"]
    started = json.loads(tasks["response"]["body"])["threads_started"]
    assert 0 < started < 24, f"{started} threads started with tasks_max = 24"


def test_a_device_the_manifest_does_not_allow_cannot_be_opened(
    vm: dict[str, dict[str, Any]],
) -> None:
    dev = vm["device"]
    assert dev["control"] == "ok"  # the node itself opens from outside the worker
    assert dev["worker"]["DevicePolicy"] == "closed"
    assert dev["response"]["status"] == 200, dev["response"]
    assert json.loads(dev["response"]["body"])["open"] == "EPERM"


def memory_figures(doc: Any, key: str = "") -> list[int]:
    """Every integer under a key that mentions memory, anywhere in the status document."""
    if isinstance(doc, dict):
        return [n for k, v in doc.items() for n in memory_figures(v, f"{key}.{k}")]
    if isinstance(doc, list):
        return [n for v in doc for n in memory_figures(v, key)]
    if isinstance(doc, int) and not isinstance(doc, bool) and "mem" in key.lower():
        return [doc]
    return []


def test_providerctl_status_shows_the_workers_real_memory(vm: dict[str, dict[str, Any]]) -> None:
    mem = vm["memory_status"]
    assert mem["response"]["status"] == 200, mem["response"]
    current = int(mem["memory_current"])
    assert current >= 150 * MiB
    status = mem["status_json"]
    assert status["rc"] == 0, status
    figures = memory_figures(json.loads(status["out"]))
    assert any(150 * MiB <= n <= 512 * MiB for n in figures), (
        f"no memory figure near {current} in {status['out']}"
    )
    print(mem["status_text"]["out"])


def test_stopping_every_provider_is_prompt(vm: dict[str, dict[str, Any]]) -> None:
    stop = vm["stop_all"]
    assert stop["rc"] == 0
    assert stop["seconds"] < 30, f"systemctl stop took {stop['seconds']} s:\n{stop['journal']}"


def test_a_host_network_worker_reaches_no_other_front_on_loopback(
    vm: dict[str, dict[str, Any]],
) -> None:
    check = vm["hostnet"]
    assert check["served"]["status"] == 200, check["served"]
    own = check["own"]
    assert own.startswith("127.") and own != "127.0.0.1", check
    for target, response in check["reach"].items():
        outcome = json.loads(response["body"])["outcome"]
        assert not outcome.startswith("ok"), f"the host-network worker reached {target}: {check}"
