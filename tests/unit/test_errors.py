"""providerd's own errors are types: each derives from `agent.errors.ProviderdError` and
carries a stable code of its own (what a JSON body's `error` says and scripts match on)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import agent
from agent.errors import ProviderdError

CODE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")


def exception_classes() -> list[type[BaseException]]:
    found = []
    for info in pkgutil.walk_packages(agent.__path__, "agent."):
        name = info.name
        if "_vendor" in name or name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == name and issubclass(obj, BaseException):
                found.append(obj)
    return found


def test_every_error_class_derives_from_the_base_with_a_code() -> None:
    classes = [c for c in exception_classes() if c is not ProviderdError]
    assert len(classes) >= 15
    outside = [f"{c.__module__}.{c.__name__}" for c in classes if not issubclass(c, ProviderdError)]
    assert outside == [], "derive these from agent.errors.ProviderdError"
    for c in classes:
        assert isinstance(c.code, str) and CODE.fullmatch(c.code), (c, c.code)
        assert c.code != ProviderdError.code, f"{c.__module__}.{c.__name__} needs a code"


def test_the_base_carries_a_message_a_hint_and_a_body() -> None:
    e = ProviderdError(
        "Failed to start worker: exit 1", hint="see the journal", code="start_failed"
    )
    assert (str(e), e.message, e.hint, e.code) == (
        "Failed to start worker: exit 1",
        "Failed to start worker: exit 1",
        "see the journal",
        "start_failed",
    )
    assert e.body() == {"error": "start_failed", "message": "Failed to start worker: exit 1"}
    assert ProviderdError("x").hint is None
