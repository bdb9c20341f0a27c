"""Tools for tests/test_envs.py (env.tools=tool_fixtures): every public function defined here is a tool."""

from __future__ import annotations

from math import sqrt  # noqa: F401  (imported, not defined here: not a tool)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def _helper() -> None:
    """Private: not a tool."""
