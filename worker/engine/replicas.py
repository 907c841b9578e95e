"""Building engines: one from the settings, a sibling of one in another precision, and the check
that holds a fast one to its float32 twin. The engine (`model.Engine`) only computes; what a worker
loads and how its replicas relate is decided here.

`load_engine(settings)` loads the configured model (`configure.load_configured`), holds the float32
engine to the reference (`selfcheck.verify`) and, for a fast precision with TICKETQ_RECHECK on,
builds its float32 twin and its precision policy (`check_with`): the fast engine where the
calibration predicts the check pays, else the float32 one.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ticketq.schema import default_schema
from worker.engine.configure import ModelInfo, cast_copy, load_configured
from worker.engine.cost import CostModel
from worker.engine.fieldheads import check_schema_heads
from worker.engine.head import attach_head
from worker.engine.int8 import INT8
from worker.engine.model import Engine, EngineOptions
from worker.engine.policy import check
from worker.engine.prompt import system_text
from worker.engine.selfcheck import verify
from worker.settings import Settings


def load_engine(settings: Settings) -> Engine:
    """The engine a worker serves with `settings` (see the module)."""
    model, tokenizer, info, exact_model = load_configured(settings)
    labels = settings.label_names
    options = EngineOptions(
        labels=labels, system=system_text(settings.system_prompt, labels, settings.label_descriptions),
        max_ticket_tokens=settings.max_ticket_tokens, truncation=settings.truncation,
        max_batch_tokens=settings.max_batch_tokens, max_batch_size=settings.max_batch_size,
        schema=default_schema(labels, settings.system_prompt, settings.label_descriptions),
        fuse=settings.fuse, dedup=settings.dedup,
    )  # fmt: skip
    cost = lambda: CostModel(settings.cost_fixed_ms, settings.cost_token_ms, settings.cost_quad_ms)  # noqa: E731
    engine = Engine(model, tokenizer, options, info=info, int8=info.dtype == INT8, cost=cost())
    if exact_model is not None:
        exact = Engine(exact_model, tokenizer, options, info=replace(info, dtype="float32", recheck=False), cost=cost())
        attach_head(settings.head, exact, engine)  # issue 43: TICKETQ_HEAD, checked against the float32 model
        _schema_heads(settings, exact, engine)  # and the schemas' field heads
        verify(exact, also=(engine,))  # the float32 twin held to the reference; the fast copy unfused with it
        # float32 where the check would not pay (TICKETQ_RECHECK=auto)
        return engine if check_with(engine, exact, force=settings.recheck == "always") else exact
    attach_head(settings.head, engine)  # issue 43: TICKETQ_HEAD, checked against this model and prompt
    _schema_heads(settings, engine)  # and the schemas' field heads
    verify(engine)  # float32: held to the reference, unfused where the fused decoder differs
    return engine


def _schema_heads(settings: Settings, engine: Engine, *others: Engine) -> None:
    """The field heads of TICKETQ_SCHEMAS checked against `engine` (the float32 one) at start-up, named
    in its info and `others'` (the model-info metric)."""
    heads = check_schema_heads(settings.load_schemas(), engine)
    for runner in (engine, *others):
        runner.info = replace(runner.info, heads=heads)


def check_with(fast: Engine, exact: Engine, force: bool = False) -> bool:
    """Hold `fast` to `exact` (its float32 twin): every answer within its precision's error bound,
    measured now or cached for this machine (`policy.check`), computed again in float32. False (and
    `fast` left unchecked) where the calibration predicts it would not pay, unless `force`."""
    prompt = fast.prompt
    key = [*prompt.prefix_ids, -1, *prompt.suffix_ids, -1, *sorted(prompt.trie.branches)]
    policy = check(fast, exact, fast.precision, key, {}, force)
    fast.force_recheck = force  # the schemas compiled later are held to the same rule
    if policy is not None:
        fast.held_to(policy)
    return policy is not None


def sibling(engine: Engine, model, info: ModelInfo, int8: bool = False) -> Engine:
    """`model` with `engine`'s prompt, planner and options (its cost model copied): unchecked. It runs
    fused where its own weights are packed, as a worker's would, unless the self-check unfused `engine`."""
    return Engine(model, engine.tokenizer, engine.options, cost=replace(engine.cost), info=info, int8=int8)


def with_int8(engine: Engine) -> Engine:
    """The same model, prompt and planner with the int8 batched path (the bench compares both in one run)."""
    return sibling(engine, engine.model, replace(engine.info, dtype=INT8, recheck=False), int8=True)


def with_precision(engine: Engine, precision: str, matmul: str = "auto") -> Engine:
    """The same prompt and planner on a copy of `engine`'s float32 model cast to `precision` (int8:
    `with_int8`), its weights packed for oneDNN where `matmul` resolves so; unchecked (`check_with`
    adds the check)."""
    if precision == INT8:
        return with_int8(engine)
    model, matmul = cast_copy(engine.model, getattr(torch, precision), matmul)
    return sibling(engine, model, replace(engine.info, dtype=precision, matmul=matmul, recheck=False))
