"""The blocking bus client the front's early start uses (agent.systemd.syncbus): its bytes
are dbus-next's, byte for byte, and it reads what dbus-next writes; against a bus server
made of dbus-next's own marshalling it authenticates, calls, skips signals and fails cleanly."""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dbus_next.constants import MessageType
from dbus_next.message import Message
from dbus_next.signature import Variant as DVariant
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.systemd import syncbus as sb
from tests.fakes.fake_bus import FakeBus

SD = "org.freedesktop.systemd1"
MANAGER = SD + ".Manager"
UNIT = "provider-worker@gpu_1.service"


def ours(
    serial: int, path: str, interface: str, member: str, sig: str, args: tuple[Any, ...]
) -> bytes:
    fields = {sb.PATH: path, sb.INTERFACE: interface, sb.MEMBER: member, sb.DESTINATION: SD}
    return sb.message(sb.METHOD_CALL, serial, fields, sig, args)


def theirs(serial: int, path: str, interface: str, member: str, sig: str, body: list[Any]) -> bytes:
    return bytes(
        Message(
            destination=SD,
            path=path,
            interface=interface,
            member=member,
            signature=sig,
            body=body,
            serial=serial,
        )._marshall()
    )


def test_the_calls_of_an_early_start_are_dbus_nexts_bytes() -> None:
    rules = [("/dev/nvidia0", "rw"), ("/dev/nvidiactl", "rw"), ("/dev/nvidia-uvm", "rw")]
    props = [("DeviceAllow", sb.Variant("a(ss)", [])), ("DeviceAllow", sb.Variant("a(ss)", rules))]
    their_props = [
        ["DeviceAllow", DVariant("a(ss)", [])],
        ["DeviceAllow", DVariant("a(ss)", [list(r) for r in rules])],
    ]
    path = sb.unit_path(UNIT)
    cases = [
        (1, "/org/freedesktop/DBus", "org.freedesktop.DBus", "Hello", "", (), []),
        (
            2,
            "/org/freedesktop/systemd1",
            MANAGER,
            "StartUnit",
            "ss",
            (UNIT, "replace"),
            [UNIT, "replace"],
        ),
        (
            3,
            path,
            sb.PROPERTIES,
            "Get",
            "ss",
            (SD + ".Service", "DeviceAllow"),
            [SD + ".Service", "DeviceAllow"],
        ),
        (
            4,
            "/org/freedesktop/systemd1",
            MANAGER,
            "SetUnitProperties",
            "sba(sv)",
            (UNIT, True, props),
            [UNIT, True, their_props],
        ),
    ]
    for serial, p, iface, member, sig, args, body in cases:
        assert ours(serial, p, iface, member, sig, args) == theirs(
            serial, p, iface, member, sig, body
        ), member


def test_it_reads_what_dbus_next_writes() -> None:
    call = Message(destination=SD, path="/", interface=MANAGER, member="StartUnit", serial=9)
    job = "/org/freedesktop/systemd1/job/4242"
    reply = Message.new_method_return(call, "o", [job])
    reply.serial = 77
    m = sb.parse_message(bytes(reply._marshall()))
    assert (m.kind, m.serial, m.fields[sb.REPLY_SERIAL], m.body) == (
        sb.METHOD_RETURN,
        77,
        9,
        (job,),
    )

    error = Message.new_error(call, "org.freedesktop.DBus.Error.AccessDenied", "Access denied")
    error.serial = 78
    m = sb.parse_message(bytes(error._marshall()))
    assert (
        m.kind == sb.ERROR and m.fields[sb.ERROR_NAME] == "org.freedesktop.DBus.Error.AccessDenied"
    )
    assert m.body == ("Access denied",)

    rules = DVariant("a(ss)", [["/dev/nvidia1", "rw"], ["/dev/nvidiactl", "rw"]])
    got = Message.new_method_return(call, "v", [rules])
    got.serial = 79
    (value,) = sb.parse_message(bytes(got._marshall())).body
    assert value == sb.Variant("a(ss)", [("/dev/nvidia1", "rw"), ("/dev/nvidiactl", "rw")])

    signal = Message.new_signal(
        "/org/freedesktop/systemd1", MANAGER, "JobRemoved", "uoss", [4242, job, UNIT, "done"]
    )
    signal.serial = 80
    m = sb.parse_message(bytes(signal._marshall()))
    assert m.kind == sb.SIGNAL and m.body == (4242, job, UNIT, "done")


