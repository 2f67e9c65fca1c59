"""Placement and admission planning (pure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.gpu.nvml import GIB, Card
from agent.gpu.placement import (
    Holder,
    Placement,
    Plan,
    Refusal,
    budget_bytes,
    device_allow,
    need_bytes,
    plan_admission,
    subtract_pending,
    worker_env,
)
from agent.spec.provider import Provider


def provider(slug: str = "esm", **kw: object) -> Provider:
    kw.setdefault("gpu_devices", "auto")
    return Provider(slug=slug, source=Path(f"/etc/providerd/providers/{slug}.toml"), **kw)  # type: ignore[arg-type]


def card(index: int, free_gib: float, total_gib: float = 80, minor: int | None = None) -> Card:
    return Card(
        index,
        f"GPU-{index:04d}",
        "Test GPU",
        int(total_gib * GIB),
        int(free_gib * GIB),
        index if minor is None else minor,
    )


def holder(slug: str, idx: int, gib: float, busy: int = 0, last: float = 0.0) -> Holder:
    return Holder(slug, (f"GPU-{idx:04d}",), int(gib * GIB), busy, last)


def test_auto_takes_the_card_with_the_most_free_memory() -> None:
    plan = plan_admission(provider(), 10 * GIB, [card(0, 20), card(1, 50), card(2, 30)], [], 0)
    assert isinstance(plan, Plan)
    assert plan.placement.indices == (1,)
    assert plan.victims == ()


def test_auto_with_count_takes_that_many_cards_in_index_order() -> None:
    cards = [card(0, 20), card(1, 50), card(2, 30), card(3, 5)]
    plan = plan_admission(provider(gpu_count=2), 10 * GIB, cards, [], 0)
    assert isinstance(plan, Plan)
    assert plan.placement.indices == (1, 2)


def test_headroom_counts_towards_what_must_be_free() -> None:
    plan = plan_admission(provider(), 10 * GIB, [card(0, 10.5)], [], 1 * GIB)
    assert isinstance(plan, Refusal)
    plan = plan_admission(provider(), 10 * GIB, [card(0, 11)], [], 1 * GIB)
    assert isinstance(plan, Plan)
    assert plan.need_bytes == 11 * GIB


def test_pinned_by_index_and_uuid() -> None:
    cards = [card(0, 70), card(1, 20), card(2, 30)]
    plan = plan_admission(provider(gpu_devices=(2,)), 10 * GIB, cards, [], 0)
    assert isinstance(plan, Plan) and plan.placement.indices == (2,)
    plan = plan_admission(provider(gpu_devices=("gpu-0001", 2)), 10 * GIB, cards, [], 0)
    assert isinstance(plan, Plan) and plan.placement.indices == (1, 2)


def test_pinned_to_a_missing_card_is_refused_for_good() -> None:
    plan = plan_admission(provider(gpu_devices=(5,)), GIB, [card(0, 70), card(1, 70)], [], 0)
    assert isinstance(plan, Refusal)
    assert plan.permanent
    assert "GPU 5" in plan.message and "cards: 0, 1" in plan.message


def test_more_than_the_card_holds_is_refused_for_good_without_victims() -> None:
    h = [holder("other", 0, 70)]
    plan = plan_admission(provider(), 90 * GIB, [card(0, 10)], h, 0)
    assert isinstance(plan, Refusal)
    assert plan.permanent
    assert "more than its card holds (80.0 GiB)" in plan.message


def test_count_beyond_the_host_is_refused_for_good() -> None:
    plan = plan_admission(provider(gpu_count=3), GIB, [card(0, 70), card(1, 70)], [], 0)
    assert isinstance(plan, Refusal) and plan.permanent


def test_retires_the_least_recently_used_idle_provider() -> None:
    holders = [holder("newer", 0, 36, last=200), holder("older", 0, 36, last=100)]
    plan = plan_admission(provider(), 36 * GIB, [card(0, 8)], holders, 0)
    assert isinstance(plan, Plan)
    assert plan.victims == ("older",)
    assert plan.placement.indices == (0,)


def test_never_retires_a_busy_provider() -> None:
    holders = [holder("busy", 0, 36, busy=2, last=1), holder("idle", 0, 36, last=500)]
    plan = plan_admission(provider(), 36 * GIB, [card(0, 8)], holders, 0)
    assert isinstance(plan, Plan)
    assert plan.victims == ("idle",)


def held(
    slug: str, gib: float, *, last: float = 0.0, priority: int = 0, pinned: bool = False
) -> Holder:
    return Holder(slug, ("GPU-0000",), int(gib * GIB), 0, last, priority, pinned)


def test_never_retires_a_pinned_provider_and_says_so() -> None:
    holders = [held("chat", 36, last=1, pinned=True), held("idle", 36, last=500)]
    plan = plan_admission(provider(), 36 * GIB, [card(0, 8)], holders, 0)
    assert isinstance(plan, Plan) and plan.victims == ("idle",)
    plan = plan_admission(provider(), 36 * GIB, [card(0, 8)], holders[:1], 0)
    assert isinstance(plan, Refusal) and not plan.permanent
    assert "held by chat (pinned)" in plan.message
    assert plan.body()["holders"] == [
        {"slug": "chat", "busy": False, "requests_in_flight": 0, "kept": "pinned"}
    ]


def test_never_retires_a_provider_of_higher_priority_and_says_so() -> None:
    holders = [held("big", 36, last=1, priority=5)]
    plan = plan_admission(provider(gpu_priority=0), 36 * GIB, [card(0, 8)], holders, 0)
    assert isinstance(plan, Refusal)
    assert "held by big (priority 5, above 0)" in plan.message
    assert plan.body()["holders"][0]["kept"] == "priority 5, above 0"
    # The same holder gives way to a provider of equal or higher priority.
    for mine in (5, 9):
        plan = plan_admission(provider(gpu_priority=mine), 36 * GIB, [card(0, 8)], holders, 0)
        assert isinstance(plan, Plan) and plan.victims == ("big",), mine


def test_lower_priority_goes_first_then_least_recently_used_among_equals() -> None:
    holders = [
        held("old_high", 36, last=1, priority=3),
        held("new_low", 36, last=900, priority=-2),
        held("mid_b", 36, last=300, priority=0),
        held("mid_a", 36, last=200, priority=0),
    ]
    plan = plan_admission(provider(gpu_priority=3), 36 * GIB, [card(0, 8)], holders, 0)
    assert isinstance(plan, Plan) and plan.victims == ("new_low",)
    # Needing room for two: the lowest priority, then the older of the equals.
    plan = plan_admission(provider(gpu_priority=3), 72 * GIB, [card(0, 8, 100)], holders, 0)
    assert isinstance(plan, Plan) and plan.victims == ("new_low", "mid_a")
    # A provider of priority 0 may take the equals but never old_high, however idle.
    plan = plan_admission(provider(), 108 * GIB, [card(0, 8, 150)], holders, 0)
    assert isinstance(plan, Plan) and plan.victims == ("new_low", "mid_a", "mid_b")
    plan = plan_admission(provider(), 140 * GIB, [card(0, 8, 150)], holders, 0)
    assert isinstance(plan, Refusal)
    assert "old_high (priority 3, above 0)" in plan.message


def test_a_refusal_says_why_each_holder_was_kept() -> None:
    holders = [
        Holder("busy", ("GPU-0000",), 20 * GIB, 2, 0.0),
        held("pin", 20, pinned=True),
        held("vip", 20, priority=1),
        held("small", 1),
    ]
    plan = plan_admission(provider(), 60 * GIB, [card(0, 1)], holders, 0)
    assert isinstance(plan, Refusal)
    kept = {h["slug"]: h.get("kept") for h in plan.body()["holders"]}
    assert kept == {
        "busy": "busy, 2 in flight",
        "pin": "pinned",
        "vip": "priority 1, above 0",
        "small": None,
    }
    assert "small (idle)" in plan.message


def test_each_holder_is_judged_once_per_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why a holder is kept is decided once, and the plan, the message and the 503's
    body all say the same thing."""
    from agent.gpu import placement

    asked: list[str] = []
    real = placement.kept_because

    def counting(p: Provider, h: Holder) -> str | None:
        asked.append(h.slug)
        return real(p, h)

    monkeypatch.setattr(placement, "kept_because", counting)
    holders = [
        Holder("busy", ("GPU-0000", "GPU-0001"), 20 * GIB, 2, 0.0),
        held("pin", 20, pinned=True),
        held("small", 1),
        holder("elsewhere", 7, 20),  # on a card this provider cannot use: not judged
    ]
    plan = plan_admission(provider(gpu_count=2), 60 * GIB, [card(0, 1), card(1, 1)], holders, 0)
    assert isinstance(plan, Refusal)
    assert sorted(asked) == ["busy", "pin", "small"]
    assert plan.message.count("busy (busy, 2 in flight)") == 2  # named on both its cards
    assert plan.kept == (("busy", "busy, 2 in flight"), ("pin", "pinned"))


