"""`providerctl reload`'s keys step: what it says, and when the router's keys are stale."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from agent.cli import keys as cli_keys
from agent.spec import apikeys
from agent.systemd.units import ROUTER_SERVICE
from tests.unit.test_apikeys import GOOD


def test_with_keys_off_and_nothing_running_it_says_nothing(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert cli_keys.push(out, err) == 0
    assert out.getvalue() == err.getvalue() == ""


def test_a_router_is_stale_when_its_credential_is_not_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creds = tmp_path / "credentials"
    monkeypatch.setattr(cli_keys, "CREDENTIALS", creds)
    assert not cli_keys._router_is_stale()  # no router running
    (creds / ROUTER_SERVICE).mkdir(parents=True)
    cred = creds / ROUTER_SERVICE / apikeys.CREDENTIAL
    cred.write_bytes(apikeys.ABSENT)
    assert not cli_keys._router_is_stale()  # no file then, none now
    keys = Path(os.environ["PROVIDERD_KEYS"])
    keys.write_bytes(GOOD)
    assert cli_keys._router_is_stale()  # created since
    cred.write_bytes(GOOD)
    assert not cli_keys._router_is_stale()
    keys.write_bytes(GOOD + b"\n")
    assert cli_keys._router_is_stale()  # edited


def test_a_front_that_does_not_take_the_keys_is_a_failure_not_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy or broken front keeps its old keys: reload must say so, not count it as
    not running (a revoked key would go on working there)."""
    import socket
    import threading

    monkeypatch.setattr(cli_keys, "CREDENTIALS", tmp_path / "credentials")
    from agent.spec import paths

    sock_path = paths.runtime_dir() / "busy" / "control.sock"
    sock_path.parent.mkdir(parents=True)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    server.listen()

    def hang_up() -> None:
        conn, _ = server.accept()
        conn.close()  # reads nothing, answers nothing

    threading.Thread(target=hang_up, daemon=True).start()
    out, err = io.StringIO(), io.StringIO()
    try:
        assert cli_keys.push(out, err) == 1
    finally:
        server.close()
    assert "busy: failed to hand over the keys" in err.getvalue()


def test_keys_are_on_when_the_keys_file_cannot_be_looked_at(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def denied(_path: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(apikeys.os, "lstat", denied)
    assert apikeys.keys_on() is True
