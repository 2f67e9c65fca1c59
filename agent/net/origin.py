"""What the router refuses because a web page could have sent it.

Any page a user opens can make the browser send a "simple" request to
`127.0.0.1:8100` without asking the server first (no CORS preflight): a POST whose
body is `text/plain`, a form, or untyped. And a page on a domain its owner points at
127.0.0.1 (DNS rebinding) can even read the answers. So the router accepts a request
only when:
- its `Host` names this machine: an IP address, `localhost` (or `*.localhost`), this
  host's own name, or the host of one of the router's configured addresses — never
  another domain name;
- an `Origin`, if sent, names such a host too (`null` is refused);
- a request with a body declares it JSON (`application/json` or `application/*+json`):
  a browser sends that type cross-origin only after a preflight, which the router never
  answers.

`check()` returns what to refuse with, as (status, message, code): 403 or 415. Pure but
for the host's names: its name (`gethostname()`, no DNS) at once, and its DNS name
(`getfqdn()`, which can stall on a resolver) only later, in a thread
(`learn_dns_name()`, bounded by DNS_WAIT_S); until then a Host of that name is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import re
import socket
import threading
from collections.abc import Iterable

from agent.net.http import RequestHead
from agent.spec.provider import Address

HOST_MAX = 255
# The fields check() reads, from a validated field block (agent.net.http), values trimmed.
_WANTED = re.compile(
    rb"^(host|origin|content-type):[ \t]*([^\r\n]*?)[ \t]*\r?$", re.IGNORECASE | re.MULTILINE
)
Refused = tuple[int, str, str]  # status, message, code


def _host_part(authority: str) -> str:
    """`host` of `host[:port]` or `[v6]:port`, lower-case."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        end = authority.find("]")
        return authority[1:end] if end > 0 else authority
    host, sep, port = authority.rpartition(":")
    if sep and port.isdigit():
        return host
    return authority


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


VERDICTS_MAX = 1024  # hosts whose verdict is remembered, and field blocks whose answer is
BLOCK_MAX = 1024  # bytes of a field block worth remembering
DNS_WAIT_S = 2.0  # at most this long for the host's DNS name, off the event loop


class OriginCheck:
    def __init__(self, addresses: Iterable[Address], names: Iterable[str] | None = None) -> None:
        if names is None:
            names = {socket.gethostname()}
        self.names = {n.lower().rstrip(".") for n in names if n}
        self.names.update(
            a.host.lower() for a in addresses if a.host is not None and not _is_ip(a.host)
        )
        self.names.add("localhost")
        self._verdicts: dict[str, bool] = {}
        self._checked: dict[bytes, Refused | None] = {}  # check()'s answers by field block

    async def learn_dns_name(self) -> None:
        """Add the host's DNS name (`socket.getfqdn()`), looked up in a thread; a resolver that
        does not answer within DNS_WAIT_S leaves it out."""
        loop = asyncio.get_running_loop()
        found: asyncio.Future[str] = loop.create_future()

        def look() -> None:  # a daemon thread: a stalled resolver never holds up an exit
            try:
                name = socket.getfqdn()
            except OSError:
                name = ""
            with contextlib.suppress(RuntimeError):  # the loop is gone
                loop.call_soon_threadsafe(settle, name)

        def settle(name: str) -> None:
            if not found.done():
                found.set_result(name)

        threading.Thread(target=look, name="getfqdn", daemon=True).start()
        try:
            async with asyncio.timeout(DNS_WAIT_S):
                name = await found
        except TimeoutError:
            return
        if name:
            self.names.add(name.lower().rstrip("."))
            self._verdicts.clear()
            self._checked.clear()

    def local(self, host: str) -> bool:
        """A Host or Origin host a web page cannot have chosen for us (remembered: clients
        send the same few hosts on every request)."""
        verdict = self._verdicts.get(host)
        if verdict is None:
            name = host.rstrip(".")
            verdict = bool(name) and len(name) <= HOST_MAX
            verdict = verdict and (
                _is_ip(name) or name in self.names or name.endswith(".localhost")
            )
            if len(self._verdicts) >= VERDICTS_MAX:
                self._verdicts.clear()
            self._verdicts[host] = verdict
        return verdict

    def check(self, req: RequestHead) -> Refused | None:
        """Why to refuse what a web page could have sent (403, 415), or None. A function of
        the head's fields alone (its body's framing is theirs too): remembered per field
        block, as clients send the same fields with every request."""
        block = req.block
        if len(block) > BLOCK_MAX:
            return self._check(req)
        checked = self._checked
        if block in checked:
            return checked[block]
        verdict = checked[block] = self._check(req)
        if len(checked) > VERDICTS_MAX:
            checked.clear()
        return verdict

    def _check(self, req: RequestHead) -> Refused | None:
        host: str | None = None
        origin: str | None = None
        content_type: str | None = None
        for m in _WANTED.finditer(req.block):  # the last of each counts
            key = m[1].lower()
            value = m[2].decode("latin-1")
            if key == b"host":
                host = value
            elif key == b"origin":
                origin = value
            else:
                content_type = value
        if host is not None and not self.local(_host_part(host)):
            return (
                403,
                f"The Host {_shown(host)} is not this machine's; the router answers requests "
                "for an IP address, localhost or this host's name (DNS rebinding guard)",
                "forbidden_host",
            )
        if origin is not None:
            _scheme, sep, rest = origin.strip().partition("://")
            if not sep or not self.local(_host_part(rest.split("/", 1)[0])):
                return (
                    403,
                    f"Requests from the web page origin {_shown(origin)} are refused: "
                    "a page must not drive the router",
                    "forbidden_origin",
                )
        if req.body != "none":
            media = (content_type or "").split(";", 1)[0].strip().lower()
            kind, _, sub = media.partition("/")
            if not (kind == "application" and (sub == "json" or sub.endswith("+json"))):
                return (
                    415,
                    f"The request body's Content-Type is {_shown(content_type or 'missing')}; "
                    "the router takes application/json (a web page can send other types "
                    "from anywhere without asking)",
                    "unsupported_media_type",
                )
        return None


def _shown(text: str) -> str:
    return json.dumps(text[:80] + ("..." if len(text) > 80 else ""))
