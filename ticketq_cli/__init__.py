"""The `ticketq` command and the operator's tools, outside the worker package: the worker's runtime
imports none of them (`tests/integration/test_runtime_imports.py` checks it in a fresh interpreter).

- `cli`       the `ticketq` command: every subcommand registered in the order `--help` lists them;
              worker, standin, demo, config, schema check, and bench and loadtest (`ticketq_bench`).
- `common`    the typer app and what every command shares: the console, settings or one line per
              bad one, failing with an exit status, the model check, logging.
- `classify_commands`  `ticketq classify` and `ticketq eval`: options, progress and what they print.
- `ops_commands`       `ticketq status`, `dead list|show|requeue`, `result`, `exporter`.
- `demo`      `ticketq demo`: a worker, synthetic tickets through it, the results summarised.
- `offline`   `ticketq classify`: a ticket file classified in this process, no queue.
- `evaluate`  `ticketq eval`: a labelled file scored against the model.
- `ops`       the operator commands: status, dead letters (list, requeue), results.
- `exporter`  `ticketq exporter`: the backlog exporter (queue depth, streams) for Prometheus.
- `standin`   `ticketq standin`: the stand-in model builder.
- `docgen`    docs/settings.md and docs/metrics.md from the code.

The benchmark and the load test are `ticketq_bench`, below this package.
"""
