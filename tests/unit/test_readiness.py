"""The front's own probe of the model (agent.worker.readiness): what counts as an answer."""

from __future__ import annotations

import asyncio
import socket
import types
from typing import Any

import pytest
from support.net import free_port

from agent.spec.provider import Address, Ready
from agent.worker import readiness


def test_a_probe_that_reaches_itself_is_no_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host-network worker's probe binds its loopback address, port 0: the kernel may give
    it the model's own port while nothing listens there yet, and the connect then reaches
    the probe itself (TCP's simultaneous open). Made certain here by binding that port, as
    the kernel may; the probe leaves nothing on that port that would refuse the model's
    bind (a TIME_WAIT), and a model that listens there is an answer."""
    port = free_port()

    class OwnPort(socket.socket):
        def bind(self, address: Any) -> None:
            super().bind((address[0], port))

    address = Address("127.0.0.2", port)
    with monkeypatch.context() as m:
        m.setattr(readiness, "socket", types.SimpleNamespace(**{**vars(socket), "socket": OwnPort}))
        assert asyncio.run(readiness.answers(address, Ready("tcp"))) is None
    with socket.socket() as model:
        model.bind(("127.0.0.2", port))
        model.listen()
        assert asyncio.run(readiness.answers(address, Ready("tcp"))) is True
