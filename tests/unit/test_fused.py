"""The fused float32 path (`worker.engine.fused`) against the unbatched reference, on the tiny stand-in.

The engine's other tests run torch's GEMM (`tiny_settings`: matmul torch), which never fuses; here
the weights are prepacked for oneDNN, as `TICKETQ_MATMUL=auto` does on most CPUs, so batches run
through `FusedDecoder`: SiLU, product and residual adds inside the GEMMs, attention as matmuls, the
last layer for the answer positions only. Every answer is held to the reference (transformers'
own layers, full prompt, no cache) and to the same engine with `TICKETQ_FUSE` off.
"""

from __future__ import annotations

import pytest
import torch
from texts import long_text

from producer.synthetic import awkward_texts, generate_tickets
from ticketq.schema import parse_schema
from worker.engine import Engine, EngineOptions
from worker.engine.fused import FusedDecoder
from worker.engine.kernels import PackedLinear
from worker.engine.layout import prefix_mask
from worker.engine.prompt import system_text
from worker.engine.replicas import load_engine
from worker.settings import DEFAULT_SYSTEM_PROMPT

pytestmark = pytest.mark.skipif(not PackedLinear.available(), reason="this torch has no oneDNN linear ops")

PROB_TOL = 1e-4  # batched vs reference, float32 (as tests/unit/test_engine.py)
PATH_TOL = 1e-5  # fused vs transformers' layers, the same batches

NESTED = ("account", "account security", "account security review", "technical")  # two trie levels


@pytest.fixture(scope="module")
def fused(tiny_settings) -> Engine:
    return load_engine(tiny_settings.model_copy(update={"matmul": "onednn"}))


@pytest.fixture(scope="module")
def unfused(tiny_settings) -> Engine:
    return load_engine(tiny_settings.model_copy(update={"matmul": "onednn", "fuse": False}))


@pytest.fixture(scope="module")
def tickets(fused) -> list[str]:
    texts = ["a", "?", "Refund please"]
    texts += [t["text"] for t in generate_tickets(60, seed=7)]
    texts += [long_text(fused, n, seed) for n, seed in ((300, 51), (520, 52), (900, 53))]  # the last two truncated
    return texts + awkward_texts()[:8]


def worst_diff(got, want) -> float:
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.label == b.label, f"ticket {i}: {a.label} vs {b.label}"
        worst = max(worst, max(abs(a.probs[k] - b.probs[k]) for k in b.probs))
    return worst


def test_the_fused_path_runs_on_prepacked_weights_only(fused, unfused, tiny_settings):
    assert fused.info.fused and fused._fused is not None
    assert not unfused.info.fused and unfused._fused is None
    plain = load_engine(tiny_settings)  # torch's GEMM: nothing packed, nothing fused
    assert plain.info.matmul == "torch" and not plain.info.fused
    int8 = load_engine(tiny_settings.model_copy(update={"dtype": "int8", "matmul": "onednn"}))
    assert int8.info.matmul == "onednn" and not int8.info.fused  # dynamic int8 linears are not PackedLinear
    assert FusedDecoder.build(plain.decoder) is None and FusedDecoder.build(int8.decoder) is None


@pytest.fixture(scope="module")
def bf16_pair(tiny_settings) -> tuple[Engine, Engine]:
    """bf16 engines on packed weights: fused, and through transformers' layers (`fuse` off)."""
    from worker.engine.kernels import cpu_has_native_bf16

    if not cpu_has_native_bf16():  # bf16 weights stay plain here (tests/unit/test_engine.py): nothing to fuse
        plain = load_engine(tiny_settings.model_copy(update={"dtype": "bfloat16", "matmul": "auto"}))
        assert not plain.info.fused and FusedDecoder.build(plain.decoder) is None
        pytest.skip("no native bf16 on this CPU: bf16 weights are not packed, nothing runs fused")
    bf16 = load_engine(tiny_settings.model_copy(update={"dtype": "bfloat16", "matmul": "onednn"}))
    plain = load_engine(tiny_settings.model_copy(update={"dtype": "bfloat16", "matmul": "onednn",
                                                                  "fuse": False}))  # fmt: skip
    return bf16, plain


def test_bfloat16_batches_run_fused_without_post_ops_and_agree(bf16_pair, tickets):
    """bf16 on packed weights runs the fused loop with plain elementwise ops, SDPA attention and a
    float32 residual stream: labels as transformers' bf16 layers give them off near-ties,
    probabilities within bf16 noise."""
    bf16, plain = bf16_pair
    assert bf16.info.fused and not bf16._fused.post_ops and not plain.info.fused
    got, _ = bf16.classify(tickets)
    want, _ = plain.classify(tickets)
    for a, b in zip(got, want, strict=True):
        assert max(abs(a.probs[k] - b.probs[k]) for k in b.probs) < 0.03
        assert a.label == b.label or b.margin < 0.05


