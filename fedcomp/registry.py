"""Name → class registries with typed configs.

Every pluggable role (compressor, memory, staleness function, server optimizer, model, ...) keeps one
``Registry``. A registered class declares its options as a frozen dataclass in ``cls.Config``; ``build``
validates option names against it, so a typo is a ``ConfigError`` naming the known options, never a
silently ignored keyword.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad name or option in a configuration."""


def check_ranges(*rules: tuple[str, Any, str, bool], error: type[Exception] = ConfigError, prefix: str = "") -> None:
    """Raise ``error`` for the first ``(name, value, rule, ok)`` whose ``ok`` is false, naming that one value.

    >>> check_ranges(("workers", 2, ">= 1", 2 >= 1), ("epochs", 0, ">= 1", 0 >= 1))
    Traceback (most recent call last):
    fedcomp.registry.ConfigError: epochs must be >= 1, got 0
    """
    for name, value, rule, ok in rules:
        if not ok:
            raise error(f"{prefix}{name} must be {rule}, got {value!r}")


class Registry(Generic[T]):
    """Maps names to classes (or factories) that take one typed config."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._entries: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def deco(cls: type[T]) -> type[T]:
            if name in self._entries:
                raise ConfigError(f"{self.role} {name!r} is registered twice")
            self._entries[name] = cls
            cls.registry_name = name  # type: ignore[attr-defined]
            return cls

        return deco

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> type[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.role} {name!r}; known: {', '.join(self.names())}"
            ) from None

    def config_fields(self, name: str) -> set[str]:
        cfg = getattr(self.get(name), "Config", None)
        return {f.name for f in dataclasses.fields(cfg)} if cfg else set()

    def make_config(self, name: str, **options: Any) -> Any:
        """Build ``cls.Config`` for ``name`` from keyword options, rejecting unknown ones."""
        cls = self.get(name)
        cfg_cls = getattr(cls, "Config", None)
        if cfg_cls is None:
            if options:
                raise ConfigError(f"{self.role} {name!r} takes no options, got {sorted(options)}")
            return None
        unknown = set(options) - self.config_fields(name)
        if unknown:
            raise ConfigError(
                f"{self.role} {name!r}: unknown option(s) {sorted(unknown)}; "
                f"known: {sorted(self.config_fields(name))}"
            )
        for key, value in list(options.items()):
            wanted = _scalar_type(cfg_cls, key)
            if wanted is not None and not _is_number(value):
                raise ConfigError(f"{self.role} {name!r}: {key} must be {_TYPE_WORDS[wanted]}, got {value!r}")
            if wanted is int:  # torch and numpy take seeds and counts as int64
                if (whole := _int64(value)) is None:
                    raise ConfigError(f"{self.role} {name!r}: {key} must be a whole number of at most 63 bits, "
                                      f"got {value!r}")
                options[key] = whole
        try:
            return cfg_cls(**options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.role} {name!r}: {exc}") from exc

    def build(self, name: str, **options: Any) -> T:
        cls = self.get(name)
        cfg = self.make_config(name, **options)
        return cls(cfg) if cfg is not None else cls()  # type: ignore[call-arg]


#: The option types checked before a config is built (a config coerces numeric text itself), and how an error
#: names them.
_TYPE_WORDS = {float: "a number", int: "an integer"}


def _scalar_type(cfg_cls: type, key: str) -> type | None:
    """The declared type of option ``key`` when it is one of ``_TYPE_WORDS`` (annotations are strings under
    ``from __future__ import annotations``), else ``None``: unchecked here, the config's own checks decide."""
    declared = {f.name: f.type for f in dataclasses.fields(cfg_cls)}.get(key)
    by_name = {t.__name__: t for t in _TYPE_WORDS}
    return by_name.get(declared) if isinstance(declared, str) else declared if declared in _TYPE_WORDS else None


def _int64(value: Any) -> int | None:
    """``value`` (a number or numeric text: ``7``, ``"7"``, ``1e3``) as an int when it is whole and fits a signed
    64-bit integer, else ``None``."""
    try:
        if isinstance(value, float) or not str(value).strip().lstrip("+-").isdigit():  # 1e3, 1.5, nan, inf
            value = float(value)
            if not value.is_integer():
                return None
        whole = int(value)
    except (ValueError, OverflowError):
        return None
    return whole if -(2**63) <= whole < 2**63 else None


def _is_number(value: Any) -> bool:
    """``value`` may stand for a number (int or float: the config rounds or refuses what is not whole): a number or
    numeric text, never a bool (``True`` is no density)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return False
        return True
    return isinstance(value, (int, float))
