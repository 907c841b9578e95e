"""int8 variants of the batched path, side by side: agreement with the float32 reference and speed.

    .venv/bin/python docs/bench/int8_variants.py --model models/qwen2.5-0.5b-standin --tickets 200 \
        --threads 1 --repeat 2 --reference-cache out/int8-reference.json --markdown docs/bench/int8-variants.md

Every variant is `Engine.classify_encoded` (prefix cache, label-only head, float32 prefix and LM
head) over ONE shared plan, with only the decoder's linear layers swapped. Each runs once per
round, after a warm-up on the shortest tickets; with `--repeat` the rounds go round-robin (a busy
spell on a shared machine then hits every variant) and items/s is the best round. Agreement is
against `Engine.reference` (float32, one ticket, full prompt), computed once and cached.
Near-ties are the bench's: a reference margin below `--tie-tolerance` (0.01); "real"
disagreements are the ones on the other tickets. "mean |dp|" is the mean over tickets of the
largest label-probability error: a less noisy measure of rounding error than a count of flips.

Variants (all torch.ao `quantize_dynamic`: int8 weights, activations quantised per batch):
  per-tensor           the original TICKETQ_DTYPE=int8: one scale per weight matrix
  per-channel          one scale per output row (`per_channel_dynamic_qconfig`)
  per-channel-<skip>   per-channel, the named linears kept in float32 (down: mlp.down_proj;
                       attn: q/k/v/o_proj; edge: the first and last decoder layers)
  <variant>-a8         activations on 8 bits, not 7 (reduce_range=False; AVX512-VNNI only)
  engine               `worker.engine.quantize_linears_int8`, what TICKETQ_DTYPE=int8 runs here
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from producer.synthetic import generate_tickets
from worker.engine import Engine
from worker.engine.int8 import quantize_linears_int8
from worker.engine.kernels import full_range_dynamic_linear
from worker.engine.replicas import load_engine
from worker.results import Prediction
from worker.settings import Settings

warnings.filterwarnings("ignore")  # torch.ao's deprecation notices, once per quantize_dynamic call


def quantized(
    decoder: torch.nn.Module, per_channel: bool, keep: Callable[[str], bool], full_range: bool = False
) -> torch.nn.Module:
    """A copy of `decoder` (sharing its float tensors) with every linear not `keep(name)` in dynamic int8.

    `full_range`: activations on 8 bits instead of torch.ao's 7 (`reduce_range=True`, there so that
    AVX2's int16 pair sums cannot saturate), with the engine's own module for it.
    """
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig, quantize_dynamic

    qconfig = per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig
    names = {n: qconfig for n, m in decoder.named_modules() if isinstance(m, torch.nn.Linear) and not keep(n)}
    mapping = {torch.nn.Linear: full_range_dynamic_linear() if full_range else DynamicLinear}
    shared = {id(t): t for t in (*decoder.parameters(), *decoder.buffers())}
    copied = copy.deepcopy(decoder, memo=shared)
    return quantize_dynamic(copied, names, dtype=torch.qint8, mapping=mapping, inplace=True)


def _down(name: str) -> bool:
    return name.endswith("mlp.down_proj")


def _edge(layers: int) -> Callable[[str], bool]:
    return lambda name: name.startswith(("layers.0.", f"layers.{layers - 1}."))


def variants(layers: int) -> dict[str, Callable[[torch.nn.Module], torch.nn.Module]]:
    never = lambda name: False  # noqa: E731
    return {
        "float32": lambda d: d,
        "per-tensor": lambda d: quantized(d, False, never),
        "per-channel": lambda d: quantized(d, True, never),
        "per-channel-down": lambda d: quantized(d, True, _down),
        "per-channel-attn": lambda d: quantized(d, True, lambda n: ".self_attn." in n),
        "per-channel-edge": lambda d: quantized(d, True, _edge(layers)),
        "per-tensor-down": lambda d: quantized(d, False, _down),
        "per-channel-down-edge": lambda d: quantized(d, True, lambda n: _down(n) or _edge(layers)(n)),
        "per-channel-a8": lambda d: quantized(d, True, never, full_range=True),
        "per-tensor-down-a8": lambda d: quantized(d, False, _down, full_range=True),
        "per-channel-down-a8": lambda d: quantized(d, True, _down, full_range=True),
        "engine": quantize_linears_int8,  # what TICKETQ_DTYPE=int8 runs on this CPU
    }


def reference(engine: Engine, texts: list[str], cache: Path | None, key: dict) -> list[Prediction]:
    if cache and cache.is_file() and (saved := json.loads(cache.read_text()))["key"] == key:
        return [Prediction(**p) for p in saved["predictions"]]
    start = time.perf_counter()
    predictions = [engine.reference(text) for text in texts]
    print(f"reference: {len(texts)} tickets in {time.perf_counter() - start:.0f} s")
    if cache:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "predictions": [vars(p) for p in predictions]}))
    return predictions


def timed(engine: Engine, encoded, plan) -> tuple[list[Prediction], float]:
    start = time.perf_counter()
    predictions, _ = engine.classify_encoded(encoded, plan)
    return predictions, time.perf_counter() - start


def compare(predictions: list[Prediction], refs: list[Prediction], tie: float) -> dict:
    ties = [r.margin < tie for r in refs]
    differs = [p.label != r.label for p, r in zip(predictions, refs, strict=True)]
    clear = len(refs) - sum(ties)
    real = sum(d and not t for d, t in zip(differs, ties, strict=True))
    errors = [max(abs(p.probs[k] - v) for k, v in r.probs.items()) for p, r in zip(predictions, refs, strict=True)]
    return {
        "agreement_non_tie": 1 - real / clear if clear else None,
        "real": real,
        "near_tie_flips": sum(d and t for d, t in zip(differs, ties, strict=True)),
        "near_ties": sum(ties),
        "mean_abs_dp": sum(errors) / len(errors),
        "max_abs_dp": max(errors),
    }


def cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "?"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in flags]
    return f"{name} ({' '.join(simd)}, {os.cpu_count()} cores)"


def table(rows: list[dict], header: str) -> str:
    lines = [
        header,
        "",
        "| variant | items/s | × float32 | non-near-tie agreement | real / near-tie flips | near-ties | "
        "mean \\|Δp\\| | max \\|Δp\\| | items/s each round |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = next((r["items_per_s"] for r in rows if r["variant"] == "float32"), None)
    for r in rows:
        ratio = f"{r['items_per_s'] / base:.2f}×" if base else "–"
        lines.append(
            f"| `{r['variant']}` | {r['items_per_s']:.2f} | {ratio} | {r['agreement_non_tie']:.1%} | "
            f"{r['real']} / {r['near_tie_flips']} | {r['near_ties']} | {r['mean_abs_dp']:.1e} | "
            f"{r['max_abs_dp']:.1e} | {' / '.join(f'{x:.2f}' for x in r['rounds'])} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.environ.get("TICKETQ_MODEL", "models/qwen2.5-0.5b-standin"))
    parser.add_argument("--tickets", type=int, default=200, help="synthetic tickets (default: 200, as the bench)")
    parser.add_argument("--seed", type=int, default=0, help="ticket seed (default: 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--variants", default="all", help="comma-separated names (default: all)")
    parser.add_argument("--tie-tolerance", type=float, default=0.01, help="near-tie margin (default: 0.01)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over all variants; items/s is the best")
    parser.add_argument("--warmup", type=int, default=8, help="shortest tickets run before timing (default: 8)")
    parser.add_argument("--reference-cache", type=Path, help="JSON file to keep the float32 reference answers in")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    parser.add_argument("--json", type=Path, help="write the rows and every variant's answers here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = load_engine(Settings(model=args.model, dtype="float32", device="cpu", threads=args.threads))
    builders = variants(engine.model.config.num_hidden_layers)
    names = list(builders) if args.variants == "all" else args.variants.split(",")
    texts = [t["text"] for t in generate_tickets(args.tickets, seed=args.seed)]
    key = {"model": str(Path(args.model).resolve()), "tickets": args.tickets, "seed": args.seed}
    refs = reference(engine, texts, args.reference_cache, key)
    encoded = engine.encode(texts)
    plan = engine.plan(encoded)  # one plan for every variant: only the linear kernels differ
    warm = sorted(encoded, key=lambda e: len(e.ids))[: args.warmup]
    rows, answers, load = {}, {}, os.getloadavg()[0]
    for _ in range(args.repeat):  # round-robin, so that a busy spell on a shared machine hits every variant
        for name in names:
            variant = copy.copy(engine)  # same model, prompt, prefix cache, label head
            variant.decoder = builders[name](engine.float_decoder)
            variant.classify_encoded(warm)
            predictions, seconds = timed(variant, encoded, plan)
            rate = len(texts) / seconds
            if name in rows:
                rows[name]["items_per_s"] = max(rows[name]["items_per_s"], rate)
                rows[name]["rounds"].append(rate)
                continue
            rows[name] = {"variant": name, "items_per_s": rate, "rounds": [rate]}
            rows[name] |= compare(predictions, refs, args.tie_tolerance)
            answers[name] = [{"label": p.label, "margin": p.margin} for p in predictions]
            print(table([rows[name]], name).splitlines()[-1], flush=True)
    rows = list(rows.values())
    header = (
        f"{len(texts)} synthetic tickets (seed {args.seed}), {args.model}, {args.threads} torch thread(s), "
        f"one plan ({len(plan.batches)} forwards, budget {engine.max_batch_tokens} tokens), items/s the best of "
        f"{args.repeat} round(s), torch {torch.__version__}"
        f" ({torch.backends.quantized.engine} quantized engine); CPU: {cpu_name()}; "
        f"load average {load:.2f} → {os.getloadavg()[0]:.2f}; near-tie = reference margin < {args.tie_tolerance:g}"
    )
    text = table(rows, header)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        reference_answers = [{"label": r.label, "margin": r.margin} for r in refs]
        payload = {"header": header, "rows": rows, "reference": reference_answers, "answers": answers}
        args.json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
