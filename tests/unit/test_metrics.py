"""The metrics service in-process: real control sockets, real HTTP, prometheus_client's parser."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.net import free_port

from agent.metrics import service as metrics
from agent.net import counters, rpc
from agent.net.counters import Counters


def parse(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def saved(slug: str, served: int, starts: tuple[float, ...] = ()) -> None:
    c = Counters(served=served)
    for s in starts:
        c.count_start(s)
    c.count_refused("gpu_unavailable")
    c.dirty = True
    counters.save(slug, c, metrics.log)


def test_an_idle_provider_is_listed_with_its_saved_counters(tmp_path: Path) -> None:
    saved("esm", 7, (0.4, 3.0))
    got = parse(metrics.render(asyncio.run(metrics.gather(["esm", "never"], tmp_path / "run"))))
    assert value(got, "providerd_provider_state", provider="esm", state="inactive") == 1
    assert value(got, "providerd_provider_state", provider="esm", state="ready") == 0
    assert value(got, "providerd_requests_served_total", provider="esm") == 7
    assert (
        value(got, "providerd_requests_refused_total", provider="esm", cause="gpu_unavailable") == 1
    )
    assert value(got, "providerd_cold_starts_total", provider="esm") == 2
    h = "providerd_cold_start_duration_seconds"
    assert value(got, f"{h}_bucket", provider="esm", le="0.5") == 1
    assert value(got, f"{h}_bucket", provider="esm", le="5.0") == 2
    assert value(got, f"{h}_bucket", provider="esm", le="+Inf") == 2
    assert value(got, f"{h}_count", provider="esm") == 2
    assert value(got, f"{h}_sum", provider="esm") == pytest.approx(3.4)
    # A provider that never ran: listed, all zero.
    assert value(got, "providerd_requests_served_total", provider="never") == 0
    assert value(got, "providerd_requests_in_flight", provider="never") == 0


def test_a_running_front_answers_for_itself(tmp_path: Path) -> None:
    rt = tmp_path / "run"
    saved("llm", 1)  # older than what the running front says: the front wins
    live = Counters(served=12, cold_starts=3).to_json()

    async def go() -> bytes:
        async def handle(req: dict[str, Any]) -> dict[str, Any]:
            assert req == {"op": "status", "peer_uid": os.getuid()}  # the server adds who asks
            return {
                "state": "ready",
                "in_flight": 2,
                "waiting": 1,
                "memory": {"current": 5 << 20, "max": None},
                "gpu": {"need_bytes": 9 << 30, "used_bytes": 8 << 30},
                "counters": live,
            }

        server = await rpc.serve(rt / "llm" / "control.sock", handle)
        try:
            return metrics.render(await metrics.gather(["llm"], rt))
        finally:
            server.close()

    got = parse(asyncio.run(go()))
    assert value(got, "providerd_provider_state", provider="llm", state="ready") == 1
    assert value(got, "providerd_requests_in_flight", provider="llm") == 2
    assert value(got, "providerd_requests_waiting", provider="llm") == 1
    assert value(got, "providerd_worker_memory_bytes", provider="llm") == 5 << 20
    assert value(got, "providerd_vram_reserved_bytes", provider="llm") == 9 << 30
    assert value(got, "providerd_vram_used_bytes", provider="llm") == 8 << 30
    assert value(got, "providerd_requests_served_total", provider="llm") == 12


def test_a_stale_control_socket_falls_back_to_the_saved_counters(tmp_path: Path) -> None:
    rt = tmp_path / "run"
    (rt / "gone").mkdir(parents=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(rt / "gone" / "control.sock"))  # bound, never listening: a dead front's leftover
    s.close()
    saved("gone", 4)
    got = parse(metrics.render(asyncio.run(metrics.gather([], rt))))
    assert value(got, "providerd_provider_state", provider="gone", state="inactive") == 1
    assert value(got, "providerd_requests_served_total", provider="gone") == 4


def test_hostile_status_values_become_zero() -> None:
    s = metrics.sample_from_status(
        "x",
        {"state": "weird", "in_flight": -5, "waiting": True, "gpu": {"need_bytes": "9"},
         "counters": {"served": "many", "refused": {"start_failed": 2}}},
    )  # fmt: skip
    assert (s.state, s.in_flight, s.waiting, s.vram_reserved) == ("idle", 0, 0, 0)
    assert s.counters["served"] == 0 and s.counters["refused"]["start_failed"] == 2


def http(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(request)
        data = b""
        while chunk := c.recv(65536):
            data += chunk
    return data


def test_the_server_answers_scrapes_refuses_the_rest_and_exits_when_not_scraped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o755)
    (etc / "emb.toml").write_text(
        '[listen]\naddress = "127.0.0.1:1"\n[runtime]\ncommand = ["/bin/true"]\n'
    )
    (etc / "emb.toml").chmod(0o644)
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(etc))
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))
    monkeypatch.setenv("PROVIDERD_RUNTIME_DIR", str(tmp_path / "run"))
    saved("emb", 3)
    sock = metrics.bind(f"127.0.0.1:{free_port()}")
    port = sock.getsockname()[1]

    async def go() -> list[bytes]:
        server = metrics.MetricsServer([sock], idle_s=0.5)
        await server.start()
        loop = asyncio.get_running_loop()
        answers = []
        for req in (
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
            b"HEAD /metrics HTTP/1.1\r\n\r\n",
            b"GET / HTTP/1.1\r\n\r\n",
            b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
            b"garbage\r\n\r\n",
        ):
            answers.append(await loop.run_in_executor(None, http, port, req))
        began = loop.time()
        await asyncio.wait_for(server.done.wait(), 5)
        answers.append(f"{loop.time() - began:.2f}".encode())
        await server.close()
        return answers

    ok, head, root, post, garbage, waited = asyncio.run(go())
    assert ok.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Type: text/plain; version=0.0.4" in ok
    _, _, body = ok.partition(b"\r\n\r\n")
    got = parse(body)
    assert value(got, "providerd_requests_served_total", provider="emb") == 3
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
    assert root.startswith(b"HTTP/1.1 404 ") and post.startswith(b"HTTP/1.1 405 ")
    assert garbage.startswith(b"HTTP/1.1 400 ")
    assert 0.3 < float(waited) < 1.0  # exits idle_s after the last scrape
    assert json.dumps(list(got))  # every sample parsed


def test_router_counters_round_trip_and_bounded_labels(tmp_path: Path) -> None:
    c = counters.RouterCounters()
    c.count("emb", "e5", 200)
    c.count("emb", "e5", 200)
    c.count("", "", 404)
    counters.save_router(c, metrics.log)
    assert counters.load_router().requests == {("emb", "e5", 200): 2, ("", "", 404): 1}
    counters.router_file().write_text(
        json.dumps([
            {"provider": "x", "model": "", "status": 200, "requests": 3},
            {"provider": 1, "model": "", "status": 200, "requests": 3},
            {"provider": "y", "model": "", "status": 999, "requests": 3},
            {"provider": "z", "model": "", "status": 200, "requests": True},
            "junk",
        ])
    )  # fmt: skip
    assert counters.load_router().requests == {("x", "", 200): 3}
    counters.router_file().write_text("{")
    assert counters.load_router().requests == {}
    got = parse(metrics.render([], c))
    assert (
        value(got, "providerd_router_requests_total", provider="emb", model="e5", code="200") == 2
    )
    assert value(got, "providerd_router_requests_total", provider="", model="", code="404") == 1
