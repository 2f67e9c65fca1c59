"""The worker wrapper: starts the model, says READY=1 only when it answers.

    python3 -m agent.worker --slug SLUG [--ready SPEC] --launch PACKAGE.MODULE:FUNCTION
    python3 -m agent.worker --slug SLUG [--ready SPEC] -- ARGV...

It is the `ExecStart=` of `provider-worker@<slug>.service` (`Type=notify`,
`NotifyAccess=main`) for a provider with `credentials` or `launch` (a plain command runs
as the unit's main process itself), and in foreground mode the front runs the same command
as a child with a `NOTIFY_SOCKET` of its own. `agent.systemd.units.worker_argv()` writes the command line.

The model's command
    `-- ARGV...` is the manifest's `command`. `--launch PACKAGE.MODULE:FUNCTION` names a
    callable that the wrapper imports and calls with no arguments, inside the worker's
    sandbox and as its user; it returns the argv (a non-empty list or tuple of str). In
    both cases every element then has its placeholders filled: `{port}`, `{host}`,
    `{slug}`, `{python}` (this interpreter); `{{` and `}}` are literal braces. The
    values come from `PROVIDERD_WORKER_PORT` (required; the front writes it into
    `/run/providerd/<slug>/worker.env` before each start) and `PROVIDERD_WORKER_HOST`
    (default 127.0.0.1). Nothing else in an argument is interpreted: `%`, `$`, spaces
    and quotes reach the model unchanged.

Readiness (`--ready`, default `tcp`)
    `tcp`: a connection to host:port succeeds. `http:/path`: `GET /path` answers 2xx
    (503 means loading; any other answer is also "not yet"). `notify`: the model sends
    `READY=1` itself to the `NOTIFY_SOCKET` the wrapper gives it (an abstract AF_UNIX
    datagram address of the wrapper's own, accepting senders of the wrapper's uid or
    root); its `STATUS=`, `EXTEND_TIMEOUT_USEC=`, `ERRNO=`, `WATCHDOG=` and
    `STOPPING=1` are passed upward, never `MAINPID=`. With `tcp` and `http` the model
    gets no `NOTIFY_SOCKET`. Probes start 1 ms apart and back off (a tenth of the
    time since the start) to 5 ms while nothing accepts the connection (a refused
    loopback connect costs microseconds), so a model is seen within a few ms of
    listening; once the model accepts but does not answer 2xx yet (`http`: 503 while
    loading), to 50 ms, not to flood its log. Meanwhile `STATUS=Loading (probe: <what the last probe saw>)`; once the
    model answers, `READY=1` and `STATUS=Serving on <host>:<port>`. The wrapper
    never gives up on its own: `TimeoutStartSec=` (or the foreground front) decides.

Signals and exit status
    SIGTERM, SIGINT and SIGHUP are passed on to the model (as often as they come; the
    wrapper never escalates, systemd's `TimeoutStopSec=` or the front does). The
    model runs in the wrapper's process group with `PR_SET_PDEATHSIG=SIGKILL`, so it
    dies if the wrapper is killed outright (SIGKILL) — in foreground mode there is no
    cgroup to do that. A front that starts the wrapper from a terminal should give it
    a session of its own (else Ctrl-C reaches the model twice: from the terminal and
    from the wrapper). The wrapper exits with the model's status, a death by signal N
    as 128+N, whether the model was ready or not. Its own failures: 2 for a wrong
    command line, `--launch` that does not resolve, or bad placeholders; 127 when the
    model's program does not exist, 126 when it cannot be executed; 1 when the kernel
    cannot give a pidfd for the model (Linux before 5.3).

Log lines go to stderr, plain (journald adds the rest); the model's stdout and stderr
are the wrapper's. Start-up cost is kept to a few ms: only C modules (`_socket`,
`_signal`, `select`) and `ctypes` are imported before the model starts.

Why this module is over 400 lines: it is one file on purpose. Every module the wrapper
imports is paid for at each model start, so its parsing, probing, notify relay and
signal handling live here together rather than in modules with imports of their own.
"""

from __future__ import annotations

import _socket
import contextlib  # loaded by runpy for `python3 -m` anyway
import os
import select
import sys
import time

from agent.errors import ProviderdError
from agent.spec import placeholders
from agent.spec.placeholders import PLACEHOLDERS, fill_placeholders
from agent.systemd.notify import notify

