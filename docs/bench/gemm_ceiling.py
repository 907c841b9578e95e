"""How fast this CPU multiplies the decoder's weights, per dtype: the ceiling for a CPU path that
computes every token.

    .venv/bin/python docs/bench/gemm_ceiling.py [threads] [--dtypes float32,bfloat16,int8]
        [--rows 64,128,256,512,1024] [--repeats 5] [--json FILE]

Times the GEMMs of one Qwen2.5-0.5B decoder layer (q, k, v, o, gate, up, down projections) for M
token rows, best of 5, through each kernel a dtype can run on:

- float32: torch's default `linear` (MKL), and oneDNN on prepacked weights (`PackedLinear`, what
  `TICKETQ_MATMUL=onednn` runs);
- bfloat16: torch's `linear` on bf16 weights (on a CPU with native bf16 torch hands the GEMM to
  oneDNN with the plain weight, which oneDNN's kernel re-lays inside every call), and oneDNN on
  bf16 weights prepacked once (`PackedLinear` on a bf16 linear: what the engine runs there,
  `pack_bf16_linears`);
- int8: torch's dynamic int8 linear as `TICKETQ_DTYPE=int8` builds it (`quantize_linears_int8`:
  per-channel int8 weights, activations quantised per call, `mlp.down_proj` left in float32, here
  on oneDNN as `TICKETQ_MATMUL=onednn` has it), and the same with all seven in int8 (the int8
  kernel alone). GFLOPS counts the same 2 x M x K x N as for floats.

For each M the kernels run one after another (so a burst of load on a shared machine hits
neighbouring figures alike), and the whole model's ceiling is printed beside each: the tokens/s at
which the decoder's linear layers alone would take all the time (2 x linear parameters FLOPs per
token; attention, norms and the label head left out), to hold against `ticketq bench`'s tokens/s.
A large square GEMM per dtype is the machine's practical peak for torch's default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from worker.engine.int8 import INT8_FLOAT_LINEARS, int8_full_range, quantize_linears_int8
from worker.engine.kernels import PackedLinear, full_range_dynamic_linear
from worker.engine.probes import cpu_flags

HIDDEN, INTER, KV, LAYERS = 896, 4864, 128, 24  # Qwen2.5-0.5B
NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
SHAPES = ((HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN),
          (HIDDEN, INTER))  # fmt: skip  (out, in) of each, in NAMES' order
LAYER_PARAMS = sum(out * inp for out, inp in SHAPES)
MODEL_PARAMS = LAYER_PARAMS * LAYERS  # the decoder's linear layers
DTYPES = ("float32", "bfloat16", "int8")


def best_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()  # warm-up (oneDNN/MKL/fbgemm pick their kernels, oneDNN builds its primitive)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def dense_layer(dtype: torch.dtype) -> torch.nn.Module:
    """One decoder layer's seven linears (seeded random weights) under their Qwen2 names."""
    torch.manual_seed(0)
    layer = torch.nn.Module()
    for name, (out, inp) in zip(NAMES, SHAPES, strict=True):
        parent, _, attr = name.partition(".")
        if not hasattr(layer, parent):
            layer.add_module(parent, torch.nn.Module())
        linear = torch.nn.Linear(inp, out, bias=False).requires_grad_(False)
        getattr(layer, parent).add_module(attr, linear.to(dtype))
    return layer


def linears(layer: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.get_submodule(name) for name in NAMES]


def packed(layer: torch.nn.Module) -> list[torch.nn.Module]:
    return [PackedLinear(module) for module in linears(layer)]


def int8_as_ticketq(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """What `TICKETQ_DTYPE=int8` runs: dynamic int8 but `INT8_FLOAT_LINEARS`, those float32 on oneDNN."""
    for name in INT8_FLOAT_LINEARS:  # the float32 model's linears are oneDNN-packed where that is faster
        parent, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(parent), attr, PackedLinear(layer.get_submodule(name)))
    return linears(quantize_linears_int8(layer))