def test_big_endian_messages_are_read_too() -> None:
    body = struct.pack(">I", 2) + b"ok\0"
    fields = struct.pack(">BBBB", sb.REPLY_SERIAL, 1, ord("u"), 0) + struct.pack(">I", 5)
    fields += b"\0" * 0 + struct.pack(">BBBB", sb.SIGNATURE, 1, ord("g"), 0) + b"\x01s\0"
    head = b"B" + struct.pack(">BBBII", sb.METHOD_RETURN, 0, 1, len(body), 6)
    head += struct.pack(">I", len(fields)) + fields
    head += b"\0" * (-len(head) % 8)
    data = head + body
    assert sb.message_length(data[:16]) == len(data)
    m = sb.parse_message(data)
    assert (m.kind, m.serial, m.fields[sb.REPLY_SERIAL], m.body) == (
        sb.METHOD_RETURN,
        6,
        5,
        ("ok",),
    )


def test_unit_paths_are_escaped_as_systemd_escapes_them() -> None:
    unit = "/org/freedesktop/systemd1/unit/"
    assert (
        sb.unit_path("provider-worker@gpu_1.service")
        == unit + "provider_2dworker_40gpu_5f1_2eservice"
    )
    assert sb.unit_path("1x.service") == unit + "_31x_2eservice"
    assert sb.unit_path("é") == unit + "_c3_a9"


def test_the_bus_address_comes_from_the_environment() -> None:
    assert sb.bus_address({}) == "/run/dbus/system_bus_socket"
    assert sb.bus_address({"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/tmp/a%20b"}) == "/tmp/a b"
    env = {"DBUS_SYSTEM_BUS_ADDRESS": "tcp:host=x,port=1;unix:abstract=bus,guid=00"}
    assert sb.bus_address(env) == b"\0bus"
    with pytest.raises(sb.BusError, match="no unix socket"):
        sb.bus_address({"DBUS_SYSTEM_BUS_ADDRESS": "tcp:host=x,port=1"})


def test_unsupported_types_are_refused_clearly() -> None:
    assert sb.split_signature("sa(ss)a{sv}v") == ["s", "a(ss)", "a{sv}", "v"]
    with pytest.raises(ValueError, match="unsupported D-Bus type 'h'"):
        sb.split_signature("h")
    with pytest.raises(ValueError, match="needs 2 arguments"):
        sb.marshal_body("ss", ("a",))


texts = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=20)
variants = st.one_of(
    st.builds(lambda s: ("s", s), texts),
    st.builds(lambda u: ("u", u), st.integers(0, 2**32 - 1)),
    st.builds(lambda b: ("b", b), st.booleans()),
    st.builds(lambda t: ("t", t), st.integers(0, 2**64 - 1)),
    st.builds(lambda rs: ("a(ss)", rs), st.lists(st.tuples(texts, texts), max_size=4)),
)


