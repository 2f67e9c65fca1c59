"""The status record: what a front answers reads back as the same record, and the
manifest's fields appear only where there is a manifest."""

from __future__ import annotations

import json

from agent.front.status import Memory, ProviderStatus, inactive


def test_a_front_answer_reads_back_as_the_same_record() -> None:
    record = ProviderStatus(
        "llm",
        "ready",
        in_flight=2,
        served=7,
        last_start={"at": 1.0, "took_s": 2.5, "result": "ready"},
        memory=Memory(1 << 30, 2 << 30),
        gpu={"uuids": ["GPU-1"]},
        counters={"served": 7},
        front="running",
    )
    assert ProviderStatus.from_json(json.loads(json.dumps(record.to_json()))) == record


def test_fields_a_record_does_not_know_are_dropped() -> None:
    answer = inactive("x", False, None).to_json() | {"from_a_newer_front": 1}
    assert ProviderStatus.from_json(answer) == inactive("x", False, None)


def test_the_manifest_fields_only_with_a_manifest() -> None:
    bare = inactive("x", True, {"served": 1}).to_json()
    assert {"listen", "description", "socket"}.isdisjoint(bare)
    assert bare["memory"] == {"current": None, "max": None}
    assert (bare["state"], bare["front"], bare["pinned"], bare["gpu"]) == (
        "inactive",
        "inactive",
        True,
        {},
    )
    full = inactive("x", False, None).with_manifest(["127.0.0.1:1"], "", "unknown").to_json()
    assert (full["listen"], full["description"], full["socket"]) == (["127.0.0.1:1"], "", "unknown")
