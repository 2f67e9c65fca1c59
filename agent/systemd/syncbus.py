"""A blocking D-Bus client for the few calls a front makes before its event loop exists.

A front whose start it decides itself (a GPU placement, a port chosen per start) asks
PID 1 for the worker's start as its very first work: one connection to the system bus
(SASL EXTERNAL), `Hello`, the method calls, their replies. The event loop and dbus-next
come after (`agent.systemd.bus`, which then follows the job this connection started).
Nothing here imports more than `os`, `socket`, `struct` and `agent.errors` (not even
`typing`): each import is paid on the way to `StartUnit`.

The marshalling is the D-Bus specification's (little-endian out, either endianness in), for
the types systemd's calls need (`y b n q i u x t d s o g a ( ) { } v`); a variant is a
`Variant(signature, value)`.
"""

from __future__ import annotations

import os
import socket
import struct

from agent.errors import ProviderdError

TYPE_CHECKING = False  # not typing's: its import costs milliseconds (mypy reads this as it)
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

SYSTEM_BUS = "unix:path=/run/dbus/system_bus_socket"
BUS_NAME = "org.freedesktop.DBus"
BUS_PATH = "/org/freedesktop/DBus"
PROPERTIES = "org.freedesktop.DBus.Properties"

METHOD_CALL, METHOD_RETURN, ERROR, SIGNAL = 1, 2, 3, 4
# Header fields (code, signature).
PATH, INTERFACE, MEMBER, ERROR_NAME, REPLY_SERIAL, DESTINATION, SENDER, SIGNATURE = range(1, 9)
_FIELD_SIGNATURES = {PATH: "o", INTERFACE: "s", MEMBER: "s", ERROR_NAME: "s"}
_FIELD_SIGNATURES |= {REPLY_SERIAL: "u", DESTINATION: "s", SENDER: "s", SIGNATURE: "g"}

_FIXED = {"y": "B", "b": "I", "n": "h", "q": "H", "i": "i", "u": "I", "x": "q", "t": "Q", "d": "d"}
_ALIGN = {"y": 1, "b": 4, "n": 2, "q": 2, "i": 4, "u": 4, "x": 8, "t": 8, "d": 8}
_ALIGN |= {"s": 4, "o": 4, "g": 1, "a": 4, "(": 8, "{": 8, "v": 1}
MAX_MESSAGE = 1 << 27  # the specification's limit
# The job mode of every StartUnit providerd sends: a start that conflicts with a stop job
# queued or running (an operator's, or PID 1's by a BindsTo=) fails instead of replacing it.
START_MODE = "fail"


class Variant:
    """A D-Bus variant: its signature and its value. (A plain class, not a NamedTuple: the
    typing module is not imported on the way to StartUnit.)"""

    __slots__ = ("signature", "value")

    def __init__(self, signature: str, value: Any) -> None:
        self.signature = signature
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Variant):
            return NotImplemented
        return (self.signature, self.value) == (other.signature, other.value)

    __hash__ = None  # type: ignore[assignment]  # its value may be a list

    def __repr__(self) -> str:
        return f"Variant({self.signature!r}, {self.value!r})"


class BusError(ProviderdError):
    """An error reply (`name` is the D-Bus error name), or a broken connection (`name` "")."""

    code = "bus_error"

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}" if name else message)
        self.name = name
        self.text = message


def split_signature(signature: str) -> list[str]:
    """The complete types of a signature: "sa(ss)v" → ["s", "a(ss)", "v"]."""
    out = []
    i = 0
    while i < len(signature):
        end = _type_end(signature, i)
        out.append(signature[i:end])
        i = end
    return out


def _type_end(sig: str, i: int) -> int:
    c = sig[i]
    if c == "a":
        return _type_end(sig, i + 1)
    if c in "({":
        close = ")" if c == "(" else "}"
        j = i + 1
        while sig[j] != close:
            j = _type_end(sig, j)
        return j + 1
    if c in _ALIGN:
        return i + 1
    raise ValueError(f"unsupported D-Bus type {c!r} in {sig!r}")


class _Writer:
    def __init__(self) -> None:
        self.buf = bytearray()  # from the message's first byte: alignment counts from there

    def align(self, n: int) -> None:
        pad = -len(self.buf) % n
        self.buf += b"\0" * pad

    def write(self, sig: str, value: Any) -> None:
        c = sig[0]
        self.align(_ALIGN[c])
        if c in _FIXED:
            self.buf += struct.pack("<" + _FIXED[c], int(value) if c == "b" else value)
        elif c in "so":
            data = value.encode()
            self.buf += struct.pack("<I", len(data)) + data + b"\0"
        elif c == "g":
            data = value.encode()
            self.buf += struct.pack("<B", len(data)) + data + b"\0"
        elif c == "v":
            self.write("g", value.signature)
            self.write(value.signature, value.value)
        elif c == "a":
            self._array(sig[1:], value)
        else:  # a struct or a dict entry
            fields = split_signature(sig[1:-1])
            items = list(value)
            if len(items) != len(fields):
                raise ValueError(f"{sig} needs {len(fields)} fields, got {len(items)}")
            for field_sig, item in zip(fields, items, strict=True):
                self.write(field_sig, item)

    def _array(self, element: str, value: Any) -> None:
        at = len(self.buf)
        self.buf += b"\0\0\0\0"
        self.align(_ALIGN[element[0]])  # padding to the first element is not counted
        begin = len(self.buf)
        items = value.items() if element[0] == "{" else value
        for item in items:
            self.write(element, item)
        struct.pack_into("<I", self.buf, at, len(self.buf) - begin)


