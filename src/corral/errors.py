"""Corral's exception tree.

CorralError
├── ConfigError      the configuration file is invalid (lists every problem with its line)
├── TraceError       a simulator trace is invalid (lists every problem with its line)
└── UnknownScenario  no built-in scenario has that name
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Problem:
    """One problem in an input file: where it is and what to do about it."""

    source: str
    line: int | None
    where: str
    message: str

    def __str__(self) -> str:
        place = f"{self.source}:{self.line}" if self.line else self.source
        return (
            f"{place}: {self.where}: {self.message}" if self.where else f"{place}: {self.message}"
        )


class CorralError(Exception):
    """Root of every error Corral raises on purpose."""


class _ProblemsError(CorralError):
    def __init__(self, problems: list[Problem], title: str) -> None:
        self.problems = problems
        self.title = title
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"{self.title} ({len(self.problems)} problem{'s' * (len(self.problems) != 1)}):"]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


class ConfigError(_ProblemsError):
    """The configuration file is invalid."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(problems, "invalid configuration")


class TraceError(_ProblemsError):
    """A simulator trace is invalid."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__(problems, "invalid trace")


class UnknownScenario(CorralError):
    """No built-in scenario has that name."""
