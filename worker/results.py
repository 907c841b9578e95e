"""Plain records shared by the engine, the service and the offline CLI (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prediction:
    label: str
    probs: dict[str, float]
    margin: float  # probability of the best label minus the runner-up's
    truncated: bool
    tokens: int  # ticket tokens after truncation


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

    @property
    def computed_tokens(self) -> int:
        return self.rows * self.width


def padding_ratio(reports: list[BatchReport]) -> float:
    computed = sum(r.computed_tokens for r in reports)
    return sum(r.pad_tokens for r in reports) / computed if computed else 0.0
