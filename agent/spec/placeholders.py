"""Command placeholders such as `{port}` and their substitution.

Kept apart from `agent.spec.provider` so that the worker wrapper, which fills them on every
start, imports nothing but this. `agent.spec.provider` re-exports both names. No I/O here.
"""

from __future__ import annotations

# Placeholders a command may use; filled by the generator (agent.systemd.units.model_command)
# or, where it runs, by the worker wrapper when the worker starts.
# "{{" and "}}" stand for literal braces.
PLACEHOLDERS = {
    "port": "the worker's private TCP port",
    "host": "the worker's private host address (127.0.0.1)",
    "slug": "the provider's slug",
    "python": "the Python interpreter that runs providerd",
}


def placeholder_values(*, port: str, host: str, slug: str, python: str) -> dict[str, str]:
    """What each placeholder stands for, one argument per name in PLACEHOLDERS (the
    generator, the wrapper and the Kubernetes export each know them differently)."""
    return {"port": port, "host": host, "slug": slug, "python": python}


def fill_placeholders(arg: str, values: dict[str, str]) -> str:
    """Replace `{name}` in one argument; `{{`/`}}` are literal braces.

    Raises KeyError for an unknown name and ValueError for an unbalanced brace.
    """
    out: list[str] = []
    i, n = 0, len(arg)
    while i < n:
        c = arg[i]
        if c == "{":
            if arg.startswith("{{", i):
                out.append("{")
                i += 2
                continue
            end = arg.find("}", i)
            if end < 0:
                raise ValueError("unbalanced '{' (write '{{' for a literal brace)")
            out.append(values[arg[i + 1 : end]])
            i = end + 1
        elif c == "}":
            if not arg.startswith("}}", i):
                raise ValueError("unbalanced '}' (write '}}' for a literal brace)")
            out.append("}")
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)