TYPE_CHECKING = False
if TYPE_CHECKING:  # `typing` and `collections.abc` cost imports at run time
    from collections.abc import Callable, Mapping

# The `signal` module wraps this C module in enums, which costs a few ms of imports
# (enum, collections, functools). The interpreter has `_signal` loaded already.
_signal = __import__("_signal")

USAGE = """\
usage: python3 -m agent.worker --slug SLUG [--ready tcp|http:/PATH|notify]
                               [--credential NAME]...
                               (--launch PACKAGE.MODULE:FUNCTION | -- ARGV...)
"""

FORWARDED = (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP)
SIGNAL_NAMES = {
    int(getattr(_signal, name)): name
    for name in ("SIGHUP", "SIGINT", "SIGQUIT", "SIGABRT", "SIGKILL", "SIGSEGV", "SIGTERM")
}
PR_SET_PDEATHSIG = 1
PROBE_FIRST_S = 0.001
PROBE_MAX_S = 0.005  # while nothing listens
PROBE_ANSWERED_MAX_S = 0.05  # while the model answers "not yet"
PROBE_TIMEOUT_S = 2.0
RELAYED = ("STATUS=", "EXTEND_TIMEOUT_USEC=", "ERRNO=", "WATCHDOG=", "STOPPING=")


class Failure(ProviderdError):
    """Something the wrapper cannot do; `exit_status` is its exit status."""

    code = "worker_wrapper_failed"

    def __init__(self, message: str, exit_status: int = 2) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class Options:
    def __init__(
        self,
        slug: str,
        ready: tuple[str, str],
        launch: str | None,
        argv: list[str],
        credentials: tuple[str, ...] = (),
    ):
        self.slug = slug
        self.ready = ready  # ("tcp", ""), ("http", "/path") or ("notify", "")
        self.launch = launch
        self.argv = argv
        self.credentials = credentials  # names in $CREDENTIALS_DIRECTORY


