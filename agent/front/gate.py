"""What a front answers from a request's head alone, before anything is leased, queued
or started: the API key check (`agent.net.auth`), and the model list while the
model is not running.

`GET /v1/models` (or `/models`) on a provider's own port, and `GET /v1/models/NAME`,
answer from the manifest while the worker is not ready, in the router's shape (its
exact `[models]` names; a name asked for by itself may match a pattern too), so a
client listing models never causes a cold start. Once the worker is ready they go to
the worker like any request: it knows its models best (ids the manifest does not spell,
fields of its own), and it is already paid for.

With keys on, every request needs a key that reaches this provider, except the paths in
`idle_ignore_paths` when the manifest says `keyless_idle_ignore_paths = true`; a key
with `can_start = false` is served while the model is starting or ready, and refused
(403) otherwise, before the front starts anything. Pure but for the `state` it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import unquote

from agent.front.state import State
from agent.net.answers import Answer
from agent.net.auth import Refusal, authenticate, authorize, may_start
from agent.net.http import RequestHead
from agent.router.table import Refusal as RouterRefusal
from agent.router.table import table_from
from agent.spec.apikeys import KeySet
from agent.spec.provider import Provider

MODELS_PATHS = ("/v1/models", "/models")


def models_request(req: RequestHead) -> str | None:
    """ "" for a model list, the name for one model, None for any other request."""
    if req.method not in ("GET", "HEAD"):
        return None
    path = req.path
    for base in MODELS_PATHS:
        if path in (base, base + "/"):
            return ""
        if path.startswith(base + "/"):
            return unquote(path[len(base) + 1 :])
    return None


class Gate:
    def __init__(self, provider: Provider, keys: KeySet | None, state: Callable[[], State]) -> None:
        self.slug = provider.slug
        self.keys = keys
        self.state = state
        self.open_paths = (
            frozenset(provider.idle_ignore_paths)
            if provider.keyless_idle_ignore_paths
            else frozenset()
        )
        self.table = table_from([provider])
        # Whether the request just let through may cause a start: read by the lease taken
        # at once after the gate, in the same callback (agent.net.exchange.begin).
        self.may_start = True
        self.refused: Refusal | None = None  # the key refusal just answered, if any

    @property
    def cause(self) -> str:
        """The counters' cause of the key refusal just answered (`unauthorized`,
        `forbidden`), or "" when the gate answered something else or nothing."""
        return self.refused.cause if self.refused is not None else ""

    def __call__(self, req: RequestHead) -> Answer | None:
        models = models_request(req)
        state = self.state()
        self.may_start = True
        self.refused = None
        if self.keys is not None and req.path not in self.open_paths:
            key = authenticate(self.keys, req)
            if isinstance(key, Refusal):
                self.refused = key
                return key.answer()
            self.may_start = key.can_start
            refused = authorize(key, self.slug)
            if refused is None and models is None and state not in (State.READY, State.STARTING):
                refused = may_start(key, self.slug)
            if refused is not None:
                self.refused = refused
                return refused.answer()
        if models is not None and state is not State.READY:
            return self.models(models)
        return None

    def models(self, name: str) -> Answer:
        if not name:
            return Answer(200, "", "model_list", doc=self.table.listing())
        try:
            provider = self.table.lookup(name)
        except RouterRefusal as r:
            return Answer(r.status, r.message, r.code)
        return Answer(200, "", "model", doc=self.table.entry(name, provider))
