"""Options shared by every tier.

The system (container) and vm tiers need root, systemd-nspawn or qemu and a built
.deb; they run only when asked (`make system`, `make vm`), never by a bare pytest.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from agent.net.loop import new_loop

TESTS = Path(__file__).resolve().parent


class _ProductLoops(asyncio.DefaultEventLoopPolicy):
    """Every loop a test makes (`asyncio.run`, `asyncio.new_event_loop`) is the kind the
    product runs on (agent.net.loop): the data path is tested on the loop it serves on."""

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return new_loop()


asyncio.set_event_loop_policy(_ProductLoops())

# Property-based tests: a small budget in the unit tier, a long one for `make fuzz`
# (`--hypothesis-profile=fuzz`, or PROVIDERD_FUZZ_EXAMPLES=N for any other budget).
# The autouse fixtures below only set environment variables, the same for every example.
_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile("unit", max_examples=150, deadline=None, suppress_health_check=_QUIET)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("PROVIDERD_FUZZ_EXAMPLES", "20000")),
    deadline=None,
    suppress_health_check=_QUIET,
)
settings.load_profile("unit")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("providerd")
    group.addoption(
        "--run-system", action="store_true", help="run the container tier (make system)"
    )
    group.addoption("--run-vm", action="store_true", help="run the VM tier (make vm)")
    group.addoption(
        "--deb", default=None, help="the providerd .deb the system and vm tiers install"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = (
            Path(str(item.path)).relative_to(TESTS).parts[0]
            if TESTS in Path(str(item.path)).parents
            else ""
        )
        if tier == "system":
            item.add_marker(pytest.mark.system)
            if not config.getoption("--run-system"):
                item.add_marker(pytest.mark.skip(reason="container tier: run `make system`"))
        elif tier == "vm":
            item.add_marker(pytest.mark.vm)
            if not config.getoption("--run-vm"):
                item.add_marker(pytest.mark.skip(reason="VM tier: run `make vm`"))


@pytest.fixture(autouse=True)
def _state_dir_of_this_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fronts made in-process keep counters and footprints under the state directory:
    a test's own, never the host's /var/lib/providerd."""
    monkeypatch.setenv("PROVIDERD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("PROVIDERD_RUNTIME_DIR", str(tmp_path / "run"))  # live counters
    monkeypatch.setenv("PROVIDERD_KEYS", str(tmp_path / "keys.toml"))  # none: keys off


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    try:
        from cases.fuzzing import TRIED
    except ImportError:
        return
    if TRIED:
        total = sum(n for name, n in TRIED.items() if ": " not in name)  # not the breakdowns
        terminalreporter.write_line(f"property-based tests: {total} cases tried")
        for name, n in sorted(TRIED.items()):
            terminalreporter.write_line(f"  {n:8d}  {name}")