def log(line: str) -> None:
    """One line on stderr, written at once (also safe inside a signal handler)."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode(errors="replace"))


def parse_ready(spec: str) -> tuple[str, str]:
    if spec in ("tcp", "notify"):
        return (spec, "")
    if spec.startswith("http:/"):
        return ("http", spec[5:])
    raise Failure(f"--ready: expected tcp, http:/PATH or notify, got {spec!r}")


def parse_args(args: list[str]) -> Options:
    """The command line (see USAGE) → Options; raises Failure with a usage message."""
    values: dict[str, str] = {}
    credentials: list[str] = []
    argv: list[str] | None = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            argv = args[i + 1 :]
            break
        name, eq, value = arg.partition("=")
        if name not in ("--slug", "--ready", "--launch", "--credential"):
            raise Failure(f"unknown argument {arg!r}")
        if not eq:
            if i + 1 >= len(args):
                raise Failure(f"{name} needs a value")
            i += 1
            value = args[i]
        if name == "--credential":
            if not is_variable_name(value):
                raise Failure(f"--credential: {value!r} is not a variable name")
            credentials.append(value)
        else:
            values[name] = value
        i += 1
    slug = values.get("--slug", "")
    if not slug:
        raise Failure("--slug is required")
    launch = values.get("--launch")
    if (launch is None) == (argv is None):
        raise Failure("give either --launch PACKAGE.MODULE:FUNCTION or -- ARGV...")
    if argv is not None and not argv:
        raise Failure("the model's command after -- is empty")
    ready = parse_ready(values.get("--ready", "tcp"))
    return Options(slug, ready, launch, argv or [], tuple(credentials))


CREDENTIAL_MAX_BYTES = 1 << 20
_NAME_FIRST = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_NAME_REST = _NAME_FIRST | frozenset("0123456789")


def is_variable_name(name: str) -> bool:
    return bool(name) and name[0] in _NAME_FIRST and all(c in _NAME_REST for c in name)


def credential_environment(names: tuple[str, ...], environ: dict[str, str]) -> dict[str, str]:
    """Each credential as NAME=its text, for the model's environment.

    systemd (LoadCredential=) or `providerctl serve` puts each credential in
    $CREDENTIALS_DIRECTORY/NAME, readable by the worker's user alone. Models that read
    a token from a variable (HF_TOKEN) get it there too, at exec only: it never passes
    through a unit's Environment=. A credential that is not text stays a file only.
    """
    if not names:
        return {}
    directory = environ.get("CREDENTIALS_DIRECTORY", "")
    if not directory:
        raise Failure("Failed to read credentials: $CREDENTIALS_DIRECTORY is not set")
    out: dict[str, str] = {}
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                data = f.read(CREDENTIAL_MAX_BYTES + 1)
        except OSError as e:
            raise Failure(f"Failed to read credential {name}: {e.strerror or e}") from None
        text = data[:-1] if data.endswith(b"\n") else data
        try:
            value = text.decode()
        except UnicodeDecodeError:
            value = "\0"
        if "\0" in value or len(data) > CREDENTIAL_MAX_BYTES:
            log(f"Credential {name} is not text (or over 1 MiB): only {path} has it")
            continue
        out[name] = value
    return out


def resolve_launch(spec: str) -> list[str]:
    """Import `package.module:function`, call it with no arguments, check the argv."""
    module_name, colon, function_name = spec.partition(":")
    if not colon or not module_name or not function_name:
        raise Failure(f"Failed to resolve launch {spec!r}: expected 'package.module:function'")
    import importlib  # only here: --launch is the rarer form

    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the module's own import errors are the operator's to see
        raise Failure(
            f"Failed to import {module_name!r} for launch {spec!r}: {_one_line(e)}"
        ) from e
    function = getattr(module, function_name, None)
    if function is None:
        raise Failure(
            f"Failed to resolve launch {spec!r}: module {module_name!r} has no attribute {function_name!r}"
        )
    if not callable(function):
        raise Failure(
            f"Failed to resolve launch {spec!r}: {function_name!r} is a {type(function).__name__}, not a function"
        )
    try:
        result = function()
    except Exception as e:
        raise Failure(f"Failed to run launch {spec!r}: {_one_line(e)}") from e
    if (
        not isinstance(result, list | tuple)
        or not result
        or not all(isinstance(a, str) for a in result)
    ):
        raise Failure(
            f"Failed to use launch {spec!r}: expected a non-empty list of strings (the argv), "
            f"got {_describe(result)}"
        )
    return list(result)


def fill_argv(argv: list[str], values: dict[str, str]) -> list[str]:
    out = []
    for n, arg in enumerate(argv):
        try:
            out.append(fill_placeholders(arg, values))
        except KeyError as e:
            known = ", ".join("{" + k + "}" for k in PLACEHOLDERS)
            raise Failure(
                f"Failed to fill argument {n} {arg!r}: unknown placeholder {{{e.args[0]}}} "
                f"(known: {known}; write {{{{ and }}}} for literal braces)"
            ) from e
        except ValueError as e:
            raise Failure(f"Failed to fill argument {n} {arg!r}: {e}") from e
    return out


def placeholder_values(slug: str, environ: Mapping[str, str]) -> dict[str, str]:
    port = environ.get("PROVIDERD_WORKER_PORT", "")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        where = f"/run/providerd/{slug}/worker.env"
        raise Failure(
            f"Failed to start the worker for {slug}: PROVIDERD_WORKER_PORT is "
            + (f"{port!r}, not a port number" if port else "not set")
            + f" (the front writes it into {where} before each start)"
        )
    host = environ.get("PROVIDERD_WORKER_HOST", "") or "127.0.0.1"
    return placeholders.placeholder_values(port=port, host=host, slug=slug, python=sys.executable)


def exit_code(status: int) -> int:
    """A wait status → the wrapper's exit status (death by signal N → 128+N)."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def describe_exit(code: int) -> str:
    if code > 128 and code - 128 in SIGNAL_NAMES:
        return f"was killed by {SIGNAL_NAMES[code - 128]}"
    if code > 128:
        return f"was killed by signal {code - 128}"
    return f"exited with status {code}"


def probe_address(host: str) -> tuple[int, str]:
    """Where to connect to reach a model told to listen on `host`."""
    if host in ("0.0.0.0", ""):
        return (_socket.AF_INET, "127.0.0.1")
    if host in ("::", "[::]"):
        return (_socket.AF_INET6, "::1")
    host = host.strip("[]")
    return (_socket.AF_INET6 if ":" in host else _socket.AF_INET, host)


