"""Options shared by every tier.

The system (container) and vm tiers need root, systemd-nspawn or qemu and a built
.deb; they run only when asked (`make system`, `make vm`), never by a bare pytest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


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
