#!/bin/bash
# The demo provider, end to end, in under a minute:
#   a cold request is held while the model loads, then served;
#   `providerctl status` while it serves;
#   the worker is released after the idle timeout; the port still listens;
#   the next request starts it again.
# Where systemd runs the host and providerd is installed, the demo uses systemd
# (provider@demo.socket); elsewhere it runs `providerctl serve` in the foreground.
# `make demo` runs it from a checkout; it also runs from /usr/share/doc/providerd/examples.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
manifest=$here/demo.toml
if [[ -x $here/../.venv/bin/providerctl ]]; then
    providerctl=$(cd "$here/.." && pwd)/.venv/bin/providerctl
    python=$(cd "$here/.." && pwd)/.venv/bin/python
else
    providerctl=$(command -v providerctl) || { echo "demo: providerctl is not installed (make demo sets it up)" >&2; exit 1; }
    python=/usr/bin/python3
fi
[[ -f $manifest ]] || { echo "demo: $manifest is missing" >&2; exit 1; }

bold=$'\e[1m' dim=$'\e[2m' off=$'\e[0m'
[[ -t 1 ]] || bold='' dim='' off=''
step() { printf '\n%s==> %s%s\n' "$bold" "$*" "$off"; }
show() { printf '%s$ %s%s\n' "$dim" "$*" "$off"; "$@"; }

free_port() {
    "$python" - "$1" <<'EOF'
import socket, sys
want = int(sys.argv[1])
for port in [want, 0]:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
        print(s.getsockname()[1])
        break
EOF
}

listening() {
    "$python" -c "import socket,sys; s=socket.socket(); s.settimeout(2); sys.exit(s.connect_ex(('127.0.0.1', $1)))"
}

request() {
    local t0=$EPOCHREALTIME out
    out=$(curl -sS --max-time 60 "http://127.0.0.1:$port/v1/embeddings" \
        -H 'Content-Type: application/json' -d '{"input": "hello, providerd"}')
    printf '%s\n' "${out:0:110}..."
    awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "answered 200 after %.2f s\n", b - a }'
}

idle_s=$(sed -n 's/^idle_timeout_s *= *\([0-9.]*\).*/\1/p' "$manifest")
idle_s=${idle_s%.*}

if [[ -d /run/systemd/system && -x /usr/lib/systemd/system-generators/providerd-generator && $(id -u) == 0 ]]; then
    # --- with systemd -------------------------------------------------------------
    port=$(sed -n 's/^address *= *"127.0.0.1:\([0-9]*\)".*/\1/p' "$manifest")
    step "Installing the demo manifest and reloading"
    install -m 0644 "$manifest" /etc/providerd/providers/demo.toml
    show providerctl reload
    show systemctl status --no-pager provider@demo.socket | head -n 5 || true
    step "A cold request: held while the model loads, then served"
    request
    step "Status while serving"
    show systemctl status --no-pager provider@demo.service | head -n 8 || true
    show providerctl status demo || true
    step "Waiting ${idle_s} s for the idle timeout"
    sleep $((idle_s + 3))
    show journalctl -q --no-pager -u provider@demo.service -n 6 || true
    show systemctl is-active provider@demo.socket provider@demo.service provider-worker@demo.service || true
    step "The port still listens; the next request starts the model again"
    listening "$port" && echo "127.0.0.1:$port is listening"
    request
    step "Done. Remove the demo with: rm /etc/providerd/providers/demo.toml && providerctl reload"
    exit 0
fi

# --- foreground, without systemd ----------------------------------------------------
work=$(mktemp -d /tmp/providerd-demo.XXXXXX)
serve_pid=
cleanup() {
    if [[ -n $serve_pid ]] && kill -0 "$serve_pid" 2>/dev/null; then
        kill -TERM "$serve_pid" 2>/dev/null || true
        wait "$serve_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

port=$(free_port 8008)
# A private copy of the manifest on a free port; its owner is the user running the demo.
sed "s/^address *= *\".*\"/address = \"127.0.0.1:$port\"/" "$manifest" >"$work/demo.toml"
chmod 0644 "$work/demo.toml"
export PROVIDERD_RUNTIME_DIR=$work/run PROVIDERD_TRUSTED_UID
PROVIDERD_TRUSTED_UID=$(id -u)

step "Starting providerd in the foreground: providerctl serve $manifest (port $port)"
"$providerctl" serve "$work/demo.toml" 2> >(sed -u "s/^/  ${dim}[serve]${off} /" >&2) &
serve_pid=$!
for _ in $(seq 100); do
    listening "$port" && break
    kill -0 "$serve_pid" 2>/dev/null || { echo "demo: providerctl serve exited" >&2; exit 1; }
    sleep 0.1
done
listening "$port"
echo "127.0.0.1:$port is listening; no model is running yet"
sleep 0.3

step "A cold request: held while the model loads, then served"
request
sleep 0.3

step "Status while serving"
show "$providerctl" status
sleep 0.3

step "Waiting ${idle_s} s for the idle timeout"
sleep $((idle_s + 2))
show "$providerctl" status || true

step "The port still listens; the next request starts the model again"
listening "$port" && echo "127.0.0.1:$port is listening"
request

step "Stopping providerd (SIGTERM): every worker stops with it"
kill -TERM "$serve_pid"
wait "$serve_pid" || true
serve_pid=
sleep 0.2
echo "Done."
