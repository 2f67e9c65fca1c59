"""The demo model: its weights and embeddings, its endpoints on a real socket, its start."""

from __future__ import annotations

import http.client
import json
import math
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.net import accepts, free_port
from support.paths import ROOT

from agent import demo
from agent.demo import Server, Weights


@pytest.fixture(scope="module")
def weights() -> Weights:
    return Weights.generate(16)


def test_weights_are_deterministic(weights: Weights) -> None:
    assert Weights.generate(16).data == weights.data
    assert Weights.generate(17).data[:16] != weights.data[:16]
    assert len(weights.data) == demo.BUCKETS * 16


def test_embedding_is_deterministic_and_normalised(weights: Weights) -> None:
    a = weights.embed("protein language model")
    assert a == weights.embed("protein language model")
    assert len(a) == 16
    assert math.isclose(sum(v * v for v in a), 1.0, rel_tol=1e-9)
    b = weights.embed("something else entirely")
    assert a != b
    # Similar texts are closer than different ones (shared trigrams).
    near = weights.embed("protein language models")
    dot = lambda x, y: sum(p * q for p, q in zip(x, y, strict=True))  # noqa: E731
    assert dot(a, near) > dot(a, b)


def test_weights_file_round_trip(tmp_path: Path, weights: Weights) -> None:
    path = tmp_path / "w.bin"
    loaded, origin = demo.load_weights(16, path)
    assert origin == f"generated, saved to {path}"
    assert path.stat().st_size == 12 + demo.BUCKETS * 16 * 4
    again, origin = demo.load_weights(16, path)
    assert origin == str(path)
    assert again.data == loaded.data == weights.data
    assert not list(tmp_path.glob(".*tmp"))


def test_bad_weights_file(tmp_path: Path) -> None:
    path = tmp_path / "w.bin"
    path.write_bytes(b"not weights at all")
    with pytest.raises(ValueError, match="not a providerd demo weight file"):
        Weights.load(path)


def test_completion_tokens_are_deterministic() -> None:
    assert demo.completion_tokens("hi", 5) == demo.completion_tokens("hi", 5)
    assert demo.completion_tokens("hi", 5) != demo.completion_tokens("ho", 5)
    assert len(demo.completion_tokens("hi", 7)) == 7


# -- the endpoints on a real socket -----------------------------------------------------------


@pytest.fixture(scope="module")
def server(weights: Weights) -> Iterator[int]:
    srv = Server(("127.0.0.1", 0), "demo-test", weights, 0.01)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    yield int(srv.server_address[1])
    srv.shutdown()
    srv.server_close()
    thread.join()


def call(
    port: int,
    method: str,
    path: str,
    body: object = None,
    conn: http.client.HTTPConnection | None = None,
) -> tuple[int, dict[str, str], bytes]:
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    data = None if body is None else json.dumps(body).encode()
    try:
        c.request(method, path, body=data)
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        if conn is None:
            c.close()


def test_health_and_models(server: int) -> None:
    assert call(server, "GET", "/health")[::2] == (200, b'{"status": "ok"}')
    status, _, body = call(server, "GET", "/v1/models")
    assert status == 200
    assert json.loads(body)["data"][0]["id"] == "demo-test"


def test_embeddings(server: int, weights: Weights) -> None:
    status, headers, body = call(
        server, "POST", "/v1/embeddings", {"input": ["a", "bc"], "model": "x"}
    )
    assert status == 200
    assert headers["content-type"] == "application/json"
    doc = json.loads(body)
    assert doc["object"] == "list"
    assert doc["model"] == "demo-test"
    assert [d["index"] for d in doc["data"]] == [0, 1]
    assert doc["data"][0]["embedding"] == weights.embed("a")
    single = json.loads(call(server, "POST", "/v1/embeddings", {"input": "bc"})[2])
    assert single["data"][0]["embedding"] == doc["data"][1]["embedding"]


def test_keep_alive_serves_many_on_one_connection(server: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    try:
        for i in range(20):
            status, headers, _ = call(server, "POST", "/v1/embeddings", {"input": str(i)}, conn)
            assert status == 200
            assert "content-length" in headers
    finally:
        conn.close()


def test_concurrent_requests(server: int) -> None:
    results: list[int] = []

    def one() -> None:
        results.append(call(server, "POST", "/v1/embeddings", {"input": "x" * 200})[0])

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 16


def test_completion_and_stream(server: int) -> None:
    plain = json.loads(
        call(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4})[2]
    )
    text = plain["choices"][0]["text"]
    assert text == "".join(demo.completion_tokens("hi", 4))
    status, headers, body = call(
        server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True}
    )
    assert status == 200
    assert headers["content-type"] == "text/event-stream"
    assert headers["transfer-encoding"] == "chunked"
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    tokens = [json.loads(e[len("data: ") :])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(tokens) == text


def test_stream_is_paced(server: int) -> None:
    """Tokens come one at a time: the first arrives long before the last."""
    c = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    try:
        body = {"prompt": "x", "max_tokens": 5, "stream": True, "token_delay_s": 0.1}
        c.request("POST", "/v1/completions", body=json.dumps(body))
        r = c.getresponse()
        first = r.readline()
        t_first = time.monotonic()
        rest = r.read()
        assert first.startswith(b"data: ")
        assert time.monotonic() - t_first >= 0.3  # four more delays of 0.1 s
        assert rest.endswith(b"data: [DONE]\n\n")
    finally:
        c.close()


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/nope", None, 404),
        ("GET", "/v1/embeddings", None, 405),
        ("POST", "/v1/embeddings", {"input": 3}, 400),
        ("POST", "/v1/embeddings", [1], 400),
        ("POST", "/v1/completions", {"max_tokens": -1}, 400),
        ("POST", "/v1/other", {}, 404),
    ],
)
def test_errors_are_json(server: int, method: str, path: str, body: object, status: int) -> None:
    got, _, data = call(server, method, path, body)
    assert got == status
    assert json.loads(data)["error"]["message"]


def test_bad_json(server: int) -> None:
    c = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    try:
        c.request("POST", "/v1/embeddings", body=b"{nope")
        r = c.getresponse()
        assert r.status == 400
        assert "not JSON" in json.loads(r.read())["error"]["message"]
    finally:
        c.close()


# -- the program: load delay, memory, clean stop -------------------------------------------------


def test_listens_only_after_the_load_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    weights = tmp_path / "w.bin"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.demo", "--port", str(port), "--load-delay", "0.4",
         "--memory-mb", "8", "--dim", "8", "--weights", str(weights)],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        while not accepts(port):
            assert proc.poll() is None
            time.sleep(0.01)
        assert time.monotonic() - t0 >= 0.4
        rss_kb = int(
            next(
                line.split()[1]
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                if line.startswith("VmRSS:")
            )
        )
        assert rss_kb >= 8 * 1024
        assert weights.exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        err = proc.stderr.read()
        proc.stderr.close()
    assert "demo: loading (load delay 0.4 s, 8 MiB)" in err
    assert f"demo: serving demo on 127.0.0.1:{port} (dim 8, weights generated, saved to" in err
    assert "demo: stopping (SIGTERM)" in err
    assert err.count("\n") == 4  # start, serving, stopping, stopped: nothing per request


def test_sigterm_during_the_load_exits_zero() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.demo", "--port", str(free_port()), "--load-delay", "30"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    try:
        assert "loading" in proc.stderr.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
