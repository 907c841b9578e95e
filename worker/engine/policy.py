"""The precision policy: which runner computes a ticket first, and which answers are computed again.

A runner (`model.Engine`, a schema's `fields.FieldsEngine`) computes in its one precision and
only computes. Its `policy` is what the scheduler (`scheduler.PlannedRun`) consults:

- `route(encoded)`, when a ticket joins a run: the runner that computes it first;
- `screen(runner, answers)`, after that runner's forward: the answers it cannot settle come back
  `Unsettled`, for `recheck` (the float32 twin, a deferred engine) to compute again;
- `reference(text)`: the unbatched answer its answers are held to (float32's).

`scheduler.Exact` is a float32 runner's policy, and an unchecked fast one's: itself, every answer settled.
`Checked` is a fast precision's (bfloat16, int8, TICKETQ_RECHECK): its float32 twin `exact` and an
`ErrorBound` (`precision`). An answer whose decision gap is within the bound at its ticket's length
is computed again by the twin, and the twin's answer is the ticket's, marked `rechecked`; the two
answers' difference is one more measurement that may widen the bound. A ticket goes straight to
the twin where computing it fast first would likely be wasted:

- every ticket, once a window of LIVE_WINDOW answers predicted the re-checked precision slower
  than float32 alone (`pays`), until the worker restarts;
- a ticket whose length bucket (its token count's power of two) re-checked more than the
  break-even share 1 - 1/speed of the fast answers it had (`LengthRoute`): on average it costs
  less computed once in float32. One in PROBE_EVERY of such a bucket's tickets still goes fast,
  so its share goes on being measured. Cost: a dict update per answer; worst case: a bucket wrongly
  sent straight runs at float32's speed, never less exact, and 1/PROBE_EVERY of it is computed twice.

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
from worker.engine.fused import ARITHMETIC
from worker.engine.precision import (
    CALIBRATION_SIZE,
    ERROR_MEASURE,
    SAFETY,
    TAIL_CHANCE,
    ErrorBound,
    calibrate,
    decision_error,
    load_calibration,
    save_bound,
)
from worker.engine.probes import cache_dir, cache_key_digest, cpu_flags, cpu_model
from worker.engine.prompt import EncodedTicket
from worker.engine.scheduler import Unsettled

log = logging.getLogger(__name__)


# The calibration must predict re-checked answers at least this much faster than float32's for a
# fast precision to be served at all (the re-checks' batching and the float32 copy cost something).
MIN_GAIN = 1.1
# Served, the re-check share is judged again every LIVE_WINDOW answers: past the break-even share
# (re-checked answers no faster than float32's) the runner answers in float32 until it restarts.
LIVE_WINDOW = 500
# A length bucket is judged once it has this many fast answers; its counts are halved past
# BUCKET_WINDOW so it follows the traffic; one in PROBE_EVERY of a straight bucket's tickets goes fast.
MIN_SEEN, BUCKET_WINDOW, PROBE_EVERY = 16, 256, 16


class LengthRoute:
    """Which tickets go straight to float32, by length bucket: those whose bucket re-checked more than
    `break_even` of its fast answers (counts decayed by halving, probed one in PROBE_EVERY)."""

    def __init__(self, break_even: float) -> None:
        self.break_even = break_even
        self._counts: dict[int, list[int]] = {}  # bucket -> [fast answers, unsettled among them]
        self._sent: dict[int, int] = {}  # bucket -> tickets routed while it is straight (the probe's clock)

    def straight(self, tokens: int) -> bool:
        bucket = max(tokens, 1).bit_length()
        seen, unsettled = self._counts.get(bucket, (0, 0))
        if seen < MIN_SEEN or unsettled <= self.break_even * seen:
            return False
        self._sent[bucket] = self._sent.get(bucket, 0) + 1
        return self._sent[bucket] % PROBE_EVERY != 0

    def observe(self, tokens: int, unsettled: bool) -> None:
        counts = self._counts.setdefault(max(tokens, 1).bit_length(), [0, 0])
        counts[0] += 1
        counts[1] += unsettled
        if counts[0] >= BUCKET_WINDOW:
            counts[0], counts[1] = counts[0] // 2, counts[1] // 2


class Checked:
    """A fast runner held to its float32 twin: routes, screens and settles its tickets (see the module)."""

    checked = True

    def __init__(self, fast: Any, exact: Any, bound: ErrorBound, fields: Mapping[str, Field] | None = None,
                 judged: bool = True) -> None:  # fmt: skip
        self.fast, self.exact, self.bound = fast, exact, bound
        self.fields = fields or {}  # a schema's fields: their select and review thresholds decide too
        self.judged = judged  # False: kept whatever the share (TICKETQ_RECHECK=always, the bench)
        self.pays = True  # False once a window predicted the re-checked precision slower than float32
        self.lengths = LengthRoute(1.0 - 1.0 / bound.speed if bound.speed > 0 else 0.0)
        self.recheck = Recheck(self)
        self._window = [0, 0, 0]  # since the last judgement: fast answers, unsettled among them, straight

    def route(self, encoded: EncodedTicket) -> Any:
        """The runner that computes `encoded` first: the twin where the fast answer would likely be wasted."""
        if not self.pays or self.lengths.straight(len(encoded.ids)):
            self._window[2] += 1
            return self.exact
        return self.fast

    def screen(self, runner: Any, answers: list) -> list:
        """`runner`'s answers, each fast one within the bound at its length wrapped `Unsettled`."""
        if runner is not self.fast:
            return answers
        screened = []
        for answer in answers:
            unsettled = self.bound.unsettled(answer, self.fields)
            self.lengths.observe(answer.tokens, unsettled)
            screened.append(Unsettled(answer, self.recheck) if unsettled else answer)
        self._judge(len(answers), sum(isinstance(a, Unsettled) for a in screened))
        return screened

    def settle(self, fast: Any, exact: Any) -> Any:
        """The ticket's answer: float32's, marked re-checked; their difference is measured."""
        self.observe(fast, exact, "re-check")
        return replace(exact, rechecked=True)

    def observe(self, fast: Any, exact: Any, source: str) -> None:
        """A fast answer against float32's for the same ticket (a re-check, a live shadow check): their
        error on the decisions this runner's fields make may widen the bound."""
        self.bound.observe(decision_error(fast, exact, self.fields), source, fast.tokens)

    def reference(self, text: object) -> Any:
        return self.exact.reference(text)

    def _judge(self, answered: int, unsettled: int) -> None:
        """Every LIVE_WINDOW answers: stop paying for a fast precision whose re-checks cost more than it saves."""
        window = self._window
        window[0] += answered
        window[1] += unsettled
        total = window[0] + window[2]
        if not self.judged or total < LIVE_WINDOW:
            return
        straight, fast, self._window = window[2] / total, window[0] / total, [0, 0, 0]
        # float32's cost per ticket is 1: a straight ticket costs 1, a fast one 1/speed + its re-check share
        speed = self.bound.speed
        gain = 1.0 / (straight + fast * (1.0 / speed + window[1] / max(window[0], 1))) if speed > 0 else 0.0
        if gain < 1.0:
            self.pays = False
            log.warning("%s: of the last %d tickets %.0f%% were re-checked in float32 and %.0f%% sent straight to it "
                        "(%.2fx float32's speed predicted): answering in float32 from now on, until the worker "
                        "restarts", self.bound.precision, total, 100 * window[1] / total, 100 * straight,
                        gain)  # fmt: skip


