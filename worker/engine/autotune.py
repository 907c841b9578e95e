"""Measure this device's forward-pass cost and fit the planner's cost model to it.

At start-up (`autotune`, TICKETQ_AUTOTUNE): a few seconds of timed forward passes over a grid of
(rows, width) shapes, through the same cached, label-only path that serves tickets, then:

- the token budget: the smallest padded-token size whose throughput is within 5% of the best
  measured, so batches stay as small (low latency, low padding) as this device allows;
- `CostModel.fit` over the shapes within that budget, errors relative to each time
  (`fit_planned`) — fixed cost per forward + cost per computed token (+ a quadratic attention
  term when the fit wants one); the DP planner minimises the sum of these.

While serving (`LiveCostModel`, TICKETQ_LIVE_COST): the worker times every forward anyway; every
REFIT_EVERY forwards the model is refitted from the recent ones on a background thread, never the
classifying one, and swapped in between two plans (the fastest time of each shape, then refitted
without the shapes measured more than 15% above the fit until that leaves the same shapes, at
most TRIM_ROUNDS fits: a neighbour's bursts only slow forwards down, so what is left is the
machine's own speed). A fit is kept only where it is sound (positive fixed and per-token cost,
enough shapes); each kept fit is cached per machine, model, device, dtype, GEMM and threads
(`~/.cache/ticketq/cost`, or $XDG_CACHE_HOME), and the next start on the same machine begins from
it instead of the configured defaults.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from worker.engine.cost import CostModel, floored, sound
from worker.engine.prompt import EncodedTicket

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32)
WIDTHS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Tuning:
    cost: CostModel
    max_batch_tokens: int
    samples: tuple[tuple[int, int, float], ...]  # (rows, width, ms)

    def describe(self) -> str:
        c = self.cost
        return (
            f"cost(rows, width) = {c.fixed_ms:.2f} ms + {c.token_ms:.4f} ms x tokens"
            + (f" + {c.quad_ms:.2e} ms x rows x width^2" if c.quad_ms else "")
            + f"; budget {self.max_batch_tokens} padded tokens"
        )


def shape_order(max_tokens: int) -> list[tuple[int, int]]:
    """Every width once at one row and at the most rows first, so a short budget still spans the
    widths the planner will use; then the rest of the grid, cheapest first."""
    grid = [(r, w) for r in ROWS for w in WIDTHS if r * w <= max_tokens]
    first = [(1, w) for w in WIDTHS] + [(max(r for r in ROWS if r * w <= max_tokens), w) for w in WIDTHS]
    first = list(dict.fromkeys(s for s in first if s in grid))
    return first + sorted((s for s in grid if s not in first), key=lambda s: s[0] * s[1])


def measure(engine, max_tokens: int = 1024, budget_s: float = 20.0) -> list[tuple[int, int, float]]:
    """Timed forwards per shape (best of two for short ones), widest coverage first, within `budget_s`."""
    token = engine.prompt.encode("hello").ids[0]
    for width in (16, max(WIDTHS)):  # warm-up: allocator and kernels for small and large shapes
        engine.forward_batch([_row(engine, token, width)])
    deadline = time.monotonic() + budget_s
    samples = []
    for rows, width in shape_order(max_tokens):
        if time.monotonic() > deadline and len(samples) >= 6:
            break
        batch = [_row(engine, token, width)] * rows
        timings = []
        for _ in range(2 if rows * width < 512 else 1):  # a minimum filters out a neighbour's burst
            start = time.perf_counter()
            engine.forward_batch(batch)
            timings.append((time.perf_counter() - start) * 1000)
        samples.append((rows, width, min(timings)))
    return samples


def choose_budget(samples: list[tuple[int, int, float]], floor: int, tolerance: float = 0.05) -> int:
    """Smallest padded-token size within `tolerance` of the best measured tokens/s (at least `floor`)."""
    rate = {}
    for rows, width, ms in samples:
        tokens = rows * width
        rate[tokens] = max(rate.get(tokens, 0.0), tokens / ms)
    best = max(rate.values())
    good = min(tokens for tokens, r in rate.items() if r >= (1 - tolerance) * best)
    return max(good, floor)


def autotune(engine, budget_s: float = 20.0) -> Tuning:
    """Measure, fit, and apply the cost model and token budget to `engine`; returns what it chose."""
    samples = measure(engine, budget_s=budget_s)
    floor = engine.prompt.max_ticket_tokens + len(engine.prompt.suffix_ids)
    budget = choose_budget(samples, floor)
    cost = floored(fit_planned(samples, budget))
    if sound(cost):
        save_cached(engine, cost, "autotune")
    else:
        # A zero term would make the DP favour batches of one (or one giant batch): noise, not the device.
        cached = load_cached(engine)
        log.warning("autotune fit %s looks like noise; keeping %s", cost,
                    "this machine's cached fit" if cached else "the configured cost model")  # fmt: skip
        cost = cached or engine.cost
    tuning = Tuning(cost, budget, tuple(samples))
    engine.cost, engine.max_batch_tokens = tuning.cost, tuning.max_batch_tokens
    log.info("autotuned on %s/%s: %s", engine.info.device, engine.info.dtype, tuning.describe())
    return tuning


def fit_planned(samples: list[tuple[int, int, float]], budget: int) -> CostModel:
    """The cost model of the batches the planner makes: the shapes within `budget`, relative errors.

    A forward's cost per token is not one number: it falls as a batch grows past a few tokens
    (the fixed cost spread) and rises again past the CPU's caches (docs/performance.md). A line
    through all of it in absolute milliseconds follows the big shapes and can put the fixed cost
    at zero, which makes the planner cut a stream into many small forwards. The budget already
    keeps batches out of the expensive end, so the fit looks only at the shapes up to it, each as
    a share of its time.
    """
    planned = [sample for sample in samples if sample[0] * sample[1] <= budget]
    return CostModel.fit(planned if _spans(planned) else samples, relative=True)


def _row(engine, token: int, width: int) -> EncodedTicket:
    ticket = max(1, width - len(engine.prompt.suffix_ids))
    return EncodedTicket(ids=(*([token] * ticket), *engine.prompt.suffix_ids), ticket_tokens=ticket, truncated=False)


# ----- the fit cache ------------------------------------------------------------------------


def cache_path(engine) -> Path:
    """Where this machine's fit for this engine lives: keyed by CPU, model, device, dtype, GEMM, threads."""
    import torch

    info = engine.info
    fused = ["fused"] if getattr(info, "fused", False) else []  # another speed: its own fit
    key = json.dumps([_cpu_name(), platform.machine(), info.name, info.device, info.dtype, info.matmul,
                      torch.get_num_threads(), torch.__version__, *fused])  # fmt: skip
    from worker.engine.probes import cache_dir

    return cache_dir("cost") / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def load_cached(engine) -> CostModel | None:
    """This machine's last sound fit for `engine`, or None (none yet, unreadable, or unsound)."""
    path = cache_path(engine)
    try:
        fit = json.loads(path.read_text(encoding="utf-8"))
        cost = CostModel(fit["fixed_ms"], fit["token_ms"], fit["quad_ms"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cost if sound(cost) else None


def save_cached(engine, cost: CostModel, source: str) -> None:
    """Keep `cost` as this machine's fit (atomically: a reader never sees half a file); never raises."""
    path = cache_path(engine)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({**asdict(cost), "source": source, "at": time.time()}), encoding="utf-8")
        partial.replace(path)
    except OSError as exc:
        log.debug("could not cache the cost model in %s (%s)", path, exc)


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line.partition(":")[2].strip() for line in lines if line.startswith("model name")), "")


