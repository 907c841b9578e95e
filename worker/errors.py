"""The worker process's own errors above the engine and the transport (those keep theirs, in their
layer): a classifier that cannot be built, a worker that cannot start."""

from __future__ import annotations

from ticketq.errors import TicketqError
from ticketq.exits import EXIT_USAGE


class ModelNotReady(TicketqError, RuntimeError):
    """The engine could not be built (model missing, bad settings)."""

class CannotStart(SystemExit):
    """The worker cannot start for a reason its operator must fix (Redis unreachable or refusing us,
    an evicting memory policy, a model that does not load): exit status 2, as for bad settings,
    with `str()` the one line that says what to do."""

    def __init__(self, message: str, logged: bool = False) -> None:
        super().__init__(EXIT_USAGE)
        self.message, self.logged = message, logged

    def __str__(self) -> str:
        return self.message