class _Reader:
    def __init__(self, data: bytes, pos: int = 0, endian: str = "<") -> None:
        self.data = data
        self.pos = pos
        self.endian = endian

    def align(self, n: int) -> None:
        self.pos += -self.pos % n

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("D-Bus message ends early")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def read(self, sig: str) -> Any:
        c = sig[0]
        self.align(_ALIGN[c])
        if c in _FIXED:
            fmt = self.endian + _FIXED[c]
            (value,) = struct.unpack(fmt, self.take(struct.calcsize(fmt)))
            return bool(value) if c == "b" else value
        if c in "so":
            (n,) = struct.unpack(self.endian + "I", self.take(4))
            return self.take(n + 1)[:-1].decode()
        if c == "g":
            (n,) = struct.unpack("<B", self.take(1))
            return self.take(n + 1)[:-1].decode()
        if c == "v":
            inner = self.read("g")
            return Variant(inner, self.read(inner))
        if c == "a":
            (n,) = struct.unpack(self.endian + "I", self.take(4))
            self.align(_ALIGN[sig[1]])
            end = self.pos + n
            items = []
            while self.pos < end:
                items.append(self.read(sig[1:]))
            return dict(items) if sig[1] == "{" else items
        return tuple(self.read(f) for f in split_signature(sig[1:-1]))


def marshal_body(signature: str, args: tuple[Any, ...]) -> bytes:
    """The body of a message with `signature` (which starts at an 8-aligned offset)."""
    w = _Writer()
    types = split_signature(signature)
    if len(types) != len(args):
        raise ValueError(f"signature {signature!r} needs {len(types)} arguments, got {len(args)}")
    for sig, value in zip(types, args, strict=True):
        w.write(sig, value)
    return bytes(w.buf)


def unmarshal_body(signature: str, body: bytes, endian: str = "<") -> tuple[Any, ...]:
    r = _Reader(body, 0, endian)
    return tuple(r.read(sig) for sig in split_signature(signature))


def message(
    kind: int,
    serial: int,
    fields: dict[int, Any],
    signature: str = "",
    args: tuple[Any, ...] = (),
    flags: int = 0,
) -> bytes:
    """A whole message: header, header fields, padding, body."""
    body = marshal_body(signature, args)
    if signature:
        fields = {**fields, SIGNATURE: signature}
    w = _Writer()
    w.buf += struct.pack("<cBBBII", b"l", kind, flags, 1, len(body), serial)
    items = [(code, Variant(_FIELD_SIGNATURES[code], v)) for code, v in sorted(fields.items())]
    w.write("a(yv)", items)
    w.align(8)
    return bytes(w.buf) + body


class Message:
    """One message as read: its type, serial, header fields and body."""

    __slots__ = ("body", "fields", "kind", "serial")

    def __init__(
        self, kind: int, serial: int, fields: dict[int, Any], body: tuple[Any, ...]
    ) -> None:
        self.kind, self.serial, self.fields, self.body = kind, serial, fields, body

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        mine = (self.kind, self.serial, self.fields, self.body)
        return mine == (other.kind, other.serial, other.fields, other.body)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Message({self.kind!r}, {self.serial!r}, {self.fields!r}, {self.body!r})"


def _endian(head: bytes) -> str:
    if head[:1] == b"l":
        return "<"
    if head[:1] == b"B":
        return ">"
    raise ValueError(f"not a D-Bus message (endianness {head[:1]!r})")


def parse_message(data: bytes) -> Message:
    """One whole message (as `message_length` measured it), little- or big-endian."""
    e = _endian(data)
    kind, _flags, _version, body_len, serial = struct.unpack_from(e + "BBBII", data, 1)
    r = _Reader(data, 12, e)
    fields = {code: v.value for code, v in r.read("a(yv)")}
    r.align(8)
    body = data[r.pos : r.pos + body_len]
    signature = fields.get(SIGNATURE, "")
    return Message(kind, serial, fields, unmarshal_body(signature, body, e) if signature else ())


def message_length(head: bytes) -> int:
    """The whole length of the message whose first 16 bytes are `head`."""
    body_len, _serial, fields_len = struct.unpack_from(_endian(head) + "III", head, 4)
    total = int(16 + fields_len + (-(16 + fields_len) % 8) + body_len)
    if total > MAX_MESSAGE:
        raise ValueError("D-Bus message too long")
    return total


