"""GPU providers under a real systemd and kernel, on two fake cards.

NVML is `agent.gpu.nvml.DirNvml` (the workers, `tests/gpu/cuda_worker.py`, write what they
hold to its directory); the device nodes are real nodes of NVIDIA's major with no
driver, so an open gives ENXIO where the worker's device rules allow it and EPERM
where the kernel refuses it. What the fronts do is the product's real systemd path:
placement, DeviceAllow= set over D-Bus, worker.env, the unit's PIDs for VRAM
sampling, retirement through the other fronts' control sockets, enforcement, and the
release at the idle deadline. Every test reads one check of the single VM run.
"""

from __future__ import annotations

import json
from typing import Any

CARDS = [f"GPU-00000000-0000-4000-8000-00000000000{i}" for i in range(2)]


def ok(response: dict[str, Any]) -> dict[str, Any]:
    assert response.get("status") == 200, response
    return dict(json.loads(response["body"]))


def test_each_worker_sees_only_its_own_card(vm: dict[str, dict[str, Any]]) -> None:
    check = vm["gpu_placement"]
    a, b = ok(check["a"]), ok(check["b"])
    # "auto" takes the card with the most free memory: a and b end up on different cards
    assert {a["CUDA_VISIBLE_DEVICES"], b["CUDA_VISIBLE_DEVICES"]} == set(CARDS)
    assert a["CUDA_DEVICE_ORDER"] == b["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    for info in (a, b):
        mine = CARDS.index(info["CUDA_VISIBLE_DEVICES"])
        other = 1 - mine
        # allowed, and the open reaches the (absent) driver; the other card is refused
        assert info["nodes"][f"/dev/nvidia{mine}"] == "ENXIO", info["nodes"]
        assert info["nodes"][f"/dev/nvidia{other}"] == "EPERM", info["nodes"]
        assert info["nodes"]["/dev/nvidiactl"] == "ENXIO", info["nodes"]
    for slug, info in (("gpu_a", a), ("gpu_b", b)):
        props = check["allow"][slug]
        mine = CARDS.index(info["CUDA_VISIBLE_DEVICES"])
        assert props["DevicePolicy"] == "closed"
        rules = props["DeviceAllow"].split("; ")
        assert f"/dev/nvidia{mine} rw" in rules, props
        assert f"/dev/nvidia{1 - mine} rw" not in rules, props
        assert "char-nvidia rw" not in rules, props  # the class would allow every card
    print(f"cold start of a GPU provider in the VM: {check['cold_start_s']} s")


def test_a_start_retires_the_idle_provider_never_the_busy_one(
    vm: dict[str, dict[str, Any]],
) -> None:
    a = ok(vm["gpu_placement"]["a"])
    b = ok(vm["gpu_placement"]["b"])
    check = vm["gpu_retire"]
    c = ok(check["c"])
    assert check["active"] == {"gpu_a": "active", "gpu_b": "inactive", "gpu_c": "active"}, check[
        "journal"
    ]
    assert c["CUDA_VISIBLE_DEVICES"] == b["CUDA_VISIBLE_DEVICES"]  # b's card, now free
    slow = ok(check["slow"])  # the busy request on a was served, by the same worker
    assert slow["pid"] == a["pid"]
    assert "Retired gpu_b to make room on the GPU" in check["journal"]
    print(f"start of c retiring b: {check['start_s']} s")


def test_status_json_says_who_holds_each_card(vm: dict[str, dict[str, Any]]) -> None:
    check = vm["gpu_retire"]
    assert check["status"]["rc"] == 0, check["status"]
    doc = json.loads(check["status"]["out"])
    a = ok(vm["gpu_placement"]["a"])
    holders = {card["uuid"]: sorted(card["held_by"]) for card in doc["gpus"]}
    assert holders[a["CUDA_VISIBLE_DEVICES"]] == ["gpu_a"], doc["gpus"]
    assert sorted(holders) == CARDS
    providers = {p["slug"]: p for p in doc["providers"]}
    assert providers["gpu_a"]["gpu"]["uuids"] == [a["CUDA_VISIBLE_DEVICES"]]
    assert providers["gpu_a"]["gpu"]["used_bytes"] >= 8 << 30  # sampled from the unit's PIDs


def test_no_room_refuses_naming_the_busy_holders_and_never_cuts_them(
    vm: dict[str, dict[str, Any]],
) -> None:
    check = vm["gpu_refused"]
    assert check["d"]["status"] == 503, check["d"]
    doc = json.loads(check["d"]["body"])
    why = f"{doc}\n{check.get('journal', '')}"
    assert doc["provider"] == "gpu_d"
    assert doc["message"].startswith("Not enough GPU memory for gpu_d"), why
    holders = {h["slug"]: h for h in doc["holders"]}
    assert set(holders) == {"gpu_a", "gpu_c"}, why
    assert all(h["busy"] and h["requests_in_flight"] >= 1 for h in holders.values()), doc
    assert "/" not in json.dumps(doc["holders"])  # no host paths, no addresses
    assert 3.5 < check["d_s"] < 30, check  # it waited its start timeout (4 s) for room
    assert all(ok(r) for r in check["busy"])  # the busy ones were served, never cut
    assert check["worker"] == "inactive"
    assert check["huge"]["status"] == 503, check["huge"]
    assert json.loads(check["huge"]["body"])["provider"] == "gpu_huge"
    assert check["huge_s"] < 60, check  # can never fit: refused without waiting its 120 s
    print(f"refused after {check['d_s']} s (start timeout 4 s); too large: {check['huge_s']} s")


def test_a_worker_over_its_vram_budget_is_stopped(vm: dict[str, dict[str, Any]]) -> None:
    check = vm["gpu_over_budget"]
    assert check["state"] in ("inactive", "failed"), check
    assert "over its budget of 10.0 GiB" in check["journal"], check["journal"]
    print(f"over-budget worker stopped after {check['stopped_after_s']} s")


def test_the_cards_memory_is_back_within_a_second_of_the_idle_deadline(
    vm: dict[str, dict[str, Any]],
) -> None:
    check = vm["gpu_idle"]
    idle = ok(check["idle"])
    a = ok(vm["gpu_placement"]["a"])
    # the card with the most free memory: not a's, since c was stopped on the other one
    assert idle["CUDA_VISIBLE_DEVICES"] != a["CUDA_VISIBLE_DEVICES"], check["journal"]
    back = check["back_after_deadline_s"]
    assert back is not None, check["journal"]
    assert -0.5 < back < 1.0, check
    assert check["worker"] == "inactive"
    print(f"memory back after the idle deadline: {back} s (fake NVML's release delay 0.11 s)")
