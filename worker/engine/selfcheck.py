"""The load-time self-check: the batched path held to the reference on a few synthetic tickets.

The fused decoder and the label-only scorer implement the model families they know term for term
(`fused.FAMILIES`, `scoring.OutputTerms`). A family with a term that neither knows of would
answer otherwise than the reference, the one thing ticketq promises never to do; so `verify`
runs SELF_CHECK_TEXTS as one padded batch through a float32 engine's batched path and one at a
time through its reference (`Engine.reference`: transformers' own model, full prompt, no cache,
full vocabulary), and compares every label's probability:

- within TOLERANCE (float32 noise): the batched path serves as it is;
- beyond it, on the fused decoder: the engine falls back to transformers' layers (`Engine.unfuse`,
  logged, `ModelInfo.fused` False and `ModelInfo.self_check` saying why) and is checked again;
- beyond it even there: `ArchitectureUnsupported`, one line (the label-only scorer misses a term).

Only float32 engines are checked: a fast precision is held to float32 by its twin (`recheck`),
which is checked here, and an unchecked one is inexact by choice. Its cost: the reference's forward
passes for three tickets and one batch, at each load.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from worker.engine.loading import ModelNotFound
from worker.engine.precision import CALIBRATION_TEXTS

log = logging.getLogger(__name__)

# Batched against reference, |Δp| of any label: float32's own noise (summation order, batch shape)
# is ~1e-6 on these tickets; a skipped term (a norm, a scale) moves probabilities by 1e-4 to 1e-1.
TOLERANCE = 1e-4
# Three lengths in one batch, so the padding and the masks are exercised: a short ticket, a
# sentence, and a long multi-line one.
SELF_CHECK_TEXTS = (CALIBRATION_TEXTS[2], CALIBRATION_TEXTS[1], CALIBRATION_TEXTS[14])


class ArchitectureUnsupported(ModelNotFound):
    """The batched path answers otherwise than the reference on this model, fused or not."""


def verify(engine: Any, also: tuple[Any, ...] = ()) -> None:
    """Hold `engine`'s (float32) batched path to its reference; fall back to transformers' layers
    where the fused one differs (in `also` too: engines on a copy of the same model, in another
    precision), or raise `ArchitectureUnsupported` where even those differ. See the module doc."""
    if engine.precision != "float32":
        return
    worst = batched_error(engine)
    if worst <= TOLERANCE:
        engine.info = replace(engine.info, self_check=f"batched = reference to {worst:.1e}")
        return
    family = getattr(engine.model.config, "model_type", "?")
    if engine.info.fused:
        log.warning("self-check: the fused decoder answers %.1e from the reference on %s (> %g): batches run "
                    "through transformers' layers instead (slower, exact)", worst, family, TOLERANCE)  # fmt: skip
        for other in (engine, *also):
            if other.info.fused:
                other.unfuse()
        unfused = batched_error(engine)
        if unfused <= TOLERANCE:
            note = f"fused decoder {worst:.1e} from the reference: transformers' layers serve, {unfused:.1e}"
            for other in (engine, *also):
                other.info = replace(other.info, self_check=note)
            return
        worst = unfused
    raise ArchitectureUnsupported(
        f"model {engine.info.name!r} ({family}): ticketq's batched answers differ from the reference by {worst:.1e} "
        f"in probability (more than float32's {TOLERANCE:g}), so it cannot serve this architecture exactly; "
        "use a supported family (docs/models.md)"
    )


def batched_error(engine: Any) -> float:
    """The largest |Δp| of any label, SELF_CHECK_TEXTS batched against the reference."""
    batched = engine.forward_batch(engine.encode(SELF_CHECK_TEXTS))
    worst = 0.0
    for text, answer in zip(SELF_CHECK_TEXTS, batched, strict=True):
        reference = engine.reference(text)
        worst = max(worst, max(abs(answer.probs[label] - p) for label, p in reference.probs.items()))
    return worst