def test_refuses_naming_the_holders_when_only_busy_ones_could_make_room() -> None:
    holders = [holder("llama", 0, 36, busy=3), holder("bert", 0, 36, busy=1)]
    plan = plan_admission(provider(), 36 * GIB, [card(0, 8)], holders, 0)
    assert isinstance(plan, Refusal)
    assert not plan.permanent
    assert plan.holders == (("bert", 1), ("llama", 3))
    assert "llama (busy, 3 in flight)" in plan.message
    body = plan.body()
    assert body["holders"] == [
        {"slug": "bert", "busy": True, "requests_in_flight": 1, "kept": "busy, 1 in flight"},
        {"slug": "llama", "busy": True, "requests_in_flight": 3, "kept": "busy, 3 in flight"},
    ]
    text = json.dumps(body)
    assert "/etc" not in text and "127.0.0.1" not in text


def test_takes_several_victims_in_lru_order_until_it_fits() -> None:
    holders = [holder("a", 0, 20, last=1), holder("b", 0, 20, last=2), holder("c", 0, 20, last=3)]
    plan = plan_admission(provider(), 45 * GIB, [card(0, 10)], holders, 0)
    assert isinstance(plan, Plan)
    assert plan.victims == ("a", "b")


def test_drops_victims_that_turn_out_not_to_be_needed() -> None:
    # The oldest one is small; retiring the second alone is enough.
    holders = [holder("tiny", 0, 2, last=1), holder("big", 0, 40, last=2)]
    plan = plan_admission(provider(), 40 * GIB, [card(0, 5)], holders, 0)
    assert isinstance(plan, Plan)
    assert plan.victims == ("big",)


