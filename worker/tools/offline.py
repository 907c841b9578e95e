"""Classify a ticket file in-process, no Redis: the article's own use case (a backlog, one machine).

Every input row ends as exactly one result row, in file order, with its `source` (`file:line`):
`ok` with a label, or `failed` with a reason: the file reader applies the ticket contract
(`ticketq.contract`, TICKETQ_MAX_TICKET_BYTES included) exactly as the queue path does, so a row is
refused or classified here as it would be there.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from tqdm import tqdm

from producer.tickets import TicketFile
from worker.engine.prompt import InvalidTicket
from worker.results import BatchReport, padding_ratio


@dataclass
class Summary:
    rows: list[dict] = field(default_factory=list)  # one per input row, in file order
    seconds: float = 0.0
    reports: list[BatchReport] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return sum(row["status"] == "ok" for row in self.rows)

    @property
    def failed(self) -> int:
        return len(self.rows) - self.ok

    @property
    def labels(self) -> Counter:
        return Counter(row["label"] for row in self.rows if row["status"] == "ok")

    @property
    def items_per_s(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    @property
    def padding_ratio(self) -> float:
        return padding_ratio(self.reports)


def classify_file(engine, source: TicketFile, progress: bool = True) -> Summary:
    """Classify every good ticket of `source`; bad rows and refused tickets become failed rows."""
    encoded, good, results = [], [], []
    for ticket in source.tickets:
        try:
            encoded.append(engine.prompt.encode(ticket["text"]))
            good.append(ticket)
        except InvalidTicket as exc:
            results.append({"id": ticket["id"], "status": "failed", "reason": exc.reason, "error": exc.detail})
    summary = Summary()
    bar = tqdm(total=len(good), unit="ticket", desc="classifying", disable=not progress)
    start = time.perf_counter()
    predictions, summary.reports = engine.classify_encoded(encoded, on_batch=lambda r: bar.update(r.rows))
    summary.seconds = time.perf_counter() - start
    bar.close()
    for ticket, prediction in zip(good, predictions, strict=True):
        results.append({
            "id": ticket["id"],
            "status": "ok",
            "label": prediction.label,
            "probs": prediction.probs,
            "margin": prediction.margin,
            "truncated": prediction.truncated,
            "model": engine.info.name,
            "standin": engine.info.standin,
        })  # fmt: skip
    summary.rows = source.results_in_order(results)
    return summary
