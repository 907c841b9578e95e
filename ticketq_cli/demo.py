"""`ticketq demo`: the main job end to end on this machine.

Model (the configured one, or the full stand-in when no model hub is reachable) -> a real worker
process on the local Redis -> N synthetic tickets through the producer -> items/s, padding ratio,
time to the first result (against the mean forward pass: results stream out per forward batch, so
the first comes after about one), label counts and the metrics URL.

With `--fit N` (issue 43) a label head is fitted first (`ticketq fit`, in its own process) on N
synthetic labelled tickets of another seed than the ones then classified, and the worker serves it
(TICKETQ_HEAD); the report adds the accuracy on the classified tickets, none of which the fit saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from producer.api import Producer
from producer.synthetic import generate_tickets
from ticketq_bench.procs import WorkerProcess, free_port, model_info
from worker.settings import DEFAULT_MODEL, Settings

STANDIN_DIR = Path("models/qwen2.5-0.5b-standin")


def resolve_model(name: str, console: Console) -> str:
    """The model to serve: a local dir or a reachable hub id as given, else the full stand-in."""
    if Path(name).is_dir():
        return name
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return name
    except Exception:  # not a hub id, or no cache: decide by reachability below
        pass
    from worker.engine.loading import hub_reachable

    if hub_reachable():
        return name
    console.print(f"[yellow]No model hub reachable for {name!r}: using the full-size stand-in at {STANDIN_DIR} "
                  "(real Qwen2.5-0.5B architecture and tokenizer, random weights — labels are meaningless, "
                  "speed is real).[/]")  # fmt: skip
    if not (STANDIN_DIR / "config.json").is_file():
        from ticketq_cli.standin import build

        with console.status("building the stand-in (about 30 s)…"):
            build("full", STANDIN_DIR)
    return str(STANDIN_DIR)


FIT_SEED_OFFSET = 1000  # the fit's tickets: seed + this, never the classified ones


def fit_head(model: str, count: int, seed: int, console: Console) -> Path | None:
    """A head fitted on `count` synthetic labelled tickets (seed + FIT_SEED_OFFSET) by `ticketq fit`, or None."""
    from producer.synthetic import generate_tickets as labelled

    data, head = Path("ticketq-demo-fit.jsonl"), Path("ticketq-demo-head.safetensors")
    data.write_text("".join(json.dumps(t) + "\n" for t in labelled(count, seed=seed + FIT_SEED_OFFSET)))
    console.print(f"fitting a label head on {count} synthetic labelled tickets (seed {seed + FIT_SEED_OFFSET}; "
                  f"the demo then classifies seed {seed}, never seen by the fit)…", highlight=False)  # fmt: skip
    env = {**os.environ, "TICKETQ_MODEL": model}
    done = subprocess.run([sys.executable, "-m", "ticketq_cli.cli", "fit", str(data), "--out", str(head), "--force"],
                          env=env)  # fmt: skip
    return head if done.returncode == 0 else None


def run_demo(tickets: int, seed: int, console: Console, fit: int = 0) -> int:
    settings = Settings()
    try:
        from worker.app import preflight

        preflight(settings)
    except SystemExit as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    model = resolve_model(settings.model if settings.model else DEFAULT_MODEL, console)
    port = free_port(settings.metrics_port or 9808)
    queue = f"ticketq-demo-{os.getpid()}"
    env = {**os.environ, "TICKETQ_MODEL": model, "TICKETQ_QUEUE": queue, "TICKETQ_METRICS_PORT": str(port)}
    head = fit_head(model, fit, seed, console) if fit else None
    if fit and head is None:
        return 2
    env.update({"TICKETQ_HEAD": str(head)} if head else {})
    log_path = Path("ticketq-demo-worker.log")
    worker = WorkerProcess(env, log_path)
    try:
        with console.status(f"starting a worker with {model} (log: {log_path})…"):
            worker.wait_ready()
        producer = Producer(settings.model_copy(update={"queue": queue}))
        batch = generate_tickets(tickets, seed=seed)
        start, arrivals = time.perf_counter(), []  # arrivals[0]: when the first result came back
        sent = producer.submit_many(batch, progress=True)
        results = producer.wait(
            sent, timeout=3600, progress=True, on_result=lambda _: arrivals.append(time.perf_counter())
        )
        seconds = time.perf_counter() - start
        first = arrivals[0] - start if arrivals else None
        report(console, results, seconds, worker.metrics(), worker.metrics_url, model, first)
        if head is not None:
            report_head(console, results, batch)
        return 0 if all(r["status"] == "ok" for r in results) else 1
    finally:
        worker.stop()


def report(
    console: Console,
    results: list[dict],
    seconds: float,
    metrics: dict,
    url: str,
    model: str,
    first_result_s: float | None = None,
) -> None:
    """The demo's table; `first_result_s`: seconds from the first send to the first result back."""
    ok = [r for r in results if r["status"] == "ok"]
    padded = metrics.get("ticketq_tokens_padded_total{}", 0.0)
    computed = metrics.get("ticketq_tokens_computed_total{}", 0.0)
    batches = metrics.get("ticketq_batch_size_count{}", 0.0)
    forward_s = metrics.get("ticketq_forward_seconds_sum{}", 0.0) / batches if batches else None
    ran = model_info(metrics)  # what TICKETQ_DTYPE=auto (and TICKETQ_MATMUL=auto) chose, and where
    kernels = " (oneDNN GEMMs)" if ran.get("matmul") == "onednn" and ran.get("dtype") == "float32" else ""
    where = f" on {ran.get('device', '?')}/{ran.get('dtype', '?')}{kernels}" if ran else ""
    table = Table(title=f"ticketq demo — {model}{where}", show_header=False)  # one row per figure: fits 80 columns
    table.add_column(style="bold")
    table.add_column()
    labels = Counter(r["label"] for r in ok)
    table.add_row("tickets", f"{len(results)} ({len(ok)} ok, {len(results) - len(ok)} failed)")
    table.add_row("items/s", f"{len(results) / seconds:.2f} (first send to last result)")
    table.add_row("padding", f"{padded / computed:.1%}" if computed else "-")
    table.add_row("forward batches", f"{batches:.0f} (mean {len(ok) / batches:.1f} tickets, {forward_s:.2f} s)"
                  if batches else "-")  # fmt: skip
    table.add_row("first result", _first(first_result_s, forward_s))
    table.add_row("precision", _precision(ran, ok))
    table.add_row("labels", ", ".join(f"{k}={v}" for k, v in labels.most_common()))
    console.print(table)
    if ok and ok[0].get("standin"):
        console.print("[yellow]stand-in model: labels are meaningless; speed is real[/]")
    console.print(f"metrics were served at {url} (the demo worker has now stopped; `ticketq worker` keeps one up)")


