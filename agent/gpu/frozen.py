"""Small values that do not change once made, without importing `dataclasses`.

The front's early start places a GPU worker on the way to its StartUnit
(`agent.front.early`), where `dataclasses` (with `inspect`, `ast`, `re` …) and `typing`
cost milliseconds to import. `Frozen` gives what a frozen dataclass gives the GPU's
values: equality, a hash and a repr over the fields (the class's `__slots__`), and no
assignment after `__init__`. A subclass's `__init__` takes its fields by their names (what
copying and pickling pass it).
"""

from __future__ import annotations


class Frozen:
    """A value whose fields are its class's `__slots__`; its `__init__` passes each by name
    to `Frozen.__init__`."""

    __slots__: tuple[str, ...] = ()

    def __init__(self, **values: object) -> None:
        names = type(self).__slots__
        if sorted(values) != sorted(names):
            raise TypeError(f"{type(self).__name__} has the fields {names}, got {sorted(values)}")
        for name in names:
            object.__setattr__(self, name, values[name])

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in type(self).__slots__)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of {type(self).__name__}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r} of {type(self).__name__}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Frozen)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._values()))

    def __reduce__(self) -> tuple[object, ...]:  # copy and pickle: through `__init__`
        return (_make, (type(self), tuple(zip(type(self).__slots__, self._values(), strict=True))))

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in type(self).__slots__)
        return f"{type(self).__name__}({fields})"


def _make(cls: type[Frozen], fields: tuple[tuple[str, object], ...]) -> Frozen:
    return cls(**dict(fields))
