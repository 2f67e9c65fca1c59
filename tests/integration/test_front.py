"""The front in foreground mode, end to end: real sockets, real worker processes, real timing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import os
import signal
import socket
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import alive, free_port, manifest, request, wait_gone

pytestmark = pytest.mark.integration


def pid_of(port: int, **kw: Any) -> int:
    status, _, body = request(port, "/pid", **kw)
    assert status == 200, body
    return int(json.loads(body)["pid"])


def test_cold_burst_one_start_all_served(serve: Any) -> None:
    port = free_port()
    s = serve(("burst", manifest(port, "--start-delay", "1")))
    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        pids = list(pool.map(lambda _: pid_of(port), range(30)))
    assert len(set(pids)) == 1
    assert s.count("Starting worker") == 1
    assert s.count("Worker ready after") == 1


def test_idle_releases_worker_and_port_stays(serve: Any) -> None:
    port = free_port()
    s = serve(("idle", manifest(port, idle=1)))
    first = pid_of(port)
    s.wait_log("Idle for 1 s, releasing the worker", timeout=10)
    s.wait_log("Worker stopped", timeout=10)
    assert wait_gone(first)
    second = pid_of(port)  # the port still answers: a fresh worker
    assert second != first


def test_preload_and_pin_in_the_foreground(serve: Any) -> None:
    """`serve` is the foreground's boot: a preloading provider loads with no request, and
    pinned, it outlives its idle timeout; `status` shows both."""
    port = free_port()
    s = serve(("pre", manifest(port, idle=1, extra_runtime="preload = true\npinned = true")))
    s.wait_log("Starting worker (preload)", timeout=10)
    s.wait_log("Worker ready after", timeout=20)
    time.sleep(2.5)  # past two idle timeouts
    assert s.count("Idle for") == 0 and s.count("Worker stopped") == 0
    out = s.ctl("status", "--json", "pre")
    (st,) = json.loads(out.stdout)["providers"]
    assert st["state"] == "ready" and st["served"] == 0 and st["pinned"] is True
    assert st["preloaded"]["result"] == "ready"
    pid = pid_of(port)  # the preloaded worker answers the first request: no second start
    assert s.count("Starting worker") == 1 and alive(pid)


def test_ignored_paths_and_keepalive_do_not_hold(serve: Any) -> None:
    port = free_port()
    s = serve(("keep", manifest(port, idle=1)))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    pid = pid_of(port, conn=conn)
    # An open keep-alive connection and /health probes do not keep the worker.
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and alive(pid):
        request(port, "/health")
        time.sleep(0.2)
    assert not alive(pid)
    assert s.count("Idle for 1 s") >= 1
    conn.close()


def test_request_in_flight_holds_the_worker(serve: Any) -> None:
    port = free_port()
    s = serve(("slow", manifest(port, "--slow-body", "2.5", idle=1)))
    status, _, _ = request(port, "/stream")
    assert status == 200
    # The 2.5 s response outlived the 1 s idle timeout without a release in between.
    lines = s.log
    assert lines.count("Worker ready after") == 1
    assert "releasing" not in lines.split("Worker ready after")[1].split("\n", 2)[0]


def test_start_failure_503_with_backoff(serve: Any) -> None:
    port = free_port()
    s = serve(("broken", manifest(port, "--exit-at-start", "3")))
    status, headers, body = request(port, "/x")
    assert status == 503
    assert int(headers["retry-after"]) >= 1
    doc = json.loads(body)
    assert doc["provider"] == "broken"
    assert "status 3" in doc["message"]
    assert doc["retry_after_s"] >= 1
    # Within the backoff every request is answered at once, and nothing is restarted.
    for _ in range(20):
        assert request(port, "/x")[0] == 503
    assert s.count("Starting worker") == 1
    assert s.count("Failed to start worker") == 1


def test_never_ready_times_out(serve: Any) -> None:
    port = free_port()
    text = manifest(port, "--never-ready").replace("start_timeout_s = 20", "start_timeout_s = 1")
    s = serve(("slowpoke", text))
    t0 = time.monotonic()
    status, _, body = request(port, "/x")
    assert status == 503
    assert "within 1 s" in json.loads(body)["message"]
    assert time.monotonic() - t0 < 10
    s.wait_log("Failed to start worker")


def test_crash_fails_fast_then_recovers_after_the_backoff(serve: Any) -> None:
    port = free_port()
    s = serve(("crashy", manifest(port, "--crash-after", "3")))
    assert [request(port, "/x")[0] for _ in range(3)] == [200, 200, 200]
    s.wait_log("Worker exited unexpectedly")  # it exits right after the third answer
    status, headers, body = request(port, "/x")
    assert status == 503  # within the backoff: refused at once, with the cause
    assert "status 3" in json.loads(body)["message"]
    assert int(headers["retry-after"]) >= 1
    time.sleep(1.2)  # the first backoff is 1 s
    assert request(port, "/x")[0] == 200
    assert s.count("Starting worker") == 2


def test_request_timeout_504_worker_keeps_running(serve: Any) -> None:
    port = free_port()
    text = manifest(port, "--slow-read", "--read-rate", "4096").replace(
        "request_timeout_s = 10", "request_timeout_s = 1"
    )
    serve(("patient", text))
    pid = pid_of(port)
    t0 = time.monotonic()
    status, _, body = request(port, "/x", method="POST", body=b"x" * 65536)
    assert status == 504
    assert "no response from the worker for 1 s" in json.loads(body)["message"]
    assert time.monotonic() - t0 < 5
    assert alive(pid)
    assert pid_of(port) == pid


def test_request_timeout_cuts_a_response_that_stalls_under_way(serve: Any) -> None:
    port = free_port()
    text = manifest(port).replace("request_timeout_s = 10", "request_timeout_s = 1")
    s = serve(("cut", text))
    pid = pid_of(port)
    with pytest.raises((http.client.IncompleteRead, ConnectionError)):
        request(port, "/stream?chunks=3&delay=2")  # 2 s between chunks: over the limit
    s.wait_log("Cut a response: no response from the worker for 1 s")
    assert pid_of(port) == pid


def test_max_held_refuses_at_once(serve: Any) -> None:
    port = free_port()
    serve(("small", manifest(port, "--start-delay", "2", extra="max_held = 2")))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(request, port, "/x") for _ in range(6)]
        results = [f.result()[0] for f in futures]
    assert results.count(200) >= 2
    assert 503 in results


def test_tcp_connection_is_a_lease(serve: Any) -> None:
    port = free_port()
    s = serve(("raw", manifest(port, protocol="tcp", ready="tcp", idle=1)))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(b"GET /pid HTTP/1.1\r\nHost: x\r\n\r\n")
        first = c.recv(4096)
        assert b"200" in first.split(b"\r\n")[0]
        time.sleep(2)  # longer than the idle timeout: the open connection holds
        assert s.count("releasing the worker") == 0
        c.sendall(b"GET /pid HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200" in c.recv(4096)
    s.wait_log("releasing the worker", timeout=10)


def test_warm_and_stop(serve: Any) -> None:
    port = free_port()
    s = serve(("warmme", manifest(port, "--start-delay", "0.5")))
    r = s.ctl("warm", "warmme")
    assert r.returncode == 0, r.stderr
    st = json.loads(s.ctl("status", "--json", "warmme").stdout)
    (p,) = st["providers"]
    assert p["state"] == "ready"
    pid = pid_of(port)
    r = s.ctl("stop", "warmme")
    assert r.returncode == 0, r.stderr
    assert wait_gone(pid)
    st = json.loads(s.ctl("status", "--json", "warmme").stdout)
    assert st["providers"][0]["state"] == "idle"


def test_sigterm_leaves_no_process(serve: Any) -> None:
    port = free_port()
    s = serve(("term", manifest(port, "--ignore-sigterm")))
    pid = pid_of(port)
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(60)
    assert s.proc.returncode == 0
    assert wait_gone(pid)


def test_sigkill_of_serve_kills_workers(serve: Any) -> None:
    port = free_port()
    s = serve(("killed", manifest(port)))
    pid = pid_of(port)
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait(10)
    assert wait_gone(pid)


def test_load_goes_on_when_the_first_client_leaves(serve: Any) -> None:
    port = free_port()
    s = serve(("patient_load", manifest(port, "--start-delay", "1.5")))
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(b"GET /pid HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.3)
    c.close()  # the client that caused the load gives up
    s.wait_log("Worker ready after", timeout=10)
    t0 = time.monotonic()
    assert request(port, "/x")[0] == 200
    assert time.monotonic() - t0 < 1.0  # found it ready
    assert s.count("Starting worker") == 1


async def _burst(port: int, n: int) -> list[int]:
    """n clients at once, one GET each; the status each got (0: no answer)."""

    async def one() -> int:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /work HTTP/1.1\r\nHost: t\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.close()
            return int(head.split(b" ")[1])
        except (OSError, asyncio.IncompleteReadError, IndexError, ValueError):
            return 0

    return await asyncio.gather(*(one() for _ in range(n)))


def test_a_cold_burst_of_500_is_paced_to_max_concurrency_and_all_answered(serve: Any) -> None:
    """A model server with a listen backlog of 5 (Python's default) resets most of a burst
    it gets at once; the front holds the burst through the start, then hands the worker
    max_concurrency requests at a time, in arrival order."""
    port = free_port()
    worker = ("--start-delay", "1", "--backlog", "5", "--work", "0.01")
    s = serve(
        ("paced", manifest(port, *worker, extra_runtime="max_concurrency = 3")),
    )
    statuses = asyncio.run(_burst(port, 500))
    assert statuses.count(200) == 500, sorted(set(statuses))
    _, _, body = request(port, "/conns")
    conns = json.loads(body)
    assert 1 <= conns["peak"] <= 3, conns
    assert s.count("Starting worker") == 1


def test_requests_beyond_max_held_are_refused_503_and_logged(serve: Any) -> None:
    port = free_port()
    worker = ("--work", "0.5")
    s = serve(
        (
            "full",
            manifest(port, *worker, extra_runtime="max_concurrency = 1", extra="max_held = 2"),
        ),
    )
    request(port, "/health")  # warm
    statuses = asyncio.run(_burst(port, 6))
    # One in flight, two waiting; the other three are refused at once.
    assert statuses.count(200) == 3 and statuses.count(503) == 3, statuses
    s.wait_log("Answered a client 503: too many requests waiting for the worker (max_held = 2)")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_out_of_file_descriptors_the_front_pauses_instead_of_spinning(serve: Any) -> None:
    """Regression: under `ulimit -n 64`, 80 idle connections made the front spin at 100% CPU
    logging EMFILE and never answer again."""
    port = free_port()
    s = serve(("fds", manifest(port)), prefix=("prlimit", "--nofile=64:64", "--"))
    assert request(port, "/health")[0] == 200
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(80)]
    before = _cpu_s(s.proc.pid)
    time.sleep(2)
    used = _cpu_s(s.proc.pid) - before
    for c in idle:
        c.close()
    assert used < 0.5, f"the front used {used:.2f} s of CPU in 2 s"
    assert request(port, "/health", timeout=10)[0] == 200
    assert s.count("Failed to accept connection") <= 1


def test_a_stream_running_several_times_request_timeout_arrives_intact(serve: Any) -> None:
    """request_timeout_s is an inactivity limit: a stream that keeps producing runs on (it
    was cut at the deadline without its final chunk)."""
    port = free_port()
    text = manifest(port).replace("request_timeout_s = 10", "request_timeout_s = 1")
    serve(("streams", text))
    status, _, body = request(port, "/stream?chunks=16&delay=0.25")  # 3.75 s
    assert status == 200
    assert body.decode().splitlines() == [f"chunk {i}" for i in range(16)]


def test_credentials_reach_the_worker_as_a_private_file_and_its_variable(
    serve: Any, tmp_path: Any
) -> None:
    """Foreground mode does what LoadCredential= does: a copy only this user can read,
    named in $CREDENTIALS_DIRECTORY, gone with the worker; the wrapper sets the variable."""
    secret = tmp_path / "hf"
    secret.write_text("hf_foreground_secret\n")
    secret.chmod(0o600)
    port = free_port()
    text = manifest(
        port,
        "--echo-env",
        "HF_TOKEN,CREDENTIALS_DIRECTORY",
        extra_runtime=f'credentials = {{ HF_TOKEN = "{secret}" }}',
    )
    served = serve(("cred", text))
    status, _, body = request(port, "/env")
    assert status == 200, body
    env = json.loads(body)
    assert env["HF_TOKEN"] == "hf_foreground_secret"
    directory = Path(env["CREDENTIALS_DIRECTORY"])
    assert (directory / "HF_TOKEN").read_text() == "hf_foreground_secret\n"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "HF_TOKEN").stat().st_mode) == 0o400
    assert "hf_foreground_secret" not in served.log
    served.ctl("stop", "cred")
    deadline = time.monotonic() + 10
    while directory.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not directory.exists(), "the copy outlived the worker"


def test_a_missing_credential_fails_the_start_with_its_name(serve: Any, tmp_path: Any) -> None:
    port = free_port()
    gone = tmp_path / "gone"
    text = manifest(port, extra_runtime=f'credentials = {{ API_KEY = "{gone}" }}')
    serve(("nocred", text))
    status, _, body = request(port, "/")
    assert status == 503, body
    assert f"Failed to load credential API_KEY from {gone}" in json.loads(body)["message"], body
