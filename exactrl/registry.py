"""Name -> entry tables (advantage estimators, policy losses, algorithms), as in verl's core_algos."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F")


class Registry(dict[str, F], Generic[F]):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[F], F]:
        def add(entry: F) -> F:
            self.add(name, entry)
            return entry

        return add

    def add(self, name: str, entry: F) -> None:
        if name in self:  # two entries under one name: the second would silently win
            raise ValueError(f"{self.kind} '{name}' is registered twice")
        self[name] = entry

    def lookup(self, name: str) -> F:
        if name not in self:
            raise ValueError(f"unknown {self.kind} '{name}'; choose one of {', '.join(sorted(self))}")
        return self[name]
