"""Listening where no systemd holds the address: the foreground mode and `--listen` of
the metrics service share one helper and its one-line errors."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from support.net import free_port

from agent.metrics import service as metrics
from agent.net.bind import BindError, listen_on
from agent.spec.provider import Address


def test_an_address_in_use_is_one_line(tmp_path: Path) -> None:
    port = free_port()
    with listen_on(Address("127.0.0.1", port)), pytest.raises(BindError) as e:
        listen_on(Address("127.0.0.1", port))
    assert e.value.message == f"Failed to listen on 127.0.0.1:{port}: Address already in use"
    assert e.value.code == "bind_failed"


def test_a_stale_unix_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "p.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    with listen_on(Address(None, None, str(path))) as sock:
        assert sock.getsockname() == str(path)


def test_metrics_listen_takes_addresses_as_manifests_write_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = free_port()
    with metrics.bind(f"[::1]:{port}") as sock:
        assert sock.family == socket.AF_INET6 and sock.getsockname()[1] == port
    assert metrics.main(["--listen", "localhost:9"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith('providerd-metrics: cannot listen on localhost:9: "localhost" is not')