class Wrapper:
    """One run: spawn the model, probe it, relay, pass signals on, reap it."""

    def __init__(self, options: Options, argv: list[str], values: dict[str, str]) -> None:
        self.slug = options.slug
        self.kind, self.path = options.ready
        self.argv = argv
        self.host = values["host"]
        self.port = int(values["port"])
        self.family, self.probe_host = probe_address(self.host)
        self.pid = 0
        self.pidfd = -1
        self.sock: _socket.socket | None = None
        self.previous: dict[int, object] = {}
        self.ready = False
        self.seen = "not probed yet"
        self.connected = False  # the last probe reached the model
        self.signals: list[int] = []
        self.started = time.monotonic()
        self.reaped = False
        authority = f"[{self.probe_host}]" if ":" in self.probe_host else self.probe_host
        self.request = (
            f"GET {self.path} HTTP/1.1\r\nHost: {authority}:{self.port}\r\n"
            "User-Agent: providerd-worker\r\nConnection: close\r\n\r\n"
        ).encode()

    # -- the model process

    def spawn(self, env: dict[str, str]) -> None:
        prctl = _pdeathsig_setter()
        parent = os.getpid()
        r, w = os.pipe()  # close-on-exec: EOF tells the parent the exec happened
        # Signals wait (blocked) until the model exists, then on_signal passes them on.
        mask = _signal.pthread_sigmask(_signal.SIG_BLOCK, FORWARDED)
        for sig in FORWARDED:
            self.previous[sig] = _signal.signal(sig, self.on_signal)
        try:
            pid = os.fork()
        except OSError:
            _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)
            raise
        if pid == 0:  # the child: never returns
            code = 126
            try:
                os.close(r)
                for sig in (*FORWARDED, _signal.SIGPIPE, _signal.SIGXFSZ):
                    _signal.signal(sig, _signal.SIG_DFL)
                if prctl is not None:
                    prctl()
                if os.getppid() != parent:  # the wrapper died before prctl took effect
                    os._exit(1)
                _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)
                os.execvpe(self.argv[0], self.argv, env)
            except OSError as e:
                code = 127 if e.errno == 2 else 126
                with contextlib.suppress(OSError):
                    os.write(w, str(e.errno or 0).encode())
            finally:
                os._exit(code)
        os.close(w)
        self.pid = pid
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError as e:
            os.kill(pid, _signal.SIGKILL)
            os.waitpid(pid, 0)
            self.reaped = True
            _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)
            raise Failure(
                f"Failed to watch the model for {self.slug}: pidfd_open: {e.strerror} "
                "(providerd needs Linux 5.3 or later)",
                1,
            ) from e
        _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)  # pending signals go on now
        try:
            error = b""
            while chunk := os.read(r, 32):
                error += chunk
        finally:
            os.close(r)
        if error:
            os.waitpid(pid, 0)
            self.reaped = True
            errno = int(error)
            reason = os.strerror(errno)
            code = 127 if errno == 2 else 126
            raise Failure(
                f"Failed to start the model for {self.slug}: {self.argv[0]}: {reason}", code
            )

    def on_signal(self, signum: int, _frame: object) -> None:
        """Pass SIGTERM/SIGINT/SIGHUP on to the model (runs as a signal handler)."""
        self.signals.append(signum)
        name = SIGNAL_NAMES.get(signum, str(signum))
        if self.pidfd < 0:  # cannot happen: blocked until the model exists
            return
        try:
            _signal.pidfd_send_signal(self.pidfd, signum)
            log(f"Passing {name} on to the model (pid {self.pid})")
        except ProcessLookupError:
            pass

    # -- readiness

    def probe(self) -> str | None:
        """None when the model answers, else what the probe saw."""
        sock = _socket.socket(self.family, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        sock.settimeout(PROBE_TIMEOUT_S)
        what = f"GET {self.path}: " if self.kind == "http" else ""
        self.connected = False
        try:
            if self.probe_host.startswith("127.") and self.probe_host != "127.0.0.1":
                sock.bind((self.probe_host, 0))  # a host-network worker's own loopback
            sock.connect((self.probe_host, self.port))
            if reaches_itself(sock):
                raise ConnectionRefusedError("connected to itself")
            self.connected = True
            if self.kind == "tcp":
                return None
            sock.sendall(self.request)
            head = b""
            while b"\r\n" not in head and len(head) < 8192:
                chunk = sock.recv(8192)
                if not chunk:
                    break
                head += chunk
            parts = head.split(b" ", 2)
            if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
                return what + ("no HTTP answer" if head else "connection closed without an answer")
            status = int(parts[1])
            if 200 <= status < 300:
                self._drain(sock)
                return None
            return what + str(status)
        except TimeoutError:
            return what + "timed out"
        except ConnectionRefusedError:
            return what + "connection refused"
        except OSError as e:
            return what + (e.strerror or str(e))
        finally:
            sock.close()

    @staticmethod
    def _drain(sock: _socket.socket) -> None:
        """Read what already arrived of the answer, so closing does not reset the model's side."""
        sock.setblocking(False)
        try:
            for _ in range(16):
                if not sock.recv(65536):
                    break
        except OSError:
            pass

    def open_notify_socket(self) -> str:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM | _socket.SOCK_CLOEXEC)
        name = f"providerd/worker/{os.getpid()}/{os.urandom(8).hex()}"
        sock.bind("\0" + name)
        sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_PASSCRED, 1)
        self.sock = sock
        return "@" + name

    def read_notify(self) -> None:
        """One datagram from the model: READY=1 makes it ready; some lines go upward."""
        assert self.sock is not None
        try:
            data, ancdata, _flags, _addr = self.sock.recvmsg(4096, _socket.CMSG_SPACE(12))
        except OSError:
            return
        uid = -1
        for level, kind, cred in ancdata:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_CREDENTIALS and len(cred) >= 12:
                uid = int.from_bytes(cred[4:8], sys.byteorder)
        if uid not in (os.getuid(), 0):
            return
        lines = data.decode(errors="replace").split("\n")
        relay = [line for line in lines if line.startswith(RELAYED)]
        if relay:
            notify("\n".join(relay))
        if "READY=1" in lines and not self.ready:
            self.seen = "READY=1"
            self.became_ready()

    def became_ready(self) -> None:
        self.ready = True
        elapsed = time.monotonic() - self.started
        notify(f"READY=1\nSTATUS=Serving on {self.host}:{self.port}")
        how = {"tcp": "accepts connections", "http": f"answers GET {self.path}"}
        log(
            f"Model for {self.slug} ready after {elapsed:.3f} s "
            f"({how.get(self.kind, 'sent READY=1')} on {self.host}:{self.port})"
        )

    # -- the whole run

    def run(self, env: dict[str, str]) -> int:
        self.started = time.monotonic()
        if self.kind == "notify":
            env["NOTIFY_SOCKET"] = self.open_notify_socket()
            self.seen = "waiting for READY=1"
        else:
            env.pop("NOTIFY_SOCKET", None)
        try:
            self.spawn(env)
            return self.supervise()
        finally:
            if self.pid and self.pidfd >= 0 and not self.reaped:
                # An error in the wrapper itself: never leave the model behind.
                _signal.pidfd_send_signal(self.pidfd, _signal.SIGKILL)
                os.waitpid(self.pid, 0)
            for sig, handler in self.previous.items():
                _signal.signal(sig, handler)
            if self.pidfd >= 0:
                os.close(self.pidfd)
            if self.sock is not None:
                self.sock.close()

    def supervise(self) -> int:
        log(f"Started the model for {self.slug} (pid {self.pid}): {_quote(self.argv)}")
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        if self.sock is not None:
            poller.register(self.sock.fileno(), select.POLLIN)
            notify(f"STATUS=Loading (probe: {self.seen})")
        announced = ""
        while True:
            timeout_ms: float | None = None
            if not self.ready and self.kind != "notify":
                seen = self.probe()
                if seen is None:
                    self.became_ready()
                else:
                    self.seen = seen
                    if seen != announced:
                        notify(f"STATUS=Loading (probe: {seen})")
                        announced = seen
                    elapsed = time.monotonic() - self.started
                    cap = PROBE_ANSWERED_MAX_S if self.connected else PROBE_MAX_S
                    timeout_ms = 1000 * min(cap, max(PROBE_FIRST_S, elapsed / 10))
            for fd, _events in poller.poll(timeout_ms):
                if fd == self.pidfd:
                    return self.finish()
                self.read_notify()

    def finish(self) -> int:
        _pid, status = os.waitpid(self.pid, 0)
        self.reaped = True
        code = exit_code(status)
        what = describe_exit(code)
        after = ""
        if self.signals and code != 128 + self.signals[-1]:
            after = " after " + SIGNAL_NAMES.get(self.signals[-1], str(self.signals[-1]))
        if self.ready:
            log(f"Model for {self.slug} {what}{after}")
        else:
            elapsed = time.monotonic() - self.started
            log(
                f"Failed to start the model for {self.slug}: {self.argv[0]} {what}{after} "
                f"after {elapsed:.3f} s, before it was ready (probe: {self.seen})"
            )
            notify(f"STATUS=Model {what}{after} before it was ready (probe: {self.seen})")
        return code


