"""The GPU's small values (agent.gpu.frozen): compared, hashed and shown by their fields,
never changed once made, as the frozen dataclasses they replace were."""

from __future__ import annotations

import copy
import pickle

import pytest

from agent.gpu.nvml import Card, GpuProcess
from agent.gpu.placement import Placement, Plan, Refusal, Request
from agent.gpu.reservations import Reservation


def card(free: int = 5) -> Card:
    return Card(0, "GPU-a", "Fake GPU", 10, free, 0)


def test_equal_by_their_fields_and_hashed_alike() -> None:
    assert card() == card() and hash(card()) == hash(card())
    assert card() != card(free=4)
    assert {card(), card(), card(free=4)} == {card(), card(free=4)}
    assert Plan(Placement((card(),)), (), 1) == Plan(Placement((card(),)), (), 1)
    assert Refusal("no") == Refusal("no", (), False, ())
    # Another kind of value with the same fields is another value.
    assert GpuProcess(1, "GPU-a", 2) != Reservation("1", ("GPU-a",), 2)
    assert card() != (0, "GPU-a", "Fake GPU", 10, 5, 0, "")


def test_shown_by_their_fields() -> None:
    assert repr(GpuProcess(7, "GPU-a", 3)) == "GpuProcess(card_uuid='GPU-a', pid=7, used=3)"


def test_never_changed_once_made() -> None:
    c = card()
    with pytest.raises(AttributeError, match="cannot assign to field 'free' of Card"):
        c.free = 0  # type: ignore[misc]
    with pytest.raises(AttributeError, match="cannot delete"):
        del c.free  # type: ignore[misc]
    with pytest.raises(AttributeError):
        c.other = 1  # type: ignore[attr-defined]
    assert c.with_free(1).free == 1 and c.free == 5
    assert c.with_free(1) == Card(0, "GPU-a", "Fake GPU", 10, 1, 0)


def test_a_request_asks_as_its_fields_say() -> None:
    auto = Request("g", "auto", 2, 4.0, 1)
    assert (auto.gpu_devices, auto.gpu_count, auto.vram_budget_gb, auto.gpu_priority) == (
        "auto",
        2,
        4.0,
        1,
    )
    assert auto.uses_gpu and not Request("c", "none").uses_gpu
    assert Request("g", (0, "GPU-b")) == Request("g", (0, "GPU-b"), 1, None, 0)


def test_copied_and_pickled_as_they_are() -> None:
    plan = Plan(Placement((card(), card(free=1))), ("old",), 3)
    assert copy.copy(plan) == plan and copy.deepcopy(plan) == plan
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert pickle.loads(pickle.dumps(Request("g", (1,), 1, None, 2))) == Request(
        "g", (1,), 1, None, 2
    )
