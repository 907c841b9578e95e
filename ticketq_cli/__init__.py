"""The `ticketq` command and the operator's tools, outside the worker package: the worker's runtime
imports none of them (`tests/test_layers.py` checks it in a fresh interpreter).

- `cli`       the typer app: worker, demo, classify, eval, bench, loadtest, standin, config, status,
              dead letters, results, exporter, docgen; each command imports its module when it runs.
- `demo`      `ticketq demo`: a worker, synthetic tickets through it, the results summarised.
- `offline`   `ticketq classify`: a ticket file classified in this process, no queue.
- `evaluate`  `ticketq eval`: a labelled file scored against the model.
- `ops`       the operator commands: status, dead letters (list, requeue), results.
- `exporter`  `ticketq exporter`: the backlog exporter (queue depth, streams) for Prometheus.
- `standin`   `ticketq standin`: the stand-in model builder.
- `docgen`    docs/settings.md and docs/metrics.md from the code.

The benchmark and the load test are `ticketq_bench`, below this package.
"""