# ----- learning while serving ---------------------------------------------------------------

REFIT_EVERY = 50  # forwards between two refits
WINDOW = 400  # the most recent forwards a refit looks at
MIN_SHAPES = 5  # distinct (rows, width) shapes a refit needs (at least 2 widths and 2 row counts)
SLOWER = 0.15  # a shape measured this share above the fit is taken for a burst and left out
TRIM_ROUNDS = 10  # fits a robust refit makes at most (each at most 7 least-squares solves)


class LiveCostModel:
    """Refits `engine.cost` from the forwards it serves (`observe`, once per forward).

    `observe` runs on the classifying thread and only records: O(1), plus a copy of the window
    (at most WINDOW tuples) every `refit_every` forwards, handed to one background daemon thread
    that fits it. At most one refit is in flight: one that falls due while another runs is
    skipped (the next sees its forwards too). A kept fit is swapped in with one attribute set,
    `engine.cost = fit`, and the planner reads `engine.cost` once per plan, so a plan is costed by
    one model and the new one applies from the next plan. An exception in the background is
    logged and the current model kept. `refit()` fits synchronously (tests, benchmarks).

    `on_fit(cost, error)` hears every kept fit and its median relative error over the window, on
    the thread that fitted it.
    """

    def __init__(self, engine, on_fit: Callable[[CostModel, float], None] | None = None,
                 refit_every: int = REFIT_EVERY, window: int = WINDOW) -> None:  # fmt: skip
        self.engine = engine
        self.on_fit = on_fit
        self.refit_every = refit_every
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.seen = 0
        self.fits = 0
        self.skipped = 0  # refits that fell due while one was in flight
        self._idle = threading.Lock()  # held while a background refit is in flight
        self._thread: threading.Thread | None = None

    def observe(self, rows: int, width: int, seconds: float) -> None:
        self.samples.append((rows, width, seconds * 1000))
        self.seen += 1
        if self.seen % self.refit_every == 0:
            self._refit_in_background()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the refit in flight, if any; False if it is still running after `timeout` s."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _refit_in_background(self) -> None:
        if not self._idle.acquire(blocking=False):
            self.skipped += 1
            return
        window = tuple(self.samples)  # copied here: the deque moves on while the fit runs
        self._thread = threading.Thread(target=self._background, args=(window,), name="ticketq-cost-refit",
                                        daemon=True)  # fmt: skip
        try:
            self._thread.start()
        except RuntimeError as exc:  # no thread to be had (e.g. at interpreter shutdown): skip this one
            self._idle.release()
            log.warning("live cost refit skipped: %s", exc)

    def _background(self, window: tuple[tuple[int, int, float], ...]) -> None:
        try:
            self.refit(window)
        except Exception:
            log.exception("live cost refit failed; the planner keeps its current cost model")
        finally:
            self._idle.release()

    def refit(self, window: Sequence[tuple[int, int, float]] | None = None) -> CostModel | None:
        """Fit `window` (default: the forwards seen); apply and cache a sound fit. Returns it, or
        None (kept the current one). O(len(window)): see `_robust_fit`."""
        forwards = tuple(self.samples) if window is None else window
        shapes: dict[tuple[int, int], float] = {}
        for rows, width, ms in forwards:
            # The fastest of each shape: a neighbour's burst only ever slows a forward down.
            shapes[rows, width] = min(ms, shapes.get((rows, width), ms))
        fastest = [(rows, width, ms) for (rows, width), ms in shapes.items()]
        cost = _robust_fit(fastest)
        cost = floored(cost) if cost is not None else None
        if cost is None or not sound(cost):
            log.debug("live cost fit over %d shapes not kept (%s)", len(fastest), cost)
            return None
        error = statistics.median(abs(cost.batch_ms(r, w) - ms) / ms for r, w, ms in fastest if ms > 0)
        previous, self.engine.cost = self.engine.cost, cost
        self.fits += 1
        save_cached(self.engine, cost, "live")
        if self.fits == 1 or _moved(previous, cost):
            log.info("cost model refitted from %d served forwards (%d shapes, median error %.0f%%): "
                     "%.2f ms + %.4f ms x tokens%s", len(forwards), len(fastest), 100 * error, cost.fixed_ms,
                     cost.token_ms, f" + {cost.quad_ms:.2e} ms x rows x width^2" if cost.quad_ms else "")  # fmt: skip
        if self.on_fit is not None:
            self.on_fit(cost, error)
        return cost


