"""A registry of the strategies users choose by name in a recipe (the KDA layer's CP exchanges,
the DSA layer's kernels): one class per name, ``auto`` reserved for the choice made when the
recipe is loaded to run. Registration order is the order of preference where one is needed."""

from __future__ import annotations

from typing import Generic, TypeVar

AUTO = "auto"
"""The value that asks for a choice, resolved once when the recipe is loaded to run."""

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Subclasses of ``base`` by their ``name``, for the recipe setting ``setting``;
    ``resolved_by`` says where ``auto`` is resolved (for the error that refuses it)."""

    def __init__(self, base: T, setting: str, resolved_by: str):
        self.base, self.setting, self.resolved_by = base, setting, resolved_by
        self._classes: dict[str, T] = {}

    def register(self, cls: T) -> T:
        """Add ``cls`` under ``cls.name`` (the same class again is a no-op); returns it, so it
        also works as a class decorator."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{cls!r} is not a {self.base.__name__} subclass")
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name or name == AUTO:
            raise ValueError(f"{cls.__name__}.name={name!r}: each {self.setting} value needs "
                             f"its own non-empty name (not {AUTO!r})")
        existing = self._classes.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"{self.setting} {name!r} is already registered to "
                             f"{existing.__name__}")
        self._classes[name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove the class registered under ``name`` (a plugin's or a test's)."""
        self._classes.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._classes)

    def choices(self) -> tuple[str, ...]:
        """The values the setting accepts: the registered names, then ``auto``."""
        return (*self._classes, AUTO)

    def check(self, value: str) -> str:
        """``value`` if the setting accepts it, else a one-line ``ValueError`` naming the setting,
        the choices (in pydantic's wording for a choice) and the value."""
        if value not in self.choices():
            quoted = [repr(name) for name in self.choices()]
            raise ValueError(f"{self.setting}: Input should be {', '.join(quoted[:-1])} or "
                             f"{quoted[-1]}, got {value!r}")
        return value

    def get(self, name: str) -> T:
        """The class registered under ``name``; ``auto`` (not resolved) and unknown names are
        refused."""
        if name == AUTO:
            raise ValueError(f"{self.setting}=auto is not resolved: resolve it when the recipe is "
                             f"loaded ({self.resolved_by})")
        if name not in self._classes:
            raise ValueError(f"unknown {self.setting} {name!r}; expected one of "
                             f"{', '.join(self._classes)}")
        return self._classes[name]

    def items(self):
        """(name, class) pairs in registration order."""
        return self._classes.items()
