"""`python -m ticketq_cli ARGS` is `ticketq ARGS`."""

from ticketq_cli.cli import main

main()
