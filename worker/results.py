"""Plain records shared by the engine, the service and the offline CLI (no torch here)."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Prediction:
    label: str
    probs: dict[str, float]
    margin: float  # probability of the best label minus the runner-up's
    truncated: bool
    tokens: int  # ticket tokens after truncation
    precision: str = "float32"  # the arithmetic that answered: float32, bfloat16, float16 or int8
    rechecked: bool = False  # answered in float32 after the fast precision's answer fell within its error bound
    scorer: str = "zero-shot"  # who scored the labels: the LM head's label rows, or a fitted head ("head:<digest>")


class PaddedTokens:
    """Padding arithmetic for a planned or measured forward (or a sum of them).

    Subclasses provide `computed_tokens` (rows x padded width) and `real_tokens`.
    """

    computed_tokens: int
    real_tokens: int

    @property
    def pad_tokens(self) -> int:
        return self.computed_tokens - self.real_tokens

    @property
    def padding_ratio(self) -> float:
        return self.pad_tokens / self.computed_tokens if self.computed_tokens else 0.0


@dataclass(frozen=True)
class BatchReport(PaddedTokens):
    """What one forward pass computed: `rows` tickets right-padded to `width` tokens."""

    rows: int
    width: int
    real_tokens: int
    seconds: float
    recheck: bool = False  # a float32 forward over tickets the fast precision could not settle
    straight: bool = False  # a float32 forward over tickets a fast precision's policy sent straight to it

    @property
    def computed_tokens(self) -> int:
        return self.rows * self.width


def padding_ratio(reports: list[BatchReport]) -> float:
    computed = sum(r.computed_tokens for r in reports)
    return sum(r.pad_tokens for r in reports) / computed if computed else 0.0


class RunTally:
    """One worker's counts of what its runs saved or spent on exactness (built by its runtime, handed to
    each run), read by the metrics at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.deduplicated = 0  # tickets answered with an identical ticket's answer in the same run, not computed
        self.rechecked = 0  # tickets a fast precision could not settle, computed again in float32

    def add(self, deduplicated: int = 0, rechecked: int = 0) -> None:
        with self._lock:
            self.deduplicated += deduplicated
            self.rechecked += rechecked

