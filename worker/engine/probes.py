"""Probes: a choice between two kernels (or dtypes) decided by a measured speed ratio, once per machine.

A probe decides between two choices by a speed ratio and its threshold. It measures until
SETTLE_RUN measurements in a row fall on the same side of the threshold, each clear of it by
PROBE_MARGIN (a neighbour's burst moves a ratio, rarely across the line twice), and keeps the
safe choice (float32, torch's GEMM) only when PROBE_TRIES measurements straddle it. Its cost: at
most PROBE_TRIES measurements of one decoder-sized GEMM per choice, once per machine. The verdict
is cached per machine (`~/.cache/ticketq/kernels`, or $XDG_CACHE_HOME; keyed by CPU model and
flags, torch version, threads, GEMM shape and threshold): the next start on the same machine skips
it. A verdict is measured again after PROBE_MAX_AGE_S (UNSETTLED_MAX_AGE_S for the safe choice of
measurements that straddled), or at the next start once its file is deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _cpuinfo(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo ("" where there is none: not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.partition(":")[2].strip() for line in lines if line.split(":")[0].strip() == field), "")


def cpu_flags() -> set[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty where there is none: not Linux)."""
    return set(_cpuinfo("flags").split())


def cpu_model() -> str:
    """The first CPU's model name ("AMD EPYC 9B45"), or what `platform` knows of it."""
    return _cpuinfo("model name") or platform.processor()


PROBE_TRIES = 5  # measurements at most; a probe whose measurements straddle its threshold keeps the safe choice
SETTLE_RUN = 2  # this many measurements in a row on one side of the threshold settle a probe
PROBE_MARGIN = 0.05  # a measurement within 5% of the threshold takes no side
PROBE_MAX_AGE_S = 30 * 86400  # a settled verdict is measured again after 30 days
UNSETTLED_MAX_AGE_S = 86400  # an unsettled one (a busy machine) after a day
NO_SPEEDUP = 1.0  # an unsettled probe's ratio: below both thresholds, so float32 and torch's GEMM stay


def settled_speedup(probe: str, measure: Callable[[], float], shape: dict[str, int], threshold: float) -> float:
    """This machine's cached ratio for `probe`, else `measure()` (a speed ratio) until SETTLE_RUN
    measurements in a row take the same side of `threshold` (`decision`): the median of the
    measurements on that side, or NO_SPEEDUP when PROBE_TRIES straddle it; cached either way."""
    path, key = probe_cache_path(probe, {**shape, "threshold": threshold})
    cached = _cached_probe(path, key)
    if cached is not None:
        ratio, agreed, age = cached
        log.info("%s probe: %.2fx%s, cached %s ago in %s (delete it to measure again)", probe, ratio,
                 "" if agreed else " (measurements that straddled the threshold)", _age(age), path)  # fmt: skip
        return ratio
    measured: list[float] = []
    side = None
    while side is None and len(measured) < PROBE_TRIES:
        measured.append(measure())
        side = decision(measured[-SETTLE_RUN:], threshold) if len(measured) >= SETTLE_RUN else None
    shown = ", ".join(f"{m:.2f}x" for m in measured)
    if side is not None:
        ratio = statistics.median(m for m in measured if decision([m], threshold) == side)
        log.info("%s probe: measured %s, %s the %.2fx threshold -> %.2fx (cached in %s)", probe, shown,
                 "above" if side else "below", threshold, ratio, path)  # fmt: skip
    else:
        ratio = NO_SPEEDUP
        log.warning("%s probe: %d measurements straddled the %.2fx threshold (%s): keeping the safe choice "
                    "(cached for a day in %s)", probe, len(measured), threshold, shown, path)  # fmt: skip
    _save_probe(path, {"key": key, "ratio": ratio, "agreed": side is not None, "measured": measured,
                       "at": time.time()})  # fmt: skip
    return ratio


def decision(measured: list[float], threshold: float) -> bool | None:
    """True when every measurement is above `threshold` by PROBE_MARGIN, False when every one is
    below it by as much, None when they straddle it (or one sits within the margin)."""
    if all(m >= threshold * (1 + PROBE_MARGIN) for m in measured):
        return True
    if all(m <= threshold / (1 + PROBE_MARGIN) for m in measured):
        return False
    return None


def probe_cache_path(probe: str, shape: dict[str, int]) -> tuple[Path, list]:
    """Where `probe`'s verdict for this machine lives, and the key it is filed under."""
    key = [probe, shape, cpu_model(), sorted(cpu_flags()), platform.machine(), torch.__version__,
           torch.get_num_threads()]  # fmt: skip
    return cache_dir("kernels") / f"{probe}-{cache_key_digest(key)}.json", key


def cache_key_digest(key: list) -> str:
    """A short, stable file name for a per-machine cache entry filed under `key`."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_dir(kind: str) -> Path:
    """ticketq's per-machine cache of `kind` (kernel verdicts, cost fits): ~/.cache/ticketq/<kind>,
    or under $XDG_CACHE_HOME."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ticketq" / kind


def _cached_probe(path: Path, key: list) -> tuple[float, bool, float] | None:
    """(ratio, agreed, age in seconds) from `path` if it holds a sound verdict for `key`, young enough; else None."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        ratio, agreed, age = float(entry["ratio"]), entry["agreed"] is True, time.time() - float(entry["at"])
        fresh = entry["key"] == json.loads(json.dumps(key)) and 0 <= age <= (
            PROBE_MAX_AGE_S if agreed else UNSETTLED_MAX_AGE_S)  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (ratio, agreed, age) if fresh and math.isfinite(ratio) and ratio > 0 else None


def _save_probe(path: Path, entry: dict) -> None:
    """Write `entry` atomically (a reader never sees half a file); never raises."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entry), encoding="utf-8")
        partial.replace(path)
    except OSError as exc:
        log.debug("could not cache the probe's verdict in %s (%s)", path, exc)


def _age(seconds: float) -> str:
    return f"{seconds / 86400:.0f} days" if seconds >= 2 * 86400 else f"{seconds / 3600:.1f} h"
