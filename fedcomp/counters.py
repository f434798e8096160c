"""Counters that add up: one merge for every stats dataclass (the server's per-version counters, the downlink's).

A ``Counters`` dataclass has int/float fields and dicts of numbers; ``merge`` adds another instance field by field
(dicts key by key) and ``roll`` hands back the counts so far and starts again from zero.

>>> from dataclasses import dataclass, field
>>> @dataclass
... class Sent(Counters):
...     messages: int = 0
...     by_kind: dict[str, int] = field(default_factory=dict)
>>> a = Sent(1, {"full": 1})
>>> a.merge(Sent(2, {"full": 1, "delta": 1}))
>>> a
Sent(messages=3, by_kind={'full': 2, 'delta': 1})
>>> a.roll(), a
(Sent(messages=3, by_kind={'full': 2, 'delta': 1}), Sent(messages=0, by_kind={}))
"""

from __future__ import annotations

import copy
from dataclasses import fields
from typing import Any, TypeVar

C = TypeVar("C", bound="Counters")

__all__ = ["Counters"]


class Counters:
    """Mixin for dataclasses of counters (numbers, and dicts of numbers)."""

    def merge(self: C, other: C) -> None:
        """Add ``other``'s counts to these."""
        for f in fields(self):  # type: ignore[arg-type]
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
            else:
                setattr(self, f.name, mine + theirs)

    def roll(self: C) -> C:
        """The counts so far (a copy); these start again from zero."""
        done = copy.deepcopy(self)
        fresh: Any = type(self)()
        for f in fields(self):  # type: ignore[arg-type]
            setattr(self, f.name, getattr(fresh, f.name))
        return done