@settings(max_examples=150, deadline=None)
@given(
    unit=texts,
    runtime=st.booleans(),
    props=st.lists(st.tuples(texts, variants), max_size=5),
    serial=st.integers(1, 2**32 - 1),
)
def test_any_set_unit_properties_call_matches_dbus_next(
    unit: str, runtime: bool, props: list[tuple[str, tuple[str, Any]]], serial: int
) -> None:
    mine = [(name, sb.Variant(sig, value)) for name, (sig, value) in props]

    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v

    their = [[name, DVariant(sig, plain(value))] for name, (sig, value) in props]
    path = "/org/freedesktop/systemd1"
    got = ours(serial, path, MANAGER, "SetUnitProperties", "sba(sv)", (unit, runtime, mine))
    assert got == theirs(
        serial, path, MANAGER, "SetUnitProperties", "sba(sv)", [unit, runtime, their]
    )
    assert sb.parse_message(got).body == (unit, runtime, mine)


# ------------------------------------------------------------------ against a bus server


def systemd(message: Message) -> list[Message]:
    if message.member == "Hello":
        name = Message.new_signal(
            "/org/freedesktop/DBus", "org.freedesktop.DBus", "NameAcquired", "s", [":1.42"]
        )
        return [Message.new_method_return(message, "s", [":1.42"]), name]
    if message.member == "StartUnit":
        job = "/org/freedesktop/systemd1/job/7"
        removed = Message.new_signal(
            "/org/freedesktop/systemd1", MANAGER, "JobRemoved", "uoss", [6, "/x", "y", "done"]
        )
        return [removed, Message.new_method_return(message, "o", [job])]
    return [Message.new_error(message, "org.freedesktop.DBus.Error.AccessDenied", "not yours")]


@pytest.fixture
def address(tmp_path: Path) -> Iterator[dict[str, str]]:
    yield {"DBUS_SYSTEM_BUS_ADDRESS": f"unix:path={tmp_path / 'bus'}"}


def test_a_call_and_its_reply_over_a_real_socket(tmp_path: Path, address: dict[str, str]) -> None:
    bus = FakeBus(tmp_path / "bus", systemd)
    conn = sb.SyncBus(timeout_s=5, environ=address)
    try:
        assert conn.unique_name == ":1.42"
        (job,) = conn.call(
            SD, "/org/freedesktop/systemd1", MANAGER, "StartUnit", "ss", (UNIT, "replace")
        )
        assert job == "/org/freedesktop/systemd1/job/7"  # past a signal that came first
        with pytest.raises(sb.BusError, match="AccessDenied: not yours") as e:
            conn.call(SD, "/org/freedesktop/systemd1", MANAGER, "StopUnit", "ss", (UNIT, "replace"))
        assert e.value.name == "org.freedesktop.DBus.Error.AccessDenied"
    finally:
        conn.close()
    bus.thread.join(5)
    assert bus.auth_line == b"\0AUTH EXTERNAL " + str(os.geteuid()).encode().hex().encode()
    assert [m.member for m in bus.calls] == ["Hello", "StartUnit", "StopUnit"]
    assert (
        bus.calls[1].body == [UNIT, "replace"]
        and bus.calls[1].message_type == MessageType.METHOD_CALL
    )


def test_a_refused_authentication_is_one_clear_error(
    tmp_path: Path, address: dict[str, str]
) -> None:
    FakeBus(tmp_path / "bus", systemd, auth=b"REJECTED EXTERNAL\r\n")
    with pytest.raises(sb.BusError, match="refused EXTERNAL authentication"):
        sb.SyncBus(timeout_s=5, environ=address)


def test_a_bus_that_goes_away_is_one_clear_error(tmp_path: Path, address: dict[str, str]) -> None:
    FakeBus(tmp_path / "bus", lambda m: [] if m.member != "Hello" else systemd(m)[:1])
    conn = sb.SyncBus(timeout_s=5, environ=address)
    conn.sock.shutdown(socket.SHUT_WR)  # the server sees the end and closes its side
    with pytest.raises(sb.BusError):
        conn.reply(99)
    conn.close()


def test_no_bus_at_all_is_an_os_error(tmp_path: Path, address: dict[str, str]) -> None:
    with pytest.raises(OSError):
        sb.SyncBus(timeout_s=1, environ=address)
