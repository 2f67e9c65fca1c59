"""`providerctl`'s exit codes and its `Hint:` lines, run in-process against real manifest
directories. The codes follow systemctl's (providerctl(1), EXIT STATUS): 0 success,
1 failure, 2 wrong usage, 3 not running (status), 4 no such provider."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cases.harness import write

from agent.cli import main as cli
from agent.systemd import reload
from agent.systemd.reload import SystemdError

GOOD = '[listen]\naddress = "127.0.0.1:18231"\n[runtime]\ncommand = ["/bin/true"]\n'
BAD = '[listen]\naddress = "127.0.0.1:18232"\n[runtime]\ncommand = "/bin/true"\n'


@pytest.fixture(autouse=True)
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty manifest directory, runtime directory and settings of the test's own."""
    manifests = tmp_path / "providers"
    manifests.mkdir(mode=0o755)
    manifests.chmod(0o755)
    monkeypatch.setenv("PROVIDERD_MANIFEST_DIRS", str(manifests))
    monkeypatch.setenv("PROVIDERD_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("PROVIDERD_CONFIG", str(tmp_path / "providerd.toml"))
    monkeypatch.setenv("PROVIDERD_TRUSTED_UID", str(os.getuid()))
    monkeypatch.delenv("PROVIDERD_MANIFEST", raising=False)
    monkeypatch.setenv("PROVIDERD_NVML_FAKE", str(tmp_path / "no-gpus"))
    return manifests


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], list[str]]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def test_0_a_valid_manifest_checks(host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(host, "good.toml", GOOD)
    code, out, err = run(capsys, "check")
    assert code == cli.EXIT_OK == 0
    assert out == ["good: 127.0.0.1:18231 (http) -> /bin/true"]
    assert err == []


def test_0_status_with_nothing_declared_says_where_manifests_go(
    host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "status")
    assert code == 0
    assert out[0] == f"No providers: no manifests in {host}."
    assert out[1].startswith(f"Hint: declare one in {host}/<slug>.toml")
    code, out, _ = run(capsys, "status", "--json")
    assert code == 0
    assert json.loads("\n".join(out))["providers"] == []


def test_1_a_manifest_with_a_problem(host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(host, "good.toml", GOOD)
    bad = write(host, "bad.toml", BAD)
    code, out, _ = run(capsys, "check")
    assert code == cli.EXIT_FAILURE == 1
    assert len(out) == 1 and out[0].startswith(f"{bad}: runtime.command: expected ")


def test_1_status_points_at_check_when_every_manifest_is_broken(
    host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(host, "bad.toml", BAD)
    code, out, _ = run(capsys, "status")
    assert code == 0  # nothing asked for is missing
    assert out == [
        f"No providers: 1 manifest(s) in {host} have problems.",
        "Hint: 'providerctl check' lists them.",
    ]


def test_1_serving_nothing_valid_fails_with_a_hint(
    host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(host, "bad.toml", BAD)
    code, _, err = run(capsys, "serve", str(host))
    assert code == 1
    assert err[-2:] == [
        "providerctl: no valid provider to serve",
        "Hint: 'providerctl check PATH...' explains why",
    ]


def test_1_an_error_a_verb_does_not_handle_prints_its_message_and_hint(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(out: object) -> int:
        raise SystemdError("Failed to verify: systemd-analyze crashed", hint="run it by hand")

    monkeypatch.setattr(reload, "dry_run", failing)
    code, _, err = run(capsys, "generate", "--dry-run")
    assert code == 1
    assert err == ["providerctl: Failed to verify: systemd-analyze crashed", "Hint: run it by hand"]


@pytest.mark.parametrize(
    ("argv", "message", "hint"),
    [
        (
            ["frobnicate"],
            "providerctl: argument VERB: invalid choice: 'frobnicate'",
            "Hint: 'providerctl --help' lists the verbs",
        ),
        (
            ["status", "--colour"],
            "providerctl: unrecognized arguments: --colour",
            "Hint: 'providerctl --help' lists the verbs",
        ),
        (
            ["generate"],
            "providerctl: generate only previews; systemd runs the generator itself",
            "Hint: use 'providerctl generate --dry-run', then 'providerctl reload' to apply",
        ),
        (
            ["export", "kubernetes", "--image", "img:1", "--namespace", "Not_A_Namespace"],
            "providerctl: --namespace: ",
            "Hint: 'providerctl export --help' lists the options",
        ),
    ],
)
def test_2_wrong_usage(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str, hint: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == cli.EXIT_USAGE == 2
    assert out == []
    assert err[0].startswith(message), err
    assert err[1:] == [hint]


def test_2_no_verb_prints_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys)
    assert code == 2
    assert out[0].startswith("usage: providerctl")


def test_3_status_of_a_provider_that_does_not_run(
    host: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(host, "good.toml", GOOD)
    code, out, _ = run(capsys, "status", "good")
    assert code == cli.EXIT_INACTIVE == 3
    assert out[0] == "○ good"
    code, out, _ = run(capsys, "status", "good", "--json")
    assert code == 3
    assert [p["state"] for p in json.loads("\n".join(out))["providers"]] == ["inactive"]


@pytest.mark.parametrize("verb", ["status", "warm", "stop"])
def test_4_no_such_provider(host: Path, capsys: pytest.CaptureFixture[str], verb: str) -> None:
    write(host, "good.toml", GOOD)
    code, out, err = run(capsys, verb, "nope")
    assert code == cli.EXIT_NO_SUCH == 4
    assert out == []
    assert err == ["providerctl: no such provider: nope", "Hint: 'providerctl check' lists them"]
