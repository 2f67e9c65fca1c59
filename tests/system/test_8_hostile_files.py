"""Hostile files beside a good manifest, under a real systemd: daemon-reload finishes,
the good provider is generated and serves, nothing of the others reaches a unit, and
every module's log lines reach `journalctl -u provider@SLUG`."""

from __future__ import annotations

import json
import shlex

from cases.harness import CASES

from .conftest import Provider, probe_manifest
from .nspawn import Container

PORT = 18030
HOSTILE = [
    "deep_array",
    "deep_table_value",
    "huge_port_digits",
    "huge_tasks_max",
    "huge_memory_max",
    "huge_vram_budget",
    "scope_newline",
    "allow_scope_newline",
    "unix_trailing_backslash",
    "description_newline",
]
# Entries no file can hold: a symlink loop without .toml, a self-looping manifest, a
# FIFO, a device, a directory named like a manifest, a name that is not UTF-8.
SPECIAL = (
    "ln -s loop loop && ln -s selfloop.toml selfloop.toml && mkfifo fifo.toml && "
    "ln -s /dev/zero zero.toml && mkdir dir.toml && "
    f'printf \'[listen]\\naddress = "127.0.0.1:{PORT + 1}"\\n[runtime]\\ncommand = ["/bin/true"]\\n\''
    " > $'caf\\xe9.toml'"
)
SPECIAL_NAMES = ["loop", "selfloop.toml", "fifo.toml", "zero.toml", "dir.toml", "$'caf\\xe9.toml'"]


def test_hostile_files_cost_only_themselves(ct: Container, provider: Provider) -> None:
    d = "/etc/providerd/providers"
    for name in HOSTILE:
        ct.write(f"{d}/{name}.toml", (CASES / "invalid" / f"{name}.toml").read_text())
        provider.slugs.append(name)
    ct.sh(f"cd {d} && {SPECIAL}")
    # providerd.toml as a FIFO: the generator once blocked on it until systemd killed it.
    ct.sh("mkfifo /etc/providerd/providerd.toml")
    try:
        provider.add("hgood", probe_manifest(PORT), reload=False)
        reload = ct.sh("systemctl daemon-reload", timeout=60)
        assert reload.rc == 0, str(reload)
        ct.sh("systemctl start provider@hgood.socket")
        out = json.loads(ct.sh(f"curl -sS --max-time 60 http://127.0.0.1:{PORT}/").out)
        assert out["argv"][0].endswith("probe_worker.py"), out

        # Only the good provider got units; nothing smuggled reached any unit.
        generated = ct.sh("ls /run/systemd/generator").out.split()
        assert "provider@hgood.socket.d" in generated
        assert not [g for g in generated if any(h in g for h in HOSTILE)], generated
        assert ct.sh("grep -rl -e pwned -e PWNED /run/systemd/generator", check=False).out == ""
        assert ct.prop("provider@hgood.socket", "ExecStartPre") == ""
        for name in HOSTILE:
            assert ct.active(f"provider@{name}.socket") == "inactive", name

        # Each problem is one line, names escaped. (In this container /dev/kmsg is not the
        # kernel log: run the installed generator again with its stderr fallback.)
        gen = ct.sh(
            "python3 -c 'import sys; from agent.systemd import generator; "
            'sys.exit(generator.main(["/tmp/hostile-gen"], generator.Log(kmsg="/nonexistent")))\'',
            timeout=60,
        )
        logged = gen.err
        assert 'caf\\xe9.toml: "caf\\xe9" is not a valid provider name' in logged, logged
        for name in [*HOSTILE, "selfloop", "fifo", "zero", "dir"]:
            assert f'Skipping provider "{name}"' in logged, (name, logged)
        assert "providerd.toml: is not a regular file" in logged, logged
        assert "Failed to read manifests" not in logged and "Traceback" not in logged
        again = ct.sh("ls /tmp/hostile-gen").out.split()
        assert "provider-worker@hgood.service.d" in again
        assert not [g for g in again if any(h in g for h in HOSTILE)], again

        # providerctl check: one line per problem, no traceback, exit 1.
        check = ct.sh("providerctl check", check=False)
        assert check.rc == 1 and "Traceback" not in check.out + check.err, str(check)
        assert f"{d}/caf\\xe9.toml: " in check.out, check.out
        assert "hgood" not in check.out
    finally:
        ct.sh(f"cd {d} && rm -rf {' '.join(SPECIAL_NAMES)}", check=False)
        ct.sh("rm -rf /etc/providerd/providerd.toml /tmp/hostile-gen", check=False)
        ct.sh("systemctl daemon-reload", check=False)


FAKE_CARD = [{"uuid": "GPU-00000000-0000-0000-0000-000000000001", "total": 80 << 30}]


def test_module_loggers_reach_the_providers_journal(ct: Container, provider: Provider) -> None:
    """agent.gpu.footprint logs through getLogger(__name__): its warning must reach the
    front's journal with the provider's field, not stderr through logging.lastResort."""
    slug, port = "hlog", PORT + 2
    ct.write("/srv/fakegpu/cards.json", json.dumps(FAKE_CARD))
    ct.write(
        f"/etc/systemd/system/provider@{slug}.service.d/60-fake-nvml.conf",
        "[Service]\nEnvironment=PROVIDERD_NVML_FAKE=/srv/fakegpu\n",
    )
    ct.write(f"/var/lib/providerd/footprints/{slug}.json", "{ not json")
    try:
        provider.add(slug, probe_manifest(port, extra="[gpu]\nvram_budget_gb = 1\n"))
        since = ct.cursor()
        ct.sh(f"curl -sS --max-time 60 -o /dev/null http://127.0.0.1:{port}/", check=False)
        line = f"Failed to read VRAM footprint /var/lib/providerd/footprints/{slug}.json"
        ct.wait_for(
            f"journalctl -q -o cat -u provider@{slug}.service | grep -qF {shlex.quote(line)}"
        )
        fields = ct.journal(f"-u provider@{slug}.service -o json", since=since)
        entries = [json.loads(x) for x in fields.splitlines() if line in x]
        assert entries, fields
        assert entries[0].get("PROVIDER") == slug, entries[0]
        assert entries[0].get("LOGGER") == "agent.gpu.footprint", entries[0]
        assert entries[0].get("PRIORITY") == "4", entries[0]  # a warning
    finally:
        ct.sh(
            f"rm -rf /etc/systemd/system/provider@{slug}.service.d /srv/fakegpu "
            f"/var/lib/providerd/footprints/{slug}.json; systemctl daemon-reload",
            check=False,
        )
