"""Exit statuses of both command-line programs (`ticketq`, `ticketq-produce`) and of the worker.

One table, read by the producer's CLI, the operator's CLI and the worker's start-up refusal
alike (README, "Exit statuses"). No imports: the worker's runtime reads it without the CLI.
"""

from __future__ import annotations

EXIT_OK = 0  # every row or ticket classified
EXIT_FAILED = 1  # some rows or tickets failed (each one is reported)
EXIT_USAGE = 2  # bad settings or options, unreadable input, Redis unreachable: nothing was done
EXIT_NOTHING = 3  # the input was read, but not one ticket was classified; a lookup found nothing
EXIT_NO_WORKER = 4  # `ticketq status`: Redis answered, no worker did (or none could be asked)


def exit_status(ok: int, failed: int) -> int:
    """The status of a run that classified `ok` tickets and failed `failed`."""
    if failed == 0 and ok:
        return EXIT_OK
    return EXIT_FAILED if ok else EXIT_NOTHING