def int8_all(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """All seven in the same dynamic int8 as `int8_as_ticketq` (per-channel weights, 8-bit activations where VNNI)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    cls = full_range_dynamic_linear() if int8_full_range() else DynamicLinear
    out = []
    for module in linears(layer):
        module.qconfig = per_channel_dynamic_qconfig
        out.append(cls.from_float(module))
    return out


def kernels(dtypes: list[str]) -> list[tuple[str, str, torch.dtype, list[torch.nn.Module]]]:
    """(dtype, kernel, activation dtype, the seven modules) for every kernel of `dtypes` this torch has."""
    onednn = PackedLinear.available()
    found = []
    if "float32" in dtypes:
        found.append(("float32", "torch linear (MKL)", torch.float32, linears(dense_layer(torch.float32))))
        if onednn:
            found.append(("float32", "oneDNN, prepacked", torch.float32, packed(dense_layer(torch.float32))))
    if "bfloat16" in dtypes:
        found.append(("bfloat16", "torch linear", torch.bfloat16, linears(dense_layer(torch.bfloat16))))
        if onednn:
            found.append(("bfloat16", "oneDNN, prepacked", torch.bfloat16, packed(dense_layer(torch.bfloat16))))
    if "int8" in dtypes:
        if onednn:
            found.append(("int8", "dynamic int8, down_proj float32 (TICKETQ_DTYPE=int8)", torch.float32,
                          int8_as_ticketq(dense_layer(torch.float32))))  # fmt: skip
        found.append(("int8", "dynamic int8, all seven", torch.float32, int8_all(dense_layer(torch.float32))))
    return found


def time_layer(modules: list[torch.nn.Module], rows: int, dtype: torch.dtype, repeats: int) -> float:
    x = torch.randn(rows, HIDDEN).to(dtype)  # (M, hidden)
    h = torch.randn(rows, INTER).to(dtype)  # (M, intermediate): down_proj's input

    def layer() -> None:
        with torch.inference_mode():
            for module in modules[:-1]:
                module(x)
            modules[-1](h)

    return best_seconds(layer, repeats)


def square_gflops(dtype: torch.dtype, n: int = 2048) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b)) / 1e9


def machine(threads: int) -> dict:
    model = next((line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or platform.machine())  # fmt: skip
    flags = [name for name in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "avx2", "fma")
             if name in cpu_flags()]  # fmt: skip
    return {"cpu": model, "flags": flags, "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("threads", nargs="?", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--rows", default="64,128,256,512,1024", help="token rows M, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timings per figure, the best kept")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if unknown := set(dtypes) - set(DTYPES):
        parser.error(f"--dtypes: unknown {', '.join(sorted(unknown))} (known: {', '.join(DTYPES)})")
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    info = machine(args.threads)
    load_start = os.getloadavg()
    print(f"machine: {info['cpu']}, {' '.join(info['flags'])}, {info['cores']} cores, {args.threads} torch "
          f"threads, torch {torch.__version__}, load average {' '.join(f'{x:.2f}' for x in load_start)}")  # fmt: skip
    gflop = 2 * MODEL_PARAMS / 1e9
    print(f"decoder linear layers: {MODEL_PARAMS / 1e6:.0f} M parameters = {gflop:.2f} GFLOP per token\n")
    found = kernels(dtypes)
    results = []
    for rows in rows_list:  # every kernel at one M, side by side
        for dtype, kernel, act, modules in found:
            seconds = time_layer(modules, rows, act, args.repeats)
            gflops = 2 * rows * LAYER_PARAMS / seconds / 1e9
            results.append({"dtype": dtype, "kernel": kernel, "rows": rows, "layer_ms": seconds * 1e3,
                            "gflops": gflops, "ceiling_tokens_s": gflops * 1e9 / (2 * MODEL_PARAMS),
                            "load_average": os.getloadavg()[0]})  # fmt: skip
    print("| dtype | kernel | token rows M | one layer's 7 GEMMs, ms | GFLOPS | ceiling, tokens/s (linears only) |")
    print("|---|---|---|---|---|---|")
    for dtype, kernel, _, _ in found:
        for r in (r for r in results if (r["dtype"], r["kernel"]) == (dtype, kernel)):
            print(f"| {dtype} | {kernel} | {r['rows']} | {r['layer_ms']:.2f} | {r['gflops']:.0f} | "
                  f"{r['ceiling_tokens_s']:.0f} |")  # fmt: skip
    squares = {d: square_gflops(getattr(torch, d)) for d in dtypes if d != "int8"}
    if squares:
        print("\nsquare 2048 x 2048 x 2048 GEMM (torch.mm): "
              + ", ".join(f"{d} {g:.0f} GFLOPS" for d, g in squares.items()))  # fmt: skip
    load_end = os.getloadavg()
    print(f"load average at the end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": info, "load_average": {"start": load_start, "end": load_end},
            "repeats": args.repeats, "model_linear_params": MODEL_PARAMS, "gflop_per_token": gflop,
            "results": results, "square_2048_gflops": squares,
        }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
