"""The installed package under a real cold burst: the front paces the model it fronts."""

from __future__ import annotations

import json
import textwrap

from .conftest import MISBEHAVE, Provider
from .nspawn import Container

# 500 clients at once, one request each; prints the statuses (0: no answer).
BURST = r"""
import asyncio, json, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
async def one():
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /work HTTP/1.1\r\nHost: localhost\r\n\r\n")
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 120)
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await r.readexactly(length)
        w.close()
        return int(head.split(b" ")[1])
    except Exception:
        return 0
async def main():
    return await asyncio.gather(*(one() for _ in range(n)))
print(json.dumps(asyncio.run(main())))
"""


def test_a_cold_burst_of_500_on_a_backlog_of_5_is_answered_500_of_500(
    ct: Container, provider: Provider
) -> None:
    port = 18070
    argv = ["/usr/bin/python3", MISBEHAVE, "--port", "{port}", "--start-delay", "1"]
    argv += ["--backlog", "5", "--work", "0.01"]
    provider.add(
        "burst",
        textwrap.dedent(
            f"""\
            [listen]
            address = "127.0.0.1:{port}"
            [runtime]
            command = {json.dumps(argv)}
            ready = "http:/health"
            start_timeout_s = 60
            request_timeout_s = 30
            idle_timeout_s = 60
            """
        ),
    )
    since = ct.cursor()
    ct.write("/root/burst.py", BURST)
    statuses = json.loads(ct.sh(f"python3 /root/burst.py {port} 500", timeout=300).out)
    log = ct.journal("-u provider@burst.service -u provider-worker@burst.service", since=since)
    assert statuses.count(200) == 500, f"{sorted(set(statuses))}\n{log[-3000:]}"
    conns = json.loads(ct.sh(f"curl -sf http://127.0.0.1:{port}/conns").out)
    assert 1 <= conns["peak"] <= 4, conns  # the default max_concurrency
    assert log.count("Starting worker") == 1, log[-3000:]
    assert "Answered a client" not in log, log[-3000:]
