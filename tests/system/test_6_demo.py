"""`examples/demo.sh` where systemd runs the host: the installed demo, through provider@demo.socket."""

from __future__ import annotations

import re

from .nspawn import Container


def test_the_installed_demo_runs_under_systemd(ct: Container) -> None:
    try:
        r = ct.sh("bash /usr/share/doc/providerd/examples/demo.sh", check=False, timeout=120)
        assert r.rc == 0, str(r)
        out = r.out
        assert "providerctl reload" in out
        answers = re.findall(r"answered 200 after ([0-9.]+) s", out)
        assert len(answers) == 2, out
        assert "127.0.0.1:8008 is listening" in out
        assert re.search(r"Idle for [0-9.]+ ?s", out), out
    finally:
        ct.sh("rm -f /etc/providerd/providers/demo.toml && providerctl reload", check=False)
