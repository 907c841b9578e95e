"""`python -m ticketq_bench ARGS` is `ticketq bench ARGS`."""

from ticketq_bench.cli import main

raise SystemExit(main())
