"""The start-up probes (`worker.engine.kernels`): measured until two measurements in a row take the
same side of the probe's threshold, the safe choice kept where they straddle it, the verdict cached
per machine so that the next start skips them.

The measurements are faked (a list of ratios in turn), so nothing here depends on timing; one test
runs the real GEMM, small, for the file it writes. Each test has a cache directory of its own
($XDG_CACHE_HOME).
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from worker.engine import kernels, probes
from worker.engine.replicas import check_with, load_engine, with_precision

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A private cache, and no oneDNN ratio remembered from another test (`functools.cache`)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kernels.onednn_linear_speedup.cache_clear()
    yield tmp_path / "cache" / "ticketq" / "kernels"
    kernels.onednn_linear_speedup.cache_clear()


@pytest.fixture
def bf16_cpu(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_has_native_bf16", lambda: True)


@pytest.fixture
def onednn(monkeypatch):
    monkeypatch.setattr(kernels.PackedLinear, "available", staticmethod(lambda: True))


def measuring(monkeypatch, name: str, ratios: list[float]) -> list[float]:
    """`kernels.<name>` (one measurement) answers `ratios` in turn and fails past them; what it answered."""
    answered: list[float] = []

    def measure(rows: int = 256, reps: int = 3) -> float:
        if len(answered) == len(ratios):
            pytest.fail(f"{name} measured more than {len(ratios)} times")
        answered.append(ratios[len(answered)])
        return answered[-1]

    monkeypatch.setattr(kernels, name, measure)
    return answered


def not_measuring(monkeypatch, *names: str) -> None:
    for name in names:
        monkeypatch.setattr(kernels, name, lambda rows=256, reps=3, name=name: pytest.fail(f"{name} measured"))


def entries(cache_dir) -> dict[str, dict]:
    return {path.name.split("-")[0]: json.loads(path.read_text()) for path in sorted(cache_dir.glob("*.json"))}


def test_a_probe_settles_on_its_decision_and_the_next_start_reads_its_verdict(monkeypatch, cache_dir, bf16_cpu,
                                                                              caplog):  # fmt: skip
    """Ratios that all say "bf16 is far faster" settle at once, however much their digits move."""
    answered = measuring(monkeypatch, "bf16_gemm_ratio", [2.95, 3.82, 3.28, 2.49, 3.13])
    with caplog.at_level(logging.INFO, logger="worker.engine"):
        assert kernels.resolve_dtype("auto", CPU, "torch") is torch.bfloat16
    assert answered == [2.95, 3.82]
    (entry,) = entries(cache_dir).values()
    assert entry["agreed"] is True and entry["measured"] == [2.95, 3.82]
    assert entry["ratio"] == pytest.approx(3.385)
    assert "measured 2.95x, 3.82x, above the 1.25x threshold -> 3.38x" in caplog.text

    not_measuring(monkeypatch, "bf16_gemm_ratio")  # the next start on this machine
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="worker.engine"):
        assert kernels.resolve_dtype("auto", CPU, "torch") is torch.bfloat16
    assert "bf16-matmul probe: 3.38x, cached" in caplog.text


@pytest.mark.parametrize(("ratios", "measured", "ratio"), [
    ([1.0, 0.9], 2, 0.95),  # both clearly below: float32, settled
    ([2.0, 1.3, 1.34, 3.0], 4, 2.0),  # 1.30 sits within the margin of 1.25: it takes no side
    ([2.0, 0.8, 1.6, 1.7], 4, 1.7),  # a burst crosses the line once: the run starts again
    ([0.5, 2.0, 0.6, 2.1, 0.7], 5, probes.NO_SPEEDUP),  # straddles to the end: the safe choice
])  # fmt: skip
def test_the_decision_rule(monkeypatch, bf16_cpu, ratios, measured, ratio):
    answered = measuring(monkeypatch, "bf16_gemm_ratio", ratios)
    assert kernels.bf16_matmul_speedup() == pytest.approx(ratio)
    assert len(answered) == measured


def test_decision_takes_a_side_only_clear_of_the_margin():
    assert probes.decision([1.4, 3.0], 1.25) is True
    assert probes.decision([1.0, 1.1], 1.25) is False
    assert probes.decision([1.2, 3.0], 1.25) is None  # 1.2 is within 5% of 1.25
    assert probes.decision([0.9, 3.0], 1.25) is None


def test_measurements_that_straddle_keep_float32_and_torchs_gemm(monkeypatch, cache_dir, bf16_cpu, onednn,
                                                                 caplog):  # fmt: skip
    swinging = [2.0, 1.0] * 3  # above the thresholds every other time
    bf16 = measuring(monkeypatch, "bf16_gemm_ratio", swinging)
    gemm = measuring(monkeypatch, "onednn_gemm_ratio", swinging)
    with caplog.at_level(logging.INFO, logger="worker.engine"):
        assert kernels.resolve_dtype("auto", CPU, "torch") is torch.float32
        assert kernels.resolve_matmul("auto", CPU, torch.float32) == "torch"
    assert len(bf16) == len(gemm) == probes.PROBE_TRIES
    assert caplog.text.count("measurements straddled the") == 2
    assert {name: (e["agreed"], e["ratio"]) for name, e in entries(cache_dir).items()} == {
        "bf16": (False, probes.NO_SPEEDUP),
        "onednn": (False, probes.NO_SPEEDUP),
    }
    not_measuring(monkeypatch, "bf16_gemm_ratio", "onednn_gemm_ratio")  # cached too: a busy machine stays busy
    kernels.onednn_linear_speedup.cache_clear()
    assert kernels.resolve_dtype("auto", CPU, "auto") is torch.float32
    assert kernels.resolve_matmul("auto", CPU, torch.float32) == "torch"


def test_both_probes_are_measured_once_a_start_and_not_at_all_the_next(monkeypatch, cache_dir, bf16_cpu, onednn):
    """TICKETQ_DTYPE=auto with TICKETQ_MATMUL=auto asks the oneDNN probe twice (bf16 must beat the
    faster float32 kernel): it is measured once."""
    bf16 = measuring(monkeypatch, "bf16_gemm_ratio", [2.0, 2.1])
    gemm = measuring(monkeypatch, "onednn_gemm_ratio", [2.5, 2.4])
    dtype = kernels.resolve_dtype("auto", CPU, "auto")  # 2.05 / 2.45: float32
    assert dtype is torch.float32 and kernels.resolve_matmul("auto", CPU, dtype) == "onednn"
    assert (bf16, gemm) == ([2.0, 2.1], [2.5, 2.4])
    assert sorted(entries(cache_dir)) == ["bf16", "onednn"]

    kernels.onednn_linear_speedup.cache_clear()  # a new process
    not_measuring(monkeypatch, "bf16_gemm_ratio", "onednn_gemm_ratio")
    dtype = kernels.resolve_dtype("auto", CPU, "auto")
    assert dtype is torch.float32 and kernels.resolve_matmul("auto", CPU, dtype) == "onednn"


@pytest.mark.parametrize(("agreed", "age_days", "measured_again"), [
    (True, 2, False), (True, 31, True), (False, 0.5, False), (False, 2, True),
])  # fmt: skip
def test_a_verdict_is_measured_again_once_it_is_old(monkeypatch, cache_dir, agreed, age_days, measured_again):
    measuring(monkeypatch, "bf16_gemm_ratio", [1.5, 1.5])
    kernels.bf16_matmul_speedup()
    (path,) = cache_dir.glob("*.json")
    entry = json.loads(path.read_text())
    path.write_text(json.dumps({**entry, "agreed": agreed, "at": time.time() - age_days * 86400}))
    again = measuring(monkeypatch, "bf16_gemm_ratio", [3.0, 3.0])
    assert kernels.bf16_matmul_speedup() == (3.0 if measured_again else 1.5)
    assert bool(again) is measured_again


def test_the_verdict_is_this_machines_only(monkeypatch, cache_dir):
    """Another CPU model, other flags, another torch, other threads or another GEMM shape: measured again."""
    measuring(monkeypatch, "bf16_gemm_ratio", [1.5, 1.5])
    kernels.bf16_matmul_speedup()
    changes = [
        lambda: monkeypatch.setattr(probes, "cpu_model", lambda: "Another CPU"),
        lambda: monkeypatch.setattr(probes, "cpu_flags", lambda: {"avx2"}),
        lambda: monkeypatch.setattr(torch, "__version__", "99.0.0"),
        lambda: monkeypatch.setattr(torch, "get_num_threads", lambda: 97),
    ]
    for change in changes:
        change()
        again = measuring(monkeypatch, "bf16_gemm_ratio", [2.0, 2.0])
        assert kernels.bf16_matmul_speedup() == 2.0 and again == [2.0, 2.0]
    again = measuring(monkeypatch, "bf16_gemm_ratio", [2.5, 2.5])
    assert kernels.bf16_matmul_speedup(rows=64) == 2.5 and again
    assert len(list(cache_dir.glob("*.json"))) == 2 + len(changes)


def test_a_broken_or_foreign_cache_file_is_measured_again(monkeypatch, cache_dir):
    measuring(monkeypatch, "bf16_gemm_ratio", [1.5, 1.5])
    kernels.bf16_matmul_speedup()
    (path,) = cache_dir.glob("*.json")
    entry = json.loads(path.read_text())
    for broken in ("{half a fi", json.dumps({**entry, "ratio": -1}), json.dumps({**entry, "ratio": "NaN"}),
                   json.dumps({**entry, "key": ["another machine"]}), json.dumps({"ratio": 1.5})):  # fmt: skip
        path.write_text(broken)
        again = measuring(monkeypatch, "bf16_gemm_ratio", [2.0, 2.0])
        assert kernels.bf16_matmul_speedup() == 2.0 and again, broken
        path.write_text(json.dumps(entry))


def test_an_unwritable_cache_only_costs_the_measurement(monkeypatch, tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not-a-dir"))
    measuring(monkeypatch, "bf16_gemm_ratio", [1.5, 1.5, 2.0, 2.0])
    assert kernels.bf16_matmul_speedup() == 1.5
    assert kernels.bf16_matmul_speedup() == 2.0  # nothing was kept: measured again


def test_the_real_probe_writes_the_verdict_the_next_start_reads(monkeypatch, cache_dir):
    first = kernels.bf16_matmul_speedup(rows=16, reps=1)
    (entry,) = entries(cache_dir).values()
    assert entry["ratio"] == first > 0 and 2 <= len(entry["measured"]) <= probes.PROBE_TRIES
    assert entry["key"][1] == {"rows": 16, "in": 896, "out": 4864, "reps": 1, "threshold": kernels.BF16_MIN_SPEEDUP}
    not_measuring(monkeypatch, "bf16_gemm_ratio")
    assert kernels.bf16_matmul_speedup(rows=16, reps=1) == first


def test_auto_rechecked_picks_the_fastest_precision_the_machine_has(monkeypatch, bf16_cpu):
    """bfloat16 where it measures fast; else int8 where its GEMM does; else float32, unchecked."""
    monkeypatch.setattr(kernels, "int8_available", lambda: True)
    monkeypatch.setattr(kernels, "bf16_gemm_ratio", lambda rows=256, reps=3: 2.9)
    not_measuring(monkeypatch, "int8_gemm_ratio")
    assert kernels.resolve_precision("auto", CPU, "torch", recheck=True) == ("bfloat16", True)


def test_auto_rechecked_takes_int8_where_bf16_is_slow_and_int8_fast(monkeypatch, cache_dir):
    monkeypatch.setattr(kernels, "cpu_has_native_bf16", lambda: False)  # an AVX2 CPU
    monkeypatch.setattr(kernels, "int8_available", lambda: True)
    ratios = iter([2.05, 1.63, 2.32])  # the int8 GEMM ratios seen on a 2-core AVX2 EPYC
    monkeypatch.setattr(kernels, "int8_gemm_ratio", lambda rows=256, reps=3, onednn=False: next(ratios))
    assert kernels.resolve_precision("auto", CPU, "torch", recheck=True) == ("int8", True)
    assert [p.name.split("-")[0] for p in cache_dir.glob("*.json")] == ["int8"]  # settled and cached


def test_auto_keeps_float32_where_nothing_is_faster_and_never_int8_unchecked(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(kernels, "int8_available", lambda: True)
    monkeypatch.setattr(kernels, "int8_gemm_ratio", lambda rows=256, reps=3, onednn=False: 1.1)
    assert kernels.resolve_precision("auto", CPU, "torch", recheck=True) == ("float32", False)
    not_measuring(monkeypatch, "int8_gemm_ratio")
    assert kernels.resolve_precision("auto", CPU, "torch", recheck=False) == ("float32", False)
    assert kernels.resolve_precision("int8", CPU, "torch", recheck=True) == ("int8", True)
    assert kernels.resolve_precision("int8", CPU, "torch", recheck=False) == ("int8", False)
    assert kernels.resolve_precision("float32", CPU, "torch", recheck=True) == ("float32", False)


@pytest.mark.skipif(not kernels.PackedLinear.available(), reason="this torch has no oneDNN linear ops")
def test_the_bf16_calibration_hands_onednn_one_dtype_and_the_layer_width_per_call(tiny_settings, monkeypatch):
    """The bench's ticketq-checked mode on a float32 engine with packed weights: its bfloat16 copy
    (packed too on a CPU with native bf16, torch's GEMM elsewhere), then the calibration runs both.
    Every oneDNN linear call must get its input, packed weight and bias in one dtype and an input of
    the layer's width (the copy used to cast the biases it shared with the float32 layers to bf16)."""

    calls: list[tuple] = []
    forward, then = kernels.PackedLinear.forward, kernels.PackedLinear.then

    def record(layer, x):
        bias = None if layer.bias is None else layer.bias.dtype
        calls.append((x.dtype, layer.packed.dtype, bias or x.dtype, x.dim(), x.shape[-1], layer.in_features))

    def recording_forward(self, x, post="none"):
        record(self, x)
        return forward(self, x, post)

    def recording_then(self, x, other, op):
        record(self, x)
        assert other.shape == (*x.shape[:-1], self.out_features) and other.dtype == x.dtype
        return then(self, x, other, op)

    monkeypatch.setattr(kernels.PackedLinear, "forward", recording_forward)
    monkeypatch.setattr(kernels.PackedLinear, "then", recording_then)
    exact = load_engine(tiny_settings.model_copy(update={"matmul": "onednn"}))
    fast = with_precision(exact, "bfloat16")
    assert check_with(fast, exact, force=True)  # the calibration: both engines on the calibration tickets
    assert {fast.precision, exact.precision} == {"bfloat16", "float32"} and calls
    for x_dtype, weight, bias, dims, width, in_features in calls:
        assert x_dtype == weight == bias and dims in (2, 3) and width == in_features
    if kernels.cpu_has_native_bf16():  # the bf16 copy is packed there: its calls were seen too
        assert any(call[0] == torch.bfloat16 for call in calls)


def test_a_cast_copy_is_cast_as_it_is_made_and_equals_casting_the_whole_model(tiny_settings):
    """`cast_copy` builds its bfloat16 copy tensor by tensor (no whole float32 copy held on the way):
    every parameter and buffer equals the old way's (a float32 deep copy cast whole), bit for bit,
    but the embedding table and LM head, which it reads from the float32 model, each row cast as it
    is read: a lookup, the head's logits and the whole model's equal the cast copy's bit for bit, no
    second table is resident, and the float32 model is left as it was."""
    import copy

    from worker.engine.configure import CastTable, cast_copy
    from worker.engine.loading import load_model
    from worker.engine.scoring import HeadRows

    model, _ = load_model(tiny_settings.model, CPU, torch.float32)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    copied, _ = cast_copy(model, torch.bfloat16, "torch")
    whole = copy.deepcopy(model).to(torch.bfloat16)
    tables = {"model.embed_tokens.weight", "lm_head.weight"}
    assert copied.state_dict().keys() == whole.state_dict().keys() - tables
    cast = copied.state_dict()
    for name, tensor in whole.state_dict().items():
        if name not in tables:
            assert cast[name].dtype == tensor.dtype and torch.equal(cast[name], tensor), name
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, before[name]), name
    embed, head = copied.get_input_embeddings(), copied.get_output_embeddings()
    assert isinstance(embed, CastTable) and embed.weight is model.get_input_embeddings().weight
    assert isinstance(head, CastTable) and head.weight is model.get_output_embeddings().weight
    ids = torch.tensor([[0, 5, 17, model.config.vocab_size - 1]])
    assert torch.equal(embed(ids), whole.get_input_embeddings()(ids)) and embed(ids).dtype == torch.bfloat16
    hidden = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    assert torch.equal(head(hidden), whole.get_output_embeddings()(hidden))
    rows, cast_rows = HeadRows.of(copied, [3, 9]), HeadRows.of(whole, [3, 9])
    assert rows.weight.dtype == torch.bfloat16 and torch.equal(rows.logits(hidden), cast_rows.logits(hidden))
    with torch.no_grad():
        assert torch.equal(copied(input_ids=ids).logits, whole(input_ids=ids).logits)
    # the bench's memory figure: the copy holds its own tensors at half the bytes, not the tables
    from ticketq_bench.memory import weights_mb

    distinct = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
    assert weights_mb(model) == pytest.approx(sum(distinct.values()) / 2**20, rel=0.01)
    tables_mb = weights_mb(model.get_input_embeddings(), model.get_output_embeddings())
    assert weights_mb(copied) == pytest.approx((weights_mb(model) - tables_mb) / 2, rel=0.02)
    assert weights_mb(model, copied) == pytest.approx(weights_mb(model) + weights_mb(copied))
