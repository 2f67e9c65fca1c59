"""Bytes from one socket to another in the kernel: `os.splice` through a pipe.

A `Pump` moves a known number of bytes (a body with a Content-Length of at least
SPLICE_MIN) or everything up to EOF (a tunnel) from a socket to the socket of a transport,
without a byte passing through Python. Whoever starts it has paused the source's transport
and keeps everyone else from writing to the destination's; the pump first lets that
transport's write buffer drain (what was relayed before the switch goes out first), then
drives the splice with the loop's reader and writer callbacks on its own duplicates of the
two descriptors (a transport's descriptor number can be reused once it closes; a duplicate
cannot). A pipe holds at most PIPE_SIZE bytes: a slow reader stops the pump reading, so
nothing grows.

Its owner learns of it through four calls: `pump_moved` (bytes came in, or went out: for
the time limits, a slow reader draining the pipe is not a stall),
`pump_end` (the count is done, or the source's EOF, with the pipe empty), `pump_failed` (a
socket error: on the source's side or the destination's), `pump_declined` (the kernel
cannot splice these sockets: the bytes already taken are handed back, and the normal path
goes on from there).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
from typing import Protocol

# Bodies at least this long are spliced. A pump's set-up (two dup(), the pipe, registering,
# pausing the transport) costs about what copying 384 KiB through Python does: measured per
# MiB relayed, splicing took more CPU than the transports for 256 and 384 KiB bodies, as
# much at 512 KiB, and 20-40 % less from 1 MiB on.
SPLICE_MIN = 512 * 1024
# What a pump's pipe holds: fs.pipe-max-size lets anyone have 1 MiB, and it took a quarter
# less CPU per MiB than 256 KiB (bench/bench_splice.py's method, 100 MiB bodies). Pipes
# count against their user's fs.pipe-user-pages-soft (64 MiB by default, shared by every
# front and the router of the providerd user); past it a pipe keeps its default size.
PIPE_SIZE = 1024 * 1024
PIPES_KEPT = 2  # empty pipes kept for the next pump (a new one costs three system calls)
ROUNDS = 4  # splices per callback at most, so that one busy pump does not starve the loop
FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
# What a first splice answers where these sockets cannot be spliced, or splice is filtered
# out (a seccomp filter's errno): the normal path takes over.
DECLINED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM})
AVAILABLE = hasattr(os, "splice") and hasattr(fcntl, "F_SETPIPE_SZ")

_pipes: list[tuple[int, int, int]] = []  # (read end, write end, size)
declined: set[tuple[int, int]] = set()  # socket families (source, destination) splice refused


class Owner(Protocol):
    def pump_moved(self, pump: Pump, taken: bool) -> None: ...
    def pump_end(self, pump: Pump) -> None: ...
    def pump_failed(self, pump: Pump, e: OSError, at_source: bool) -> None: ...
    def pump_declined(self, pump: Pump, held: bytes) -> None: ...


def _pipe() -> tuple[int, int, int]:
    if _pipes:
        return _pipes.pop()
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # EPERM past the user's pipe quota: a smaller pipe
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    return r, w, fcntl.fcntl(w, fcntl.F_GETPIPE_SZ)


class Pump:
    __slots__ = (
        "dst",
        "dst_fd",
        "eof",
        "families",
        "held",
        "left",
        "loop",
        "moved",
        "owner",
        "pipe",
        "reading",
        "role",
        "src_fd",
        "stopped",
        "writing",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        owner: Owner,
        role: int,
        src: asyncio.Transport,
        dst: asyncio.Transport,
        count: int,
    ) -> None:
        """Move `count` bytes (-1: up to EOF) from `src`'s socket to `dst`'s. Raises
        OSError (out of descriptors, or declined before: the caller stays on the normal
        path)."""
        src_sock, sock = src.get_extra_info("socket"), dst.get_extra_info("socket")
        if src_sock is None or sock is None:
            raise OSError(errno.EBADF, "a transport without a socket")
        self.families = (src_sock.family, sock.family)
        if self.families in declined:
            raise OSError(errno.EINVAL, "splice declined these sockets before")
        self.loop = loop
        self.owner = owner
        self.role = role  # the owner's name for what this pump carries
        self.dst = dst
        self.left = count  # bytes still to take from the source; -1: up to EOF
        self.held = 0  # bytes in the pipe
        self.moved = 0  # bytes taken from the source so far
        self.eof = False
        self.stopped = False
        self.reading = self.writing = False
        self.pipe = _pipe()
        self.src_fd = self.dst_fd = -1
        try:
            self.src_fd = os.dup(src_sock.fileno())
            self.dst_fd = os.dup(sock.fileno())
        except OSError:
            self.stop()
            raise

    def start(self) -> None:
        self.read_on(True)
        if self.dst.get_write_buffer_size():
            self.write_on(True)  # what the transport holds goes first

    # -- the loop's callbacks

    def readable(self) -> None:
        for _ in range(ROUNDS):
            room = self.pipe[2] - self.held
            want = room if self.left < 0 else min(room, self.left)
            if want <= 0:  # the pipe is full (or the count taken): the destination first
                self.read_on(False)
                return
            try:
                n = os.splice(self.src_fd, self.pipe[1], want, flags=FLAGS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.failed(e, at_source=True)
                return
            if n == 0:
                self.eof = True
                self.read_on(False)
                self.flush()
                return
            self.held += n
            self.moved += n
            if self.left > 0:
                self.left -= n
            self.owner.pump_moved(self, True)
            if self.stopped:
                return
            self.flush()
            if self.stopped or self.reading is False or n < want:
                return

    def writable(self) -> None:
        self.flush()

    # -- moving

    def flush(self) -> None:
        """Empty the pipe into the destination as far as it takes, and decide what is
        waited for next."""
        if self.dst.get_write_buffer_size():
            if self.dst.is_closing():
                self.failed(OSError(errno.EPIPE, "the connection is closing"), at_source=False)
                return
            self.write_on(True)
            return
        while self.held:
            try:
                n = os.splice(self.pipe[0], self.dst_fd, self.held, flags=FLAGS)
            except (BlockingIOError, InterruptedError):
                self.write_on(True)
                self.read_on(self.held < self.pipe[2] and self.left != 0 and not self.eof)
                return
            except OSError as e:
                self.failed(e, at_source=False)
                return
            self.held -= n
            if not self.reading:  # a pipe drained by a slow reader: progress too
                self.owner.pump_moved(self, False)
                if self.stopped:
                    return
        self.write_on(False)
        if self.left == 0 or self.eof:
            self.finish()
        else:
            self.read_on(True)

    def finish(self) -> None:
        self.stop()
        self.owner.pump_end(self)

    def failed(self, e: OSError, at_source: bool) -> None:
        if e.errno in DECLINED and self.moved == self.held:
            held = self.take_held()  # nothing went out yet: the normal path takes over
            declined.add(self.families)
            self.stop()
            self.owner.pump_declined(self, held)
            return
        self.stop()
        self.owner.pump_failed(self, e, at_source)

    def take_held(self) -> bytes:
        """What the pipe holds, read out (its count added back to what is left)."""
        parts = []
        while self.held:
            try:
                data = os.read(self.pipe[0], self.held)
            except OSError:
                break
            if not data:
                break
            parts.append(data)
            self.held -= len(data)
        return b"".join(parts)

    # -- registration

    def read_on(self, on: bool) -> None:
        if on and not self.reading and not self.stopped:
            self.loop.add_reader(self.src_fd, self.readable)
            self.reading = True
        elif not on and self.reading:
            self.loop.remove_reader(self.src_fd)
            self.reading = False

    def write_on(self, on: bool) -> None:
        if on and not self.writing and not self.stopped:
            self.loop.add_writer(self.dst_fd, self.writable)
            self.writing = True
        elif not on and self.writing:
            self.loop.remove_writer(self.dst_fd)
            self.writing = False

    def stop(self) -> None:
        """Stop for good: unregistered, descriptors closed, the pipe kept if it is empty."""
        if self.stopped:
            return
        self.read_on(False)
        self.write_on(False)
        self.stopped = True
        for fd in (self.src_fd, self.dst_fd):
            if fd >= 0:
                os.close(fd)
        self.src_fd = self.dst_fd = -1
        if self.held == 0 and len(_pipes) < PIPES_KEPT:
            _pipes.append(self.pipe)
        else:
            os.close(self.pipe[0])
            os.close(self.pipe[1])
