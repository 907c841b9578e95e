"""The one base class of every error ticketq raises.

`except TicketqError` catches what this project raises, and nothing a library raised on its own.
Each error keeps its builtin base too (`TicketRejected` is a `ValueError`, `RedisUnavailable` a
`ConnectionError`), so callers that catch those still do. Two exceptions stand outside on
purpose, because they are not errors: `producer.errors.SendInterrupted` is a `KeyboardInterrupt`
(Ctrl-C) and `worker.app.CannotStart` a `SystemExit`; deriving them from an `Exception` would let
every `except Exception` swallow a Ctrl-C or an exit.
"""

from __future__ import annotations


class TicketqError(Exception):
    """Base of ticketq's errors; `repr()` is the class and the one-line message, `str()` unchanged."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"
