"""Classify a ticket file in-process, no Redis: the article's own use case (a backlog, one machine)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from producer.tickets import read_tickets, write_results
from worker.prompt import InvalidTicket
from worker.results import BatchReport, padding_ratio


@dataclass
class Summary:
    tickets: int = 0
    failed: int = 0
    seconds: float = 0.0
    reports: list[BatchReport] = field(default_factory=list)
    labels: Counter = field(default_factory=Counter)

    @property
    def items_per_s(self) -> float:
        return self.tickets / self.seconds if self.seconds else 0.0

    @property
    def padding_ratio(self) -> float:
        return padding_ratio(self.reports)


def classify_file(engine, path: Path, out: Path, progress: bool = True) -> tuple[Summary, list[str]]:
    """Classify every good row of `path` into `out` (JSONL); bad rows become failed results."""
    source = read_tickets(path)
    errors = [str(error) for error in source.errors]
    encoded, good, results = [], [], {}
    for ticket in source.tickets:
        try:
            encoded.append(engine.prompt.encode(ticket["text"]))
            good.append(ticket)
        except InvalidTicket as exc:
            results[ticket["id"]] = {"id": ticket["id"], "status": "failed", "reason": "empty_text", "error": str(exc)}
            errors.append(f"{path}: ticket {ticket['id']}: {exc}")
    summary = Summary(tickets=len(good), failed=len(results) + len(source.errors))
    bar = tqdm(total=len(good), unit="ticket", desc="classifying", disable=not progress)
    start = time.perf_counter()
    predictions, summary.reports = engine.classify_encoded(encoded, on_batch=lambda r: bar.update(r.rows))
    summary.seconds = time.perf_counter() - start
    bar.close()
    for ticket, prediction in zip(good, predictions, strict=True):
        summary.labels[prediction.label] += 1
        results[ticket["id"]] = {
            "id": ticket["id"],
            "status": "ok",
            "label": prediction.label,
            "probs": prediction.probs,
            "margin": prediction.margin,
            "truncated": prediction.truncated,
            "model": engine.info.name,
            "standin": engine.info.standin,
        }
    ordered = [results[t["id"]] for t in source.tickets if t["id"] in results]
    write_results(out, ordered)
    return summary, errors
