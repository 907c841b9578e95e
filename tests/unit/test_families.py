"""Every model family the engine serves, on a tiny random model built here: the batched path
(fused where `fused.FAMILIES` has it, else transformers' layers; the label-only scorer with the
family's output terms) gives the reference's probabilities to float32 noise, the model info says
which path serves, the float32 re-check of bfloat16 loads and answers, and the load-time
self-check falls back (or refuses) where a path misses a term."""

from __future__ import annotations

import dataclasses

import pytest
from families import FAMILIES, FUSED, build_family
from texts import long_text

from producer.synthetic import generate_tickets
from worker.engine.fused import FusedDecoder
from worker.engine.kernels import PackedLinear
from worker.engine.replicas import load_engine
from worker.engine.scoring import OutputTerms
from worker.engine.selfcheck import ArchitectureUnsupported
from worker.settings import Settings

PROB_TOL = 1e-5  # batched vs reference, float32: the bar, every family
ONEDNN = PackedLinear.available()


@pytest.fixture(scope="module")
def family_dirs(tiny_model_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families")
    return {family: build_family(family, root / family, tiny_model_dir) for family in FAMILIES}


def settings(path, **update) -> Settings:
    base = Settings(model=str(path), dtype="float32", device="cpu", threads=1,
                    matmul="onednn" if ONEDNN else "torch", recheck="never")  # fmt: skip
    return base.model_copy(update=update)


def tickets(engine) -> list[str]:
    texts = ["a", "Refund please"] + [t["text"] for t in generate_tickets(5, seed=7)]
    return [*texts, long_text(engine, 300, 51)]


def worst_diff(engine, texts) -> float:
    batched, _ = engine.classify(texts)
    worst = 0.0
    for text, answer in zip(texts, batched, strict=True):
        reference = engine.reference(text)
        worst = max(worst, max(abs(answer.probs[k] - p) for k, p in reference.probs.items()))
    return worst


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_reference_and_the_info_names_the_path(family, family_dirs):
    engine = load_engine(settings(family_dirs[family]))
    assert worst_diff(engine, tickets(engine)) <= PROB_TOL
    assert engine.info.fused == (ONEDNN and family in FUSED)
    assert (engine._fused is not None) == engine.info.fused
    assert engine.info.self_check.startswith("batched = reference")


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_rechecked_in_float32_loads_and_gives_float32_labels(family, family_dirs, tmp_path, monkeypatch):
    """GPT-2 used to crash here (the calibration's cache key read a `norm` only Llama-style decoders have)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a fresh calibration, not this machine's cached one
    engine = load_engine(settings(family_dirs[family], dtype="bfloat16", matmul="auto", recheck="always"))
    assert engine.precision == "bfloat16" and engine.policy.checked
    texts = tickets(engine)[:4]
    answers, _ = engine.classify(texts)
    assert [a.label for a in answers] == [engine.reference(t).label for t in texts]


@pytest.mark.skipif(not ONEDNN, reason="this torch has no oneDNN linear ops: nothing is fused")
def test_a_fused_decoder_that_skips_a_term_gives_way_to_transformers_layers(family_dirs, monkeypatch):
    build = FusedDecoder.build.__func__

    def without_qk_norms(cls, decoder):  # the fused decoder as it was before it knew Qwen3's q/k norms
        fused = build(cls, decoder)
        fused.layers = [dataclasses.replace(layer, q_norm=None, k_norm=None) for layer in fused.layers]
        return fused

    monkeypatch.setattr(FusedDecoder, "build", classmethod(without_qk_norms))
    engine = load_engine(settings(family_dirs["qwen3"]))
    assert not engine.info.fused and engine._fused is None
    assert "fused decoder" in engine.info.self_check and "transformers' layers serve" in engine.info.self_check
    assert worst_diff(engine, tickets(engine)[:3]) <= PROB_TOL


def test_a_scorer_that_skips_a_term_is_refused_in_one_line(family_dirs, monkeypatch):
    monkeypatch.setattr(OutputTerms, "of", classmethod(lambda cls, config: cls()))  # Granite's logits_scaling lost
    with pytest.raises(ArchitectureUnsupported) as caught:
        load_engine(settings(family_dirs["granite"]))
    message = str(caught.value)
    assert "\n" not in message and "granite" in message and "cannot serve this architecture exactly" in message


def test_output_terms_of_each_family():
    from transformers import Gemma2Config, GraniteConfig, LlamaConfig

    assert OutputTerms.of(LlamaConfig()) == OutputTerms()
    assert OutputTerms.of(GraniteConfig(logits_scaling=8.0)).divide == 8.0
    assert OutputTerms.of(Gemma2Config()).softcap == 30.0


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "granite", "gpt2"])
def test_a_schemas_fields_equal_their_reference_on_each_family(family, family_dirs):
    """The schema path shares the decoder and the label-only scorer: the family's terms apply there too."""
    from ticketq.schema import parse_schema

    schema = parse_schema({
        "name": "family-fields",
        "fields": {
            "team": {"instruction": "Which team?", "labels": ["account", "account security", "billing"]},
            "topics": {"instruction": "Which topics?", "labels": ["refund", "outage"], "multi": True},
        },
    })  # fmt: skip
    engine = load_engine(settings(family_dirs[family]))
    runner = engine.fields(schema)
    texts = tickets(engine)[:4]
    for text, answer in zip(texts, runner.classify(texts)[0], strict=True):
        for name, want in runner.reference(text).fields.items():
            got = answer.fields[name].probs
            assert max(abs(got[label] - p) for label, p in want.probs.items()) <= PROB_TOL, (name, text)
