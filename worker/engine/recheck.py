"""Answers in the fastest precision, labels checked in float32 (TICKETQ_RECHECK).

A runner (`model.Engine`, or a schema's `fields.FieldsEngine`) computing in a fast precision
(bfloat16, int8) gets a float32 twin on the same model (`exact`) and an `ErrorBound`
(`precision`): each answer whose smallest decision gap is within the bound comes back from the
fast runner as `scheduler.Unsettled`, and the scheduler batches those tickets for the twin
(`Recheck`, a deferred engine). The twin's answer is the ticket's, marked `rechecked`; the
difference between the two answers is one more measurement of the fast precision's error, and
one larger than any before widens the bound at once.

The bound is measured at the runner's first start on a machine (`precision.calibrate`: the
calibration tickets in both precisions) and cached per machine, model, prompt and precision
(`~/.cache/ticketq/precision`, or under $XDG_CACHE_HOME); delete the file to measure it again.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from ticketq.schema import Field
from worker.engine.kernels import cache_dir, cache_key_digest, cpu_flags, cpu_model
from worker.engine.precision import (
    ErrorBound,
    calibrate,
    decision_error,
    expected_gain,
    load_calibration,
    save_bound,
)
from worker.engine.prompt import EncodedTicket
from worker.engine.scheduler import Unsettled

log = logging.getLogger(__name__)


# The calibration must predict re-checked answers at least this much faster than float32's for a
# fast precision to be served at all (the re-checks' batching and the float32 copy cost something).
MIN_GAIN = 1.1
# Served, the re-check share is judged again every LIVE_WINDOW answers: past the break-even share
# (re-checked answers no faster than float32's) the runner answers in float32 until it restarts.
LIVE_WINDOW = 500


class Recheck:
    """A fast runner's float32 twin as the scheduler runs it: deferred, its answers settling the fast ones."""

    deferred = True  # the scheduler batches its tickets rather than running each re-check at once

    def __init__(self, exact: Any, bound: ErrorBound, fields: Mapping[str, Field] | None = None,
                 judged: bool = True) -> None:  # fmt: skip
        self.exact = exact  # the float32 runner (an Engine or a FieldsEngine on the float32 model)
        self.bound = bound
        self.fields = fields or {}  # a schema's fields: their select and review thresholds decide too
        self.judged = judged  # False: kept whatever the share (TICKETQ_RECHECK=always, the bench)
        self.pays = True  # False once a window's re-check share made the fast precision slower than float32
        self._window = [0, 0]  # answers screened, unsettled among them, since the last judgement

    @property
    def max_batch_tokens(self) -> int:
        host = getattr(self.exact, "engine", self.exact)  # a FieldsEngine plans with its engine's budget
        return host.max_batch_tokens

    def encode(self, texts: Sequence[object]) -> list[EncodedTicket]:
        return self.exact.encode(texts)

    def plan(self, encoded: Sequence[EncodedTicket]):
        return self.exact.plan(encoded)

    def forward_batch(self, tickets: Sequence[EncodedTicket], width: int | None = None) -> list:
        return self.exact.forward_batch(tickets, width)

    def screen(self, answers: list) -> list:
        """The fast runner's answers, each within the bound wrapped as `Unsettled` for this twin."""
        screened = [Unsettled(a, self) if self.bound.unsettled(a, self.fields) else a for a in answers]
        self._judge(len(answers), sum(isinstance(a, Unsettled) for a in screened))
        return screened

    def settle(self, fast: Any, exact: Any) -> Any:
        """The ticket's answer: float32's, marked re-checked; their difference is measured."""
        self.bound.observe(decision_error(fast, exact), "re-check")
        return replace(exact, rechecked=True)

    def _judge(self, answered: int, unsettled: int) -> None:
        """Every LIVE_WINDOW answers: stop paying for a fast precision whose re-checks cost more than it saves."""
        self._window[0] += answered
        self._window[1] += unsettled
        if not self.judged or self._window[0] < LIVE_WINDOW:
            return
        share, self._window = self._window[1] / self._window[0], [0, 0]
        gain = expected_gain(self.bound.speed, share)
        if gain < 1.0:
            self.pays = False
            log.warning("%s: %.0f%% of the last %d answers were re-checked in float32 (%.2fx float32's speed "
                        "predicted): answering in float32 from now on, until the worker restarts",
                        self.bound.precision, 100 * share, LIVE_WINDOW, gain)  # fmt: skip


