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