def test_victims_on_other_cards_are_left_alone() -> None:
    holders = [holder("on1", 1, 60, last=1), holder("on0", 0, 60, last=2)]
    plan = plan_admission(
        provider(gpu_devices=(0,)), 50 * GIB, [card(0, 10), card(1, 10)], holders, 0
    )
    assert isinstance(plan, Plan)
    assert plan.victims == ("on0",)


def test_auto_prefers_retiring_on_a_card_where_it_then_fits() -> None:
    # LRU on card 1 frees enough there; card 0's holder is more recent and stays.
    holders = [holder("old1", 1, 40, last=1), holder("new0", 0, 40, last=9)]
    plan = plan_admission(provider(), 45 * GIB, [card(0, 20), card(1, 10)], holders, 0)
    assert isinstance(plan, Plan)
    assert plan.victims == ("old1",)
    assert plan.placement.indices == (1,)


def test_cpu_provider_needs_nothing() -> None:
    plan = plan_admission(provider(gpu_devices="none"), 0, [], [], GIB)
    assert isinstance(plan, Plan)
    assert plan.placement == Placement()


def test_need_is_the_larger_of_budget_and_measured_peak() -> None:
    p = provider(vram_budget_gb=18.5)
    assert budget_bytes(p) == int(18.5 * GIB)
    assert need_bytes(p, None) == int(18.5 * GIB)
    assert need_bytes(p, 20 * GIB) == 20 * GIB
    assert need_bytes(p, 10 * GIB) == int(18.5 * GIB)
    assert need_bytes(provider(), None) == 0
    assert need_bytes(provider(), 3 * GIB) == 3 * GIB


def test_pending_reservations_reduce_free_memory() -> None:
    cards = subtract_pending(
        [card(0, 50), card(1, 50)], {"GPU-0000": 45 * GIB, "GPU-0001": 60 * GIB}
    )
    assert [c.free for c in cards] == [5 * GIB, 0]


def test_device_rules_and_environment_name_exactly_the_chosen_cards() -> None:
    placement = Placement((card(1, 10, minor=3), card(2, 10, minor=2)))
    rules = device_allow(placement)
    assert ("/dev/nvidiactl", "rw") in rules
    assert ("/dev/nvidia-uvm", "rw") in rules
    assert ("/dev/nvidia3", "rw") in rules and ("/dev/nvidia2", "rw") in rules
    assert not any(path in ("char-nvidia", "char-nvidiactl", "/dev/nvidia0") for path, _ in rules)
    assert worker_env(placement) == {
        "CUDA_VISIBLE_DEVICES": "GPU-0001,GPU-0002",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


def test_no_gpu_gives_no_rules_and_hides_every_card() -> None:
    assert device_allow(Placement()) == []
    assert worker_env(Placement())["CUDA_VISIBLE_DEVICES"] == ""
