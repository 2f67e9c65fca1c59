"""Providers as an operator writes them: broken models, quoting, reload, bad manifests."""

from __future__ import annotations

import json
import re

from .conftest import Provider, probe_manifest
from .nspawn import Container

HAMMER = r"""
import json, sys, urllib.request
from concurrent.futures import ThreadPoolExecutor
n, url = int(sys.argv[1]), sys.argv[2]
def one(i):
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            return [r.status, dict(r.headers), r.read().decode(errors="replace")]
    except urllib.error.HTTPError as e:
        return [e.code, dict(e.headers), e.read().decode(errors="replace")]
    except Exception as e:
        return [repr(e), {}, ""]
with ThreadPoolExecutor(10) as pool:
    print(json.dumps(list(pool.map(one, range(n)))))
"""


def hammer(ct: Container, port: int, n: int) -> list[list[object]]:
    ct.write("/root/hammer.py", HAMMER)
    return list(
        json.loads(ct.sh(f"python3 /root/hammer.py {n} http://127.0.0.1:{port}/", timeout=600).out)
    )


def test_a_model_that_cannot_start_gets_503_and_the_port_stays(
    ct: Container, provider: Provider
) -> None:
    port = 18020
    provider.add("broken", probe_manifest(port, "--exit", "3"))
    results = hammer(ct, port, 100)
    codes = [r[0] for r in results]
    assert codes == [503] * 100, f"expected 100 times 503, got {sorted(set(map(str, codes)))}"
    _, headers, body = results[0]
    assert any(k.lower() == "retry-after" for k in headers), headers  # type: ignore[union-attr]
    doc = json.loads(str(body))
    assert doc["provider"] == "broken" and "retry_after_s" in doc, doc
    # The error names the cause: the model exited with status 3 before it was ready.
    assert re.search(r"status 3|exit", str(doc["message"])), doc
    assert ct.active("provider@broken.socket") == "active"
    assert ct.sh("systemctl is-failed -q provider@broken.socket", check=False).rc != 0
    assert ct.listening(port)
    # The cause reaches the journal, with the worker's own last words.
    log = ct.journal("-u provider@broken.service")
    assert "Failed to start" in log or "failed" in log.lower(), log


def test_percent_dollar_and_spaces_reach_the_worker_unchanged(
    ct: Container, provider: Provider
) -> None:
    port = 18021
    args = ["100%", "$HOME", "${X}", "two  spaces", "it's", 'say "hi"', "back\\slash", "%i %n %%"]
    env = {
        "WITH_DOLLAR": "$PATH and ${HOME}",
        "WITH_PERCENT": "50% %h %%",
        "WITH_SPACES": " lead  and trail ",
    }
    manifest = probe_manifest(
        port,
        # TOML basic strings; braces doubled because commands take {placeholders}.
        *[
            a.replace("\\", "\\\\").replace('"', '\\"').replace("{", "{{").replace("}", "}}")
            for a in args
        ],
        environment="".join(f"{k} = {json.dumps(v)}\n" for k, v in env.items()),
    )
    provider.add("quoting", manifest)
    out = json.loads(ct.sh(f"curl -sS --max-time 60 http://127.0.0.1:{port}/").out)
    argv = out["argv"]
    assert argv[-len(args) :] == args, argv
    for k, v in env.items():
        assert out["env"].get(k) == v, (k, out["env"].get(k))


def test_a_new_manifest_and_reload_opens_its_port(ct: Container, provider: Provider) -> None:
    port = 18022
    assert not ct.listening(port)
    provider.add("fresh", probe_manifest(port), reload=False)
    r = ct.sh("providerctl reload", check=False)
    assert r.rc == 0, str(r)
    assert "fresh" in r.out + r.err, "reload did not say what it did"
    assert ct.listening(port)
    assert '"argv"' in ct.sh(f"curl -sS --max-time 60 http://127.0.0.1:{port}/").out


def test_a_bad_manifest_leaves_the_others_alone(ct: Container, provider: Provider) -> None:
    good, bad = 18023, 18024
    provider.add("good", probe_manifest(good))
    assert ct.listening(good)
    provider.add("bad", probe_manifest(bad, extra="[limits]\nmemory_maximum = 12\n"), reload=False)
    ct.sh("providerctl reload", check=False)
    assert ct.listening(good)
    assert ct.active("provider@good.socket") == "active"
    assert not ct.listening(bad)
    assert '"argv"' in ct.sh(f"curl -sS --max-time 60 http://127.0.0.1:{good}/").out
    check = ct.sh("providerctl check", check=False)
    assert check.rc == 1, str(check)
    problems = [line for line in (check.out + check.err).splitlines() if "bad.toml" in line]
    assert problems and "limits.memory_maximum" in problems[0], str(check)
    assert "memory_max" in problems[0], "no 'did you mean' for a close key"


def test_a_gpu_provider_on_a_host_without_nvidia_gets_503_saying_why(
    ct: Container, provider: Provider
) -> None:
    """No driver here: the GPU provider's requests are refused with NVML's reason, the
    port stays, and a CPU provider next to it serves as usual."""
    gpu, cpu = 18026, 18027
    provider.add("needs_gpu", probe_manifest(gpu, extra='[gpu]\ndevices = "auto"\n'), reload=False)
    provider.add("cpu_next_door", probe_manifest(cpu))
    r = ct.sh(f"curl -sS -m 60 -w '\\n%{{http_code}}' http://127.0.0.1:{gpu}/", check=False)
    body, _, code = r.out.rpartition("\n")
    assert code == "503", r
    doc = json.loads(body)
    assert doc["provider"] == "needs_gpu"
    assert "NVML is unavailable" in doc["message"], doc
    assert ct.listening(gpu)
    assert ct.active("provider-worker@needs_gpu.service") == "inactive"
    r = ct.sh(f"curl -sS -m 60 -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{cpu}/")
    assert r.out == "200", r
    assert "NVML is unavailable" in ct.journal("-u provider@needs_gpu.service")