class Recheck:
    """A checked runner's float32 twin as the scheduler runs it: deferred, each answer settling a fast one."""

    deferred = True  # the scheduler batches its tickets rather than running each re-check at once

    def __init__(self, policy: Checked) -> None:
        self.policy = policy

    @property
    def max_batch_tokens(self) -> int:
        exact = self.policy.exact
        return getattr(exact, "engine", exact).max_batch_tokens  # a FieldsEngine plans with its engine's budget

    def encode(self, texts: Sequence[object]) -> list[EncodedTicket]:
        return self.policy.exact.encode(texts)

    def plan(self, encoded: Sequence[EncodedTicket]):
        return self.policy.exact.plan(encoded)

    def forward_batch(self, tickets: Sequence[EncodedTicket], width: int | None = None) -> list:
        return self.policy.exact.forward_batch(tickets, width)

    def settle(self, fast: Any, exact: Any) -> Any:
        return self.policy.settle(fast, exact)


def check(fast: Any, exact: Any, precision: str, prompt_ids: Sequence[int], fields: Mapping[str, Field],
          force: bool = False, schema: str = "") -> Checked | None:  # fmt: skip
    """The policy holding `fast` (a runner in `precision`) to its float32 twin `exact`, with a measured
    error bound: this machine's cached calibration, else `calibrate` now. None (`fast` to be served
    unchecked, or float32 to answer) where the calibration predicts the re-checked precision under
    MIN_GAIN x float32's speed, unless `force` (the bench shows what it would do). `schema` names
    its schema in the log."""
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
    bound = ErrorBound(precision, calibration, path)
    if fresh:  # a cached one is already on disk; a widening saves itself
        save_bound(path, bound)
    if calibration.gain < MIN_GAIN and not force:
        log.warning("%s re-checked in float32 would run %.2fx float32's speed here (%s %.2fx float32's, %.0f%% of the "
                    "calibration tickets within its bound, needs %.2fx): answering in float32", precision,
                    calibration.gain, precision, calibration.speed, 100 * calibration.share, MIN_GAIN)  # fmt: skip
        return None
    log.info("%s answers with a decision gap under %.3g x tokens^%g are re-checked in float32", precision,
             SAFETY * bound.rate, bound.exponent)  # fmt: skip
    return Checked(fast, exact, bound, fields, judged=not force)


def _key(fast: Any, precision: str, prompt_ids: Sequence[int], fields: Mapping[str, Field]) -> list:
    """What the calibration depends on: the machine, torch, the model's weights, the prompt, the
    precision, the forward that rounds (fused or transformers' layers), the bound's rule, the
    thresholds that decide with the labels (the share within the bound), and the scorer (issue 43:
    a label head, TICKETQ_HEAD or a schema field's, has its own bound)."""
    host = getattr(fast, "engine", fast)
    head = host.model.get_output_embeddings().weight
    # a checksum: the head's first rows and the decoder's dense vectors (its norms' weights, biases),
    # found by shape whatever a family names them (Llama's `norm`, GPT-2's `ln_f`); packed weights are opaque
    vectors = [p for p in host.model.get_decoder().parameters() if p.dim() == 1 and p.layout == torch.strided]
    weights = [float(head[:64].detach().double().sum()), sum(float(p.detach().double().sum()) for p in vectors)]
    return [cpu_model(), sorted(cpu_flags()), platform.machine(), torch.__version__, torch.get_num_threads(),
            getattr(host.model, "name_or_path", "?"), weights, precision, getattr(host.info, "matmul", ""),
            ARITHMETIC if getattr(host.info, "fused", False) else "transformers",
            [CALIBRATION_SIZE, SAFETY, TAIL_CHANCE, ERROR_MEASURE],  # the rule that turned the errors into a bound
            list(prompt_ids), sorted((name, f.select, f.threshold) for name, f in fields.items()),
            getattr(host.info, "scorer", "zero-shot"),
            *([fast.heads.scorer] if getattr(fast, "heads", None) else [])]  # a schema's field heads  # fmt: skip