_PDEATHSIG: list[Callable[[], object] | None] = []  # the setter, once loaded


def preload() -> None:
    """Load now what a wrapper loads before its model starts (ctypes, for prctl()), so a
    wrapper forked from this process (foreground mode) does not load it on each cold start."""
    _pdeathsig_setter()


def _pdeathsig_setter() -> Callable[[], object] | None:
    """A function that asks the kernel to SIGKILL the calling process when its parent dies."""
    if not _PDEATHSIG:
        _PDEATHSIG.append(_load_pdeathsig_setter())
    return _PDEATHSIG[0]


def _load_pdeathsig_setter() -> Callable[[], object] | None:
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError) as e:
        log(f"Failed to load prctl(), the model will not die with the wrapper: {e}")
        return None
    args = (
        ctypes.c_int(PR_SET_PDEATHSIG),
        ctypes.c_ulong(int(_signal.SIGKILL)),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
        ctypes.c_ulong(0),
    )
    return lambda: prctl(*args)


def reaches_itself(sock: _socket.socket) -> bool:
    """Whether a probe's connect reached the probe itself. Bound to the model's own port
    while nothing listens on it (a host-network worker's loopback), a connect reaches the
    socket itself (TCP's simultaneous open): not the model. Such a socket is set to reset,
    not close: a TIME_WAIT on that port would refuse the model's bind. A peer already gone
    (the model accepted and reset) is not itself."""
    try:
        if sock.getsockname() != sock.getpeername():
            return False
    except OSError:
        return False
    linger = (1).to_bytes(4, sys.byteorder) + bytes(4)  # struct linger {1, 0}
    sock.setsockopt(_socket.SOL_SOCKET, _socket.SO_LINGER, linger)
    return True


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _describe(value: object) -> str:
    if isinstance(value, list | tuple) and value:
        bad = next((a for a in value if not isinstance(a, str)), None)
        return f"a {type(value).__name__} holding a {type(bad).__name__} ({bad!r})"
    return f"{type(value).__name__} {value!r}"[:200]


