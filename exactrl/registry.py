"""Name -> function tables (advantage estimators, policy losses), as in verl's core_algos."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(dict[str, F], Generic[F]):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            self[name] = fn
            return fn

        return add

    def lookup(self, name: str) -> F:
        if name not in self:
            raise ValueError(f"unknown {self.kind} '{name}'; choose one of {', '.join(sorted(self))}")
        return self[name]