def test_the_bfloat16_residual_stream_stays_float32(bf16_pair, tickets):
    """The fused bf16 forward adds each branch to a float32 residual stream (the norms read it in
    float32), where transformers' bf16 layers round that sum at every add; the GEMMs still run in
    bf16. On the full-size stand-in that cuts the decision errors against float32 by about a third
    (docs/performance.md); the tiny one has too few layers to show it, so this holds the mechanism."""
    seen: dict[str, set] = {"fused": set(), "transformers": set(), "gemm": set()}

    def watch(name):
        return lambda module, args: seen[name].add(args[0].dtype)

    for name, engine in (("fused", bf16_pair[0]), ("transformers", bf16_pair[1])):
        layers = engine.decoder.layers
        hooks = [m.register_forward_pre_hook(watch(name)) for layer in layers
                 for m in (layer.input_layernorm, layer.post_attention_layernorm)]  # fmt: skip
        hooks.append(layers[0].mlp.gate_proj.register_forward_pre_hook(watch("gemm")))
        try:
            engine.classify(tickets[:6])
        finally:
            for hook in hooks:
                hook.remove()
    assert seen == {"fused": {torch.float32}, "transformers": {torch.bfloat16}, "gemm": {torch.bfloat16}}


def test_fused_batches_match_the_reference_and_the_unfused_path(fused, unfused, tickets):
    """Tickets from 1 to 900 tokens (truncated), in the planner's batches and in one padding-heavy batch."""
    got, reports = fused.classify(tickets)
    assert len(reports) > 1
    assert worst_diff(got, [fused.reference(text) for text in tickets]) <= PROB_TOL
    want, _ = unfused.classify(tickets)
    assert worst_diff(got, want) <= PATH_TOL
    encoded = fused.encode(tickets[:12] + tickets[-12:])
    padded = fused.forward_batch(encoded, max(len(e.ids) for e in encoded))  # short rows beside long ones
    assert worst_diff(padded, unfused.forward_batch(encoded, max(len(e.ids) for e in encoded))) <= PATH_TOL


def test_keeping_positions_gives_those_rows_of_the_full_forward(fused):
    """`keep` runs the last layer for the asked-for positions only: the same hidden states as
    computing every position and picking them, and the cache still holds every position."""
    encoded = fused.encode(["My invoice is wrong, twice!", "Login fails", "The app crashes on start since the update"])
    width = max(len(e.ids) for e in encoded)
    lengths = torch.tensor([len(e.ids) for e in encoded])
    keep = torch.stack([lengths - 1, torch.zeros_like(lengths), lengths // 2], dim=1)  # (B, 3)

    def forward(keep_):
        cache = fused.batch_cache(len(encoded))
        ids = torch.tensor([[*e.ids, *[fused.pad_id] * (width - len(e.ids))] for e in encoded])
        positions = fused.prefix_len + torch.arange(width).expand(len(encoded), -1)
        mask = prefix_mask(fused.prefix_len, lengths, width, 0, fused.dtype)
        hidden = fused.decode(ids, mask, positions, cache, keep_)
        return hidden, cache.get_seq_length()

    full, full_len = forward(None)
    kept, kept_len = forward(keep)
    assert kept.shape == (len(encoded), 3, full.shape[-1]) and kept_len == full_len == fused.prefix_len + width
    torch.testing.assert_close(kept, full.gather(1, keep[:, :, None].expand(-1, -1, full.shape[-1])),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_fused_trie_continuations_match_the_reference(fused, tickets):
    """Labels sharing one and two first tokens: the continuation forwards read the batch's cached keys."""
    nested = Engine(fused.model, fused.tokenizer,
        EngineOptions(labels=NESTED, system=system_text(DEFAULT_SYSTEM_PROMPT, NESTED, {})))
    assert nested.info.fused and any(len(path) >= 2 for path in nested.prompt.trie.branches)
    texts = tickets[:30] + tickets[-10:]
    got, _ = nested.classify(texts)
    assert worst_diff(got, [nested.reference(text) for text in texts]) <= PROB_TOL


def test_fused_fields_match_their_reference(fused, tickets):
    """Several fields packed after each ticket: each field's last token, kept, answers as its full prompt."""
    schema = parse_schema({
        "name": "fused-fields",
        "fields": {
            "team": {"instruction": "Which team?", "labels": ["account", "account security", "billing"]},
            "urgent": {"instruction": "Is it urgent?", "labels": ["yes", "no"]},
            "topics": {"instruction": "Which topics?", "labels": ["refund", "outage"], "multi": True},
        },
    })  # fmt: skip
    runner = fused.fields(schema)
    texts = tickets[:16] + tickets[-6:]
    got = runner.classify(texts)[0]
    for text, answer in zip(texts, got, strict=True):
        want = runner.reference(text)
        for name, expected in want.fields.items():
            result = answer.fields[name]
            assert (result.label, result.labels) == (expected.label, expected.labels), (name, text[:40])
            assert max(abs(result.probs[k] - expected.probs[k]) for k in expected.probs) <= PROB_TOL