def report_head(console: Console, results: list[dict], batch: list[dict]) -> None:
    """What the head's accuracy on the classified tickets means, honestly."""
    expected = {t["id"]: t["expected"] for t in batch}
    ok = [r for r in results if r["status"] == "ok"]
    right = sum(r["label"] == expected.get(r["id"]) for r in ok)
    console.print(f"label head {ok[0]['scorer'] if ok else '?'}: {right} of {len(ok)} classified tickets right "
                  f"({right / max(len(ok), 1):.1%}; chance is {1 / max(len(set(expected.values())), 1):.0%})",
                  highlight=False)  # fmt: skip
    if ok and ok[0].get("standin"):
        console.print("[yellow]stand-in model: its weights are random, so zero-shot labels are chance; the head "
                      "learned the synthetic tickets' vocabulary from the random model's features. A real "
                      "model and your own labelled tickets are what make this figure mean something "
                      "(docs/learning.md).[/]")  # fmt: skip


def _precision(ran: dict[str, str], ok: list[dict]) -> str:
    """What answered: the precision TICKETQ_DTYPE=auto chose and, re-checked, the share computed again."""
    dtype = ran.get("dtype", "?")
    if ran.get("recheck") != "true":
        return dtype + (" (exact)" if dtype == "float32" else " (unchecked: labels may differ from float32's)")
    again = sum(bool(r.get("rechecked")) for r in ok)
    share = f" ({again / len(ok):.1%})" if ok else ""
    return f"{dtype}, re-checked in float32: {again} of {len(ok)} tickets computed again{share}; labels are float32's"


def _first(first_result_s: float | None, forward_s: float | None) -> str:
    if first_result_s is None:
        return "-"
    if not forward_s:
        return f"{first_result_s:.2f} s"
    return f"{first_result_s:.2f} s after the first send (a forward pass: {forward_s:.2f} s on average)"
