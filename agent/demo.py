"""The demo model server shipped with providerd: CPU only, standard library only.

    python3 -m agent.demo --port N [--host H] [--name NAME] [--load-delay S]
                          [--memory-mb M] [--dim D] [--weights PATH] [--token-delay S]

At start it takes `--memory-mb` MiB of memory and touches every page (the "model"),
sleeps `--load-delay` seconds (the "load"), makes its weights — a deterministic
2048 x D float32 matrix, generated from a fixed seed, or read from `--weights PATH`
(generated and saved there first if the file does not exist) — and only then listens.

Endpoints (HTTP/1.1, keep-alive, JSON):
    GET  /health          200 {"status": "ok"}
    GET  /v1/models       the one model, OpenAI-shaped
    POST /v1/embeddings   {"input": str | [str], "model": ...} → one L2-normalised
                          D-dimensional vector per input: hashed character trigrams
                          times the weights. Same text, same weights → same vector.
    POST /v1/completions  {"prompt": str, "max_tokens": n, "stream": bool,
                          "token_delay_s": s} → deterministic words; with
                          "stream": true, server-sent events, one token every
                          token_delay_s (default --token-delay), then `data: [DONE]`.

Quiet: one line on stderr when loading, serving and stopping, none per request.
SIGTERM or SIGINT stops it cleanly (exit status 0), also during the load.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import socket
import sys
import threading
import time
import zlib
from array import array
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

from agent.atomic import write_atomic
from agent.errors import ProviderdError

BUCKETS = 2048
SEED = 20240601
MAGIC = b"PDW1"
MAX_BODY = 16 << 20
WORDS = (
    "the",
    "model",
    "answers",
    "every",
    "request",
    "with",
    "words",
    "chosen",
    "by",
    "hashing",
    "prompt",
    "so",
    "that",
    "tests",
    "can",
    "check",
    "what",
    "comes",
    "back",
    "while",
    "card",
    "stays",
    "cool",
    "and",
    "queue",
    "short",
)


# -- the "model": pure functions of the weights


class Weights:
    """A BUCKETS x dim float32 matrix, row-major."""

    def __init__(self, dim: int, data: array[float]) -> None:
        if len(data) != BUCKETS * dim:
            raise ValueError(f"expected {BUCKETS * dim} weights, got {len(data)}")
        self.dim = dim
        self.data = data

    @classmethod
    def generate(cls, dim: int) -> Weights:
        rng = random.Random(SEED * 1000 + dim)
        r = rng.random
        return cls(dim, array("f", [r() * 2.0 - 1.0 for _ in range(BUCKETS * dim)]))

    @classmethod
    def load(cls, path: Path) -> Weights:
        raw = path.read_bytes()
        if raw[:4] != MAGIC or len(raw) < 12:
            raise ValueError(f"{path} is not a providerd demo weight file")
        buckets = int.from_bytes(raw[4:8], "little")
        dim = int.from_bytes(raw[8:12], "little")
        if buckets != BUCKETS:
            raise ValueError(f"{path} has {buckets} rows, expected {BUCKETS}")
        data = array("f")
        data.frombytes(raw[12:])
        if sys.byteorder != "little":
            data.byteswap()
        return cls(dim, data)

    def save(self, path: Path) -> None:
        """Write atomically: a temporary file next to `path`, then rename."""
        data = array("f", self.data)
        if sys.byteorder != "little":
            data.byteswap()
        head = MAGIC + BUCKETS.to_bytes(4, "little") + self.dim.to_bytes(4, "little")
        write_atomic(path, head + data.tobytes(), 0o644, make_parent=False)

    def embed(self, text: str) -> list[float]:
        """Hashed character trigrams of `text` times the weights, L2-normalised."""
        padded = f"  {text.lower()}  "
        counts: dict[int, int] = {}
        for i in range(len(padded) - 2):
            bucket = zlib.crc32(padded[i : i + 3].encode()) % BUCKETS
            counts[bucket] = counts.get(bucket, 0) + 1
        dim, data = self.dim, self.data
        vec = [0.0] * dim
        for bucket, count in counts.items():
            row = data[bucket * dim : (bucket + 1) * dim]
            vec = [v + count * w for v, w in zip(vec, row, strict=True)]
        norm = math.sqrt(sum(v * v for v in vec)) or 1.0
        return [v / norm for v in vec]


def completion_tokens(prompt: str, n: int) -> list[str]:
    """`n` words, a pure function of the prompt."""
    seed = zlib.crc32(prompt.encode())
    return [" " + WORDS[zlib.crc32(i.to_bytes(4, "little"), seed) % len(WORDS)] for i in range(n)]


def count_tokens(text: str) -> int:
    return max(1, len(text.split()))


# -- HTTP


class BadRequest(ProviderdError):
    code = "bad_request"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], name: str, weights: Weights, token_delay: float):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, Handler)
        self.model_name = name
        self.weights = weights
        self.token_delay = token_delay


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "providerd-demo"
    sys_version = ""
    disable_nagle_algorithm = True
    server: Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: no line per request

    # dispatch

    def do_GET(self) -> None:
        if self.path == "/health":
            self.send_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            model = {"id": self.server.model_name, "object": "model", "owned_by": "providerd"}
            self.send_json(200, {"object": "list", "data": [model]})
        elif self.path in ("/v1/embeddings", "/v1/completions"):
            self.send_error_json(405, f"use POST for {self.path}")
        else:
            self.send_error_json(404, f"no such endpoint: GET {self.path}")

    def do_POST(self) -> None:
        try:
            body = self.read_json()
            if self.path == "/v1/embeddings":
                self.embeddings(body)
            elif self.path == "/v1/completions":
                self.completions(body)
            else:
                self.send_error_json(404, f"no such endpoint: POST {self.path}")
        except BadRequest as e:
            self.send_error_json(e.status, str(e))

    # endpoints

    def embeddings(self, body: dict[str, Any]) -> None:
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not all(isinstance(t, str) for t in inputs):
            raise BadRequest(400, "'input' must be a string or a list of strings")
        weights = self.server.weights
        data = [
            {"object": "embedding", "index": i, "embedding": weights.embed(text)}
            for i, text in enumerate(inputs)
        ]
        tokens = sum(count_tokens(t) for t in inputs)
        self.send_json(
            200,
            {
                "object": "list",
                "data": data,
                "model": self.server.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )

    def completions(self, body: dict[str, Any]) -> None:
        prompt = body.get("prompt", "")
        max_tokens = body.get("max_tokens", 16)
        delay = body.get("token_delay_s", self.server.token_delay)
        if not isinstance(prompt, str):
            raise BadRequest(400, "'prompt' must be a string")
        if not isinstance(max_tokens, int) or not 0 <= max_tokens <= 4096:
            raise BadRequest(400, "'max_tokens' must be an integer from 0 to 4096")
        if not isinstance(delay, int | float) or not 0 <= delay <= 60:
            raise BadRequest(400, "'token_delay_s' must be a number of seconds from 0 to 60")
        tokens = completion_tokens(prompt, max_tokens)
        ident = f"cmpl-demo-{zlib.crc32(prompt.encode()):08x}"
        head = {"id": ident, "object": "text_completion", "created": int(time.time())}
        head["model"] = self.server.model_name
        usage = {
            "prompt_tokens": count_tokens(prompt),
            "completion_tokens": len(tokens),
            "total_tokens": count_tokens(prompt) + len(tokens),
        }
        if not body.get("stream"):
            choice = {"index": 0, "text": "".join(tokens), "finish_reason": "length"}
            self.send_json(200, {**head, "choices": [choice], "usage": usage})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i, token in enumerate(tokens):
                if i:
                    time.sleep(float(delay))
                last = i == len(tokens) - 1
                choice = {"index": 0, "text": token, "finish_reason": "length" if last else None}
                self.write_chunk(f"data: {json.dumps({**head, 'choices': [choice]})}\n\n")
            self.write_chunk("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away; nothing to tell anyone

    # plumbing

    def read_json(self) -> dict[str, Any]:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raw = self.read_chunked()
        else:
            length = self.headers.get("Content-Length", "0")
            if not length.isdigit():
                raise BadRequest(400, "bad Content-Length")
            if int(length) > MAX_BODY:
                self.close_connection = True
                raise BadRequest(413, f"request body over {MAX_BODY} bytes")
            raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw or b"{}")
        except ValueError as e:
            raise BadRequest(400, f"request body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise BadRequest(400, "request body must be a JSON object")
        return body

    def read_chunked(self) -> bytes:
        out = bytearray()
        while True:
            line = self.rfile.readline(1024).split(b";")[0].strip()
            try:
                size = int(line, 16)
            except ValueError as e:
                raise BadRequest(400, "bad chunk size in request body") from e
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return bytes(out)
            if len(out) + size > MAX_BODY:
                self.close_connection = True
                raise BadRequest(413, f"request body over {MAX_BODY} bytes")
            out += self.rfile.read(size)
            self.rfile.readline(1024)

    def write_chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def send_json(self, status: int, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self.send_json(status, {"error": {"message": message, "type": kind}})


# -- the program


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m agent.demo", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--name", default="demo", help="the model name /v1/models shows (demo)")
    p.add_argument("--load-delay", type=float, default=0.0, metavar="S", help="seconds to load")
    p.add_argument("--memory-mb", type=int, default=0, metavar="M", help="MiB to hold, touched")
    p.add_argument("--dim", type=int, default=64, metavar="D", help="embedding dimension (64)")
    p.add_argument("--weights", type=Path, metavar="PATH", help="weight file, made if missing")
    p.add_argument(
        "--token-delay",
        type=float,
        default=0.05,
        metavar="S",
        help="seconds between streamed tokens",
    )
    args = p.parse_args(argv)
    if not 1 <= args.dim <= 4096:
        p.error("--dim must be from 1 to 4096")
    if args.memory_mb < 0 or args.load_delay < 0 or args.token_delay < 0:
        p.error("--memory-mb, --load-delay and --token-delay must not be negative")
    return args


def hold_memory(mb: int) -> bytearray:
    """`mb` MiB with every page written, so it counts as resident."""
    buf = bytearray(mb << 20)
    buf[::4096] = b"\x01" * len(range(0, len(buf), 4096))
    return buf


def load_weights(dim: int, path: Path | None) -> tuple[Weights, str]:
    if path is None:
        return Weights.generate(dim), "generated"
    if path.exists():
        weights = Weights.load(path)
        return weights, str(path)
    weights = Weights.generate(dim)
    weights.save(path)
    return weights, f"generated, saved to {path}"


def log(line: str) -> None:
    print(f"demo: {line}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server: Server | None = None

    def stop(signum: int, _frame: FrameType | None) -> None:
        log(f"stopping ({signal.Signals(signum).name})")
        if server is None:
            raise SystemExit(0)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log(f"loading (load delay {args.load_delay:g} s, {args.memory_mb} MiB)")
    memory = hold_memory(args.memory_mb)
    time.sleep(args.load_delay)
    try:
        weights, origin = load_weights(args.dim, args.weights)
    except (OSError, ValueError) as e:
        log(f"Failed to load weights: {e}")
        return 1
    try:
        server = Server((args.host, args.port), args.name, weights, args.token_delay)
    except OSError as e:
        log(f"Failed to listen on {args.host}:{args.port}: {e.strerror or e}")
        return 1
    log(f"serving {args.name} on {args.host}:{args.port} (dim {weights.dim}, weights {origin})")
    with server:
        server.serve_forever(poll_interval=0.1)
    del memory
    log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
