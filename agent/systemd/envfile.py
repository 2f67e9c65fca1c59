"""An EnvironmentFile='s text (worker.env): pure, and with no imports, since the front's
early start writes one on the way to the worker's StartUnit."""

from __future__ import annotations

TYPE_CHECKING = False  # not typing's, for the same reason (mypy reads this one as typing's)
if TYPE_CHECKING:
    from collections.abc import Mapping


def environment_file(env: Mapping[str, str]) -> str:
    """Each value double-quoted, `\\`, `"` and `$` escaped."""
    lines = []
    for key, value in env.items():
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
        lines.append(f'{key}="{escaped}"\n')
    return "".join(lines)