def attach_recheck(fast: Any, exact: Any, precision: str, prompt_ids: Sequence[int], fields: Mapping[str, Field],
                   force: bool = False, schema: str = "") -> Recheck | None:  # fmt: skip
    """Give `fast` (a runner in `precision`) its float32 twin `exact` and a measured error bound:
    this machine's cached calibration, else `calibrate` now. None (and `fast` left unchecked) where
    the calibration predicts the re-checked precision under MIN_GAIN x float32's speed, unless `force`
    (the bench shows what it would do). `fast` must not be re-checked yet; `schema` names its schema in the log."""
    path = cache_dir("precision") / f"{precision}-{cache_key_digest(_key(fast, precision, prompt_ids, fields))}.json"
    calibration = load_calibration(path)
    if calibration is not None:
        log.info("%s error bound: the largest error over %d tickets was %.3g, cached in %s (delete it to measure "
                 "again)", precision, calibration.samples, calibration.measured, path)  # fmt: skip
    fresh = calibration is None
    if fresh:
        calibration = calibrate(precision, lambda texts: fast.classify(texts)[0],
                                lambda texts: exact.classify(texts)[0], fields,
                                label=f"schema {schema}" if schema else "")  # fmt: skip
    bound = ErrorBound(precision, calibration.measured, calibration.samples, path, speed=calibration.speed,
                       share=calibration.share)  # fmt: skip
    if fresh:  # a cached one is already on disk; a widening saves itself
        save_bound(path, bound)
    if calibration.gain < MIN_GAIN and not force:
        log.warning("%s re-checked in float32 would run %.2fx float32's speed here (%s %.2fx float32's, %.0f%% of the "
                    "calibration tickets within its bound, needs %.2fx): answering in float32", precision,
                    calibration.gain, precision, calibration.speed, 100 * calibration.share, MIN_GAIN)  # fmt: skip
        return None
    fast.recheck = Recheck(exact, bound, fields, judged=not force)
    log.info("%s answers with a decision gap under %.3g are re-checked in float32", precision, bound.bound)
    return fast.recheck


def _key(fast: Any, precision: str, prompt_ids: Sequence[int], fields: Mapping[str, Field]) -> list:
    """What the calibration depends on: the machine, torch, the model's weights, the prompt, the
    precision, the thresholds that decide with the labels (the share within the bound), and the scorer
    (issue 43: a label head, TICKETQ_HEAD, has its own bound)."""
    host = getattr(fast, "engine", fast)
    head = host.model.get_output_embeddings().weight
    # a checksum: the head's first rows and the decoder's dense vectors (its norms' weights, biases),
    # found by shape whatever a family names them (Llama's `norm`, GPT-2's `ln_f`); packed weights are opaque
    vectors = [p for p in host.model.get_decoder().parameters() if p.dim() == 1 and p.layout == torch.strided]
    weights = [float(head[:64].detach().double().sum()), sum(float(p.detach().double().sum()) for p in vectors)]
    return [cpu_model(), sorted(cpu_flags()), platform.machine(), torch.__version__, torch.get_num_threads(),
            getattr(host.model, "name_or_path", "?"), weights, precision, getattr(host.info, "matmul", ""),
            list(prompt_ids), sorted((name, f.select, f.threshold) for name, f in fields.items()),
            getattr(host.info, "scorer", "zero-shot")]  # fmt: skip