def _robust_fit(shapes: list[tuple[int, int, float]]) -> CostModel | None:
    """CostModel.fit (relative errors) trimmed from above: each round fits the shapes that took
    at most SLOWER over the previous round's prediction (all of them in the first round), until a
    round keeps the same shapes; None when too few shapes are left to fit.

    A neighbour's burst only ever slows a forward down, and the planner's widths make most served
    shapes unique, so a shape's fastest time is usually its only time: trimming from above leaves
    the lower envelope, the machine's own speed. A shape left out by a fit that bursts still
    pulled up comes back once the fit is below it. A machine slowed evenly (a constant
    neighbour) is no outlier: every shape moves, nothing is left out, and the fit follows it.

    Cost: at most TRIM_ROUNDS fits of at most n shapes, each 7 least-squares solves of n x 3 and
    O(n) besides: O(n) in all, at most 7 x TRIM_ROUNDS solves. Trimmed fits settle in a few rounds
    (each round's fit is below the last while bursts are left to drop); one that has not settled
    after TRIM_ROUNDS is taken from the last round.
    """
    kept = shapes
    cost = None
    for _ in range(TRIM_ROUNDS):
        if not _spans(kept):
            return None
        try:
            cost = CostModel.fit(kept, relative=True)
        except ValueError:  # degenerate shapes
            return None
        within = [s for s in shapes if s[2] <= (1 + SLOWER) * cost.batch_ms(s[0], s[1])]
        if within == kept:
            break
        kept = within
    return cost


def _spans(samples: list[tuple[int, int, float]]) -> bool:
    return (len(samples) >= MIN_SHAPES and len({w for _, w, _ in samples}) >= 2
            and len({r for r, _, _ in samples}) >= 2)  # fmt: skip


def _moved(before: CostModel, after: CostModel, share: float = 0.1) -> bool:
    """A change worth a log line: a term moved by more than `share`."""
    pairs = ((before.fixed_ms, after.fixed_ms), (before.token_ms, after.token_ms))
    return any(abs(b - a) > share * max(abs(a), 1e-9) for a, b in pairs)
