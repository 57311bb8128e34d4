"""One small error hierarchy. Every message says what to do next.

``transient`` errors may succeed when retried (a commit race, a flaky store);
terminal ones will not (bad input, a corrupt file, a conflict).
"""

from __future__ import annotations


class PipelineError(Exception):
    """Base class. ``hint`` tells the user how to fix it."""

    transient: bool = False
    exit_code: int = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # pragma: no cover - formatting
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class ConfigError(PipelineError):
    """A config file, key or value is wrong."""


class InputFileError(PipelineError):
    """An input file cannot be read at all (missing, corrupt, unknown format)."""


class ConflictError(PipelineError):
    """The same key already exists with different content."""


class NotFoundError(PipelineError):
    """A table, snapshot, checkpoint or version does not exist."""


class IntegrityError(PipelineError):
    """Stored bytes do not match their recorded hash (corruption or tampering)."""


class CommitError(PipelineError):
    """A Delta commit could not be made after every retry."""

    transient = True


class MissingExtraError(PipelineError):
    """An optional dependency is not installed."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(
            f"{module} is not installed",
            hint=f"pip install 'trajectory-lakehouse[{extra}]' (see README, Setup)",
        )


class StaleSnapshotError(PipelineError):
    """A snapshot's data is too many policy versions behind the policy it would update."""
