"""`models.list()` on a provider's own port answers from the manifest while the worker is
not running (no cold start for it), and from the worker once it runs."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.integration.conftest import Served, free_port
from tests.integration.test_router import demo


def test_models_list_on_the_own_port_starts_nothing(serve: Any) -> None:
    port = free_port()
    served: Served = serve(("alpha", demo(port, "alpha", 'names = ["alpha-1b", "alpha-chat"]')))
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
    ) as own:
        models = own.models.list()
        assert [(m.id, m.owned_by, m.object) for m in models] == [
            ("alpha-1b", "alpha", "model"),
            ("alpha-chat", "alpha", "model"),
        ]
        assert own.models.retrieve("alpha-chat").id == "alpha-chat"
        with pytest.raises(openai.NotFoundError):
            own.models.retrieve("gamma")
        assert served.count("Starting worker") == 0

        # A real request starts the worker; from then on the worker answers the list.
        own.embeddings.create(model="alpha-1b", input=["x"])
        assert served.count("Starting worker on request") == 1
        assert [m.id for m in own.models.list()] == ["alpha"]  # the demo model's own answer
