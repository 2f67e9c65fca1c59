"""API keys under systemd 252 with the installed package: the keys file reaches the front
and the router as the credential providerd-keys; a request without the key is 401 and
starts no worker; with the key it is served."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest

from .conftest import Provider, probe_manifest
from .nspawn import Container

PORT = 18092
SLUG = "keyed"
KEY = "pd-container-0123456789"
NEW = "pd-container-rotated-0123456789"


@pytest.fixture
def keys(ct: Container) -> Iterator[None]:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    ct.write("/etc/providerd/keys.toml", f'[keys.ci]\nsha256 = "{digest}"\n', mode=0o600)
    yield
    ct.sh(
        "rm -f /etc/providerd/keys.toml; systemctl stop providerd-router.socket"
        " providerd-router.service",
        check=False,
    )


def status(ct: Container, url: str, *headers: str) -> tuple[str, str]:
    args = " ".join(f"-H '{h}'" for h in headers)
    r = ct.sh(f"curl -s -D - -o /tmp/body --max-time 60 {args} {url}; cat /tmp/body", check=False)
    return r.out.split(" ", 2)[1], r.out


def test_a_request_without_the_key_starts_no_worker(
    ct: Container, provider: Provider, keys: None
) -> None:
    since = ct.cursor()
    provider.add(SLUG, probe_manifest(PORT, idle=30))
    code, out = status(ct, f"http://127.0.0.1:{PORT}/v1/embeddings")
    assert code == "401", out
    assert 'WWW-Authenticate: Bearer realm="providerd"' in out and '"missing_api_key"' in out
    code, out = status(ct, f"http://127.0.0.1:{PORT}/", "x-api-key: pd-wrong")
    assert code == "401" and '"invalid_api_key"' in out, out
    assert ct.active(f"provider@{SLUG}.service") == "active"  # the front answered ...
    assert ct.active(f"provider-worker@{SLUG}.service") == "inactive"  # ... and started nothing
    # The model list answers from the manifest, still without a start.
    code, out = status(ct, f"http://127.0.0.1:{PORT}/v1/models", f"Authorization: Bearer {KEY}")
    assert code == "200" and '"object": "list"' in out, out
    assert ct.active(f"provider-worker@{SLUG}.service") == "inactive"

    code, out = status(ct, f"http://127.0.0.1:{PORT}/", f"Authorization: Bearer {KEY}")
    assert code == "200", out
    assert ct.active(f"provider-worker@{SLUG}.service") == "active"

    # The router reads the same credential.
    ct.sh("systemctl start providerd-router.socket")
    code, out = status(ct, "http://127.0.0.1:8100/v1/models")
    assert code == "401" and "WWW-Authenticate: Bearer" in out, out
    code, out = status(ct, "http://127.0.0.1:8100/v1/models", f"x-api-key: {KEY}")
    assert code == "200", out

    # The key is rotated: `providerctl reload` applies it to the running front (the same
    # worker goes on serving) and restarts the router.
    worker_pid = ct.prop(f"provider-worker@{SLUG}.service", "MainPID")
    digest = hashlib.sha256(NEW.encode()).hexdigest()
    ct.write("/etc/providerd/keys.toml", f'[keys.ci]\nsha256 = "{digest}"\n', mode=0o600)
    t0 = time.monotonic()
    out = ct.sh("providerctl reload").out
    print(f"keys: providerctl reload with changed keys took {time.monotonic() - t0:.1f} s")
    assert "API keys: 1 key(s) in force in 1 running front(s)" in out, out
    assert "restarted providerd-router.service" in out, out
    code, _ = status(ct, f"http://127.0.0.1:{PORT}/", f"Authorization: Bearer {KEY}")
    assert code == "401"
    code, _ = status(ct, f"http://127.0.0.1:{PORT}/", f"Authorization: Bearer {NEW}")
    assert code == "200"
    assert ct.prop(f"provider-worker@{SLUG}.service", "MainPID") == worker_pid
    code, _ = status(ct, "http://127.0.0.1:8100/v1/models", f"x-api-key: {KEY}")
    assert code == "401"
    code, _ = status(ct, "http://127.0.0.1:8100/v1/models", f"x-api-key: {NEW}")
    assert code == "200"

    journal = ct.journal(since=since)
    assert "API keys are on: 1 key(s)" in journal
    for secret in (KEY, NEW):
        assert secret not in journal and hashlib.sha256(secret.encode()).hexdigest() not in journal
