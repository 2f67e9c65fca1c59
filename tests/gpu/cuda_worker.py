#!/usr/bin/env python3
"""A real CUDA process for the GPU tier, with nothing installed: the driver API via ctypes.

cuda_worker.py hold BYTES          allocate BYTES on device 0 (as CUDA_VISIBLE_DEVICES
                                   shows it), print one JSON line, sleep until killed
cuda_worker.py serve --port P --bytes N
                                   an HTTP model: GET /health, GET /info (pid, env, PCI bus
                                   id, bytes held), GET /alloc?bytes=N (hold N more),
                                   GET /slow?s=S (answer after S seconds)
cuda_worker.py probe               print {"devices": n} or {"error": "..."} and exit

With PROVIDERD_NVML_FAKE=<dir> set, the card is the fake one of agent.gpu.nvml.DirNvml:
allocations are numbers written to <dir>/procs/<pid>.json, so the same scenarios run
without a GPU (tests/integration/test_gpu_fake.py).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

CHUNK = 4 << 30


class Cuda:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        lib = self.lib
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuDeviceGetCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        lib.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
        lib.cuDeviceGetPCIBusId.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.check(lib.cuInit(0), "cuInit")
        self.ctx = ctypes.c_void_p()
        self.dev = ctypes.c_int()
        self.ptrs: list[int] = []
        self.held = 0
        self.lock = threading.Lock()
        self.nodes: dict[str, str] = {}  # the driver opens the device nodes itself

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def count(self) -> int:
        n = ctypes.c_int()
        self.check(self.lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        return n.value

    def open(self) -> None:
        self.check(self.lib.cuDeviceGet(ctypes.byref(self.dev), 0), "cuDeviceGet")
        self.check(
            self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), self.dev),
            "cuDevicePrimaryCtxRetain",
        )
        self.current()

    def current(self) -> None:
        self.check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def bus_id(self) -> str:
        buf = ctypes.create_string_buffer(64)
        self.check(self.lib.cuDeviceGetPCIBusId(buf, 64, self.dev), "cuDeviceGetPCIBusId")
        return buf.value.decode()

    def alloc(self, nbytes: int) -> None:
        with self.lock:
            self.current()
            while nbytes > 0:
                n = min(nbytes, CHUNK)
                ptr = ctypes.c_uint64()
                self.check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), n), f"cuMemAlloc({n})")
                self.check(self.lib.cuMemsetD8_v2(ptr.value, 1, n), "cuMemsetD8")
                self.ptrs.append(ptr.value)
                self.held += n
                nbytes -= n


class FakeCuda:
    """The fake card of agent.gpu.nvml.DirNvml, with the interface of `Cuda`.

    Holds no memory: it writes what it would hold, plus a CUDA context, to
    <dir>/procs/<pid>.json, which the fake NVML reads. Like the driver, it opens the
    NVIDIA device nodes that exist, and `nodes` says what each open gave: "ok", or
    the errno ("EPERM": the device rules refuse it; "ENXIO": allowed, but no driver).
    """

    CONTEXT = 512 << 20  # the H200 showed ~0.5 GiB per process beyond its allocations

    def __init__(self, directory: str) -> None:
        self.dir = Path(directory)
        self.cards = json.loads((self.dir / "cards.json").read_text())
        self.card: dict[str, object] | None = None
        self.held = 0
        self.lock = threading.Lock()

    def visible(self) -> list[dict[str, object]]:
        names = os.environ.get("CUDA_VISIBLE_DEVICES")
        if names is None:
            return list(self.cards)
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        return [c for n in wanted for c in self.cards if c["uuid"] == n]

    def count(self) -> int:
        return len(self.visible())

    def open(self) -> None:
        cards = self.visible()
        if not cards:
            raise RuntimeError("cuInit failed: CUDA_ERROR_NO_DEVICE (100)")
        self.card = cards[0]
        self.nodes = {str(n): try_open(n) for n in sorted(Path("/dev").glob("nvidia*"))}
        self.write()

    def current(self) -> None:
        pass

    def bus_id(self) -> str:
        assert self.card is not None
        return str(self.card.get("bus_id", ""))

    def alloc(self, nbytes: int) -> None:
        with self.lock:
            self.held += nbytes
            self.write()

    def write(self) -> None:
        assert self.card is not None
        procs = self.dir / "procs"
        procs.mkdir(exist_ok=True)
        tmp = procs / f".{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"uuid": self.card["uuid"], "bytes": self.held + self.CONTEXT}))
        tmp.chmod(0o644)  # a front without capabilities reads it, whoever this worker runs as
        tmp.rename(procs / f"{os.getpid()}.json")


def try_open(path: Path) -> str:
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e.errno))
    return "ok"


def open_cuda() -> Cuda | FakeCuda:
    fake = os.environ.get("PROVIDERD_NVML_FAKE")
    return FakeCuda(fake) if fake else Cuda()


def info(cuda: Cuda | FakeCuda) -> dict[str, object]:
    return {
        "pid": os.getpid(),
        "bus_id": cuda.bus_id(),
        "held_bytes": cuda.held,
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER"),
        "nodes": cuda.nodes,
    }


def serve(cuda: Cuda | FakeCuda, port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def reply(self, code: int, body: dict[str, object]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            q = parse_qs(url.query)
            try:
                if url.path == "/health":
                    self.reply(200, {"ok": True})
                elif url.path == "/info":
                    self.reply(200, info(cuda))
                elif url.path == "/alloc":
                    cuda.alloc(int(q["bytes"][0]))
                    self.reply(200, info(cuda))
                elif url.path == "/slow":
                    time.sleep(float(q.get("s", ["1"])[0]))
                    self.reply(200, info(cuda))
                else:
                    self.reply(404, {"error": "no such path"})
            except Exception as e:  # report, keep serving
                self.reply(500, {"error": str(e)})

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.serve_forever()


def main(argv: list[str]) -> int:
    if argv[:1] == ["probe"]:
        try:
            print(json.dumps({"devices": open_cuda().count()}))
        except (OSError, RuntimeError) as e:
            print(json.dumps({"error": str(e)}))
        return 0
    cuda = open_cuda()
    cuda.open()
    if argv[:1] == ["hold"]:
        cuda.alloc(int(argv[1]))
        print(json.dumps(info(cuda)), flush=True)
        while True:
            time.sleep(3600)
    if argv[:1] == ["serve"]:
        port = int(argv[argv.index("--port") + 1])
        if "--bytes" in argv:
            cuda.alloc(int(argv[argv.index("--bytes") + 1]))
        serve(cuda, port)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
