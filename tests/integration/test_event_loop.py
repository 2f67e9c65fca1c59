"""`providerctl serve` serves on the loop the product runs on (agent.net.loop): uvloop's,
seen from outside in the process's memory map, with a request through it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import free_port, manifest, request

pytestmark = pytest.mark.integration


def test_serve_relays_on_uvloop(serve: Any) -> None:
    port = free_port()
    s = serve(("loop", manifest(port)))
    status, _, body = request(port, "/pid")
    assert status == 200, body
    maps = Path(f"/proc/{s.proc.pid}/maps").read_text()
    assert "/uvloop/loop." in maps, "uvloop is not loaded in providerctl serve"