def _quote(argv: list[str]) -> str:
    safe = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789@%+=:,./-_")
    return " ".join(
        a if a and all(c in safe for c in a) else "'" + a.replace("'", "'\"'\"'") + "'"
        for a in argv
    )


def _die_with_parent() -> None:
    """Foreground mode: the front asks (PROVIDERD_DIE_WITH_PARENT=<its pid>) that the
    wrapper die with it, which keeps the front's spawn cheap (no pre-exec hook)."""
    parent = os.environ.pop("PROVIDERD_DIE_WITH_PARENT", None)
    if parent is None or not (parent.isascii() and parent.isdigit()):
        return
    setter = _pdeathsig_setter()
    if setter is not None:
        setter()
    if os.getppid() != int(parent):  # the front died before prctl took effect
        os._exit(1)


def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    _die_with_parent()
    if args and args[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0
    try:
        options = parse_args(args)
    except Failure as e:
        log(f"agent.worker: {e}")
        log(USAGE.rstrip("\n"))
        return e.exit_status
    try:
        values = placeholder_values(options.slug, os.environ)
        argv = options.argv if options.launch is None else resolve_launch(options.launch)
        argv = fill_argv(argv, values)
        env = dict(os.environ)
        env.update(credential_environment(options.credentials, env))
        wrapper = Wrapper(options, argv, values)
        return wrapper.run(env)
    except Failure as e:
        log(str(e))
        notify(f"STATUS={e}")
        return e.exit_status