def bus_address(environ: dict[str, str] | None = None) -> str | bytes:
    """The system bus's socket address: a path, or an abstract name (bytes, leading NUL)."""
    env = os.environ if environ is None else environ
    address = env.get("DBUS_SYSTEM_BUS_ADDRESS") or SYSTEM_BUS
    for entry in address.split(";"):
        kind, _, params = entry.partition(":")
        if kind != "unix":
            continue
        values = dict(p.partition("=")[::2] for p in params.split(","))
        if "path" in values:
            return _unescape(values["path"])
        if "abstract" in values:
            return b"\0" + _unescape(values["abstract"]).encode()
    raise BusError("", f"no unix socket in the system bus address {address!r}")


def unit_path(name: str) -> str:
    """A unit's object path, escaped as systemd escapes it ("a-b.service" →
    ".../unit/a_2db_2eservice"); PID 1 loads the unit when a call names that path."""
    out = []
    for i, ch in enumerate(name):
        if ch.isascii() and (ch.isalpha() or (ch.isdigit() and i > 0)):
            out.append(ch)
        else:
            out.extend(f"_{b:02x}" for b in ch.encode())
    return "/org/freedesktop/systemd1/unit/" + ("".join(out) or "_")


def _unescape(value: str) -> str:
    out = bytearray()
    i = 0
    while i < len(value):
        if value[i] == "%":
            out.append(int(value[i + 1 : i + 3], 16))
            i += 3
        else:
            out += value[i].encode()
            i += 1
    return out.decode()


class SyncBus:
    """One blocking connection to the system bus: `call()` sends and waits for the reply."""

    def __init__(self, timeout_s: float = 25.0, environ: dict[str, str] | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout_s)
        self._serial = 0
        self._in = b""
        try:
            self.sock.connect(bus_address(environ))
            self._authenticate()
            self.unique_name = str(self.call(BUS_NAME, BUS_PATH, BUS_NAME, "Hello")[0])
        except BaseException:
            self.sock.close()
            raise

    def _authenticate(self) -> None:
        uid = str(os.geteuid()).encode().hex()
        self.sock.sendall(b"\0AUTH EXTERNAL " + uid.encode() + b"\r\n")
        line = self._line()
        if not line.startswith(b"OK "):
            raise BusError("", f"the bus refused EXTERNAL authentication: {line!r}")
        self.sock.sendall(b"BEGIN\r\n")

    def _line(self) -> bytes:
        while b"\r\n" not in self._in:
            self._recv()
        line, _, self._in = self._in.partition(b"\r\n")
        return line

    def _recv(self) -> None:
        try:
            data = self.sock.recv(65536)
        except OSError as e:
            raise BusError("", f"the system bus connection failed: {e}") from None
        if not data:
            raise BusError("", "the system bus closed the connection")
        self._in += data

    def _message(self) -> Message:
        while len(self._in) < 16:
            self._recv()
        try:
            n = message_length(self._in[:16])
        except ValueError as e:
            raise BusError("", str(e)) from None
        while len(self._in) < n:
            self._recv()
        data, self._in = self._in[:n], self._in[n:]
        try:
            return parse_message(data)
        except (ValueError, UnicodeDecodeError, struct.error) as e:
            raise BusError("", f"unreadable D-Bus message: {e}") from None

    def send(
        self,
        destination: str,
        path: str,
        interface: str,
        member: str,
        signature: str = "",
        args: tuple[Any, ...] = (),
    ) -> int:
        """Send one method call; its serial, for `reply()`."""
        self._serial += 1
        fields = {PATH: path, INTERFACE: interface, MEMBER: member, DESTINATION: destination}
        data = message(METHOD_CALL, self._serial, fields, signature, args)
        try:
            self.sock.sendall(data)
        except OSError as e:
            raise BusError("", f"the system bus connection failed: {e}") from None
        return self._serial

    def reply(self, serial: int) -> tuple[Any, ...]:
        """The reply to call `serial`: its body, or BusError for an error reply. Signals and
        other messages on the way are dropped."""
        while True:
            m = self._message()
            if m.kind not in (METHOD_RETURN, ERROR) or m.fields.get(REPLY_SERIAL) != serial:
                continue
            if m.kind == ERROR:
                text = str(m.body[0]) if m.body and isinstance(m.body[0], str) else ""
                raise BusError(str(m.fields.get(ERROR_NAME, "")), text)
            return m.body

    def call(
        self,
        destination: str,
        path: str,
        interface: str,
        member: str,
        signature: str = "",
        args: tuple[Any, ...] = (),
    ) -> tuple[Any, ...]:
        return self.reply(self.send(destination, path, interface, member, signature, args))

    def close(self) -> None:
        self.sock.close()


def same_device_rules(current: object, wanted: Sequence[tuple[str, str]]) -> bool:
    """Whether a unit's `DeviceAllow=` as the bus gives it (a list of (path, access)) is
    `wanted`: a set of rules, which PID 1 gives back in its own order (newest first)."""
    if not isinstance(current, list):
        return False
    return {tuple(rule) for rule in current} == {tuple(rule) for rule in wanted}
