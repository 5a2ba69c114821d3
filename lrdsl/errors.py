"""Errors a user can cause: a bad spec (with its place) or bad tensors. Never a traceback."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A place in a spec: 1-based line and column of the first character, and of the end."""
    line: int
    column: int
    end_line: int = 0
    end_column: int = 0

    def __str__(self) -> str:
        return f"{self.line}:{self.column}"


class LrdslError(Exception):
    """Base class of every error lrdsl raises on purpose."""


class SpecError(LrdslError):
    """A mistake in a spec. `str()` is one line: `file:line:col: message`; `context()` adds a caret."""

    def __init__(self, message: str, span: Span | None = None, source: str | None = None,
                 filename: str = "<spec>"):
        self.message = message
        self.span = span
        self.source = source
        self.filename = filename
        super().__init__(str(self))

    def located(self, source: str, filename: str) -> "SpecError":
        return SpecError(self.message, self.span, self.source or source,
                         filename if self.filename == "<spec>" else self.filename)

    def __str__(self) -> str:
        where = f"{self.filename}:{self.span}" if self.span else self.filename
        return f"{where}: error: {self.message}"

    def context(self) -> str:
        """The offending source line with a caret under the column (lark's get_context style)."""
        if not (self.span and self.source):
            return ""
        lines = self.source.splitlines()
        if not 1 <= self.span.line <= len(lines):
            return ""
        text = lines[self.span.line - 1].expandtabs(1)
        if len(text) > 120:
            start = max(0, self.span.column - 60)
            text, col = text[start:start + 120], self.span.column - start
        else:
            col = self.span.column
        width = 1
        if self.span.end_line == self.span.line and self.span.end_column > self.span.column:
            width = min(self.span.end_column - self.span.column, max(1, len(text) - col + 1))
        return f"  {text}\n  {' ' * (col - 1)}{'^' * width}"


class InputError(LrdslError, ValueError):
    """Tensors handed to a mixer do not match its spec (name, shape, dtype, device)."""
