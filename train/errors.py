"""The train package's user errors: one line `<object>: <expected>, <found>; <fix>` (core.errors.UserError)."""
from __future__ import annotations

from core.errors import UsageError, UserError


class TrainError(UserError):
    """Bad training input; the message is one line `<object>: <expected>, <found>; <fix>`."""


class TrainUsageError(TrainError, UsageError):
    """A setting no input makes right, or two that cannot go together: a wrong command line (exit 2)."""
