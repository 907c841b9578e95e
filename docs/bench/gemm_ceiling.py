"""How fast this CPU multiplies the decoder's float32 weights: the ceiling for an exact CPU path.

    .venv/bin/python docs/bench/gemm_ceiling.py [threads]

Times float32 GEMMs on the shapes of one Qwen2.5-0.5B decoder layer (q, k, v, o, gate, up, down
projections) for M token rows, best of 5, through torch's default `linear` (MKL) and through
oneDNN on prepacked weights (`worker.engine.PackedLinear`, what `TICKETQ_MATMUL=onednn` runs), and
a large square GEMM as the machine's practical peak for torch's default. Prints GFLOPS per M and
what one token of the whole model costs at that speed (2 x parameters FLOPs per token, attention
left out), i.e. the most tokens/s any float32 path that computes every token could reach, to hold
beside `ticketq bench`'s tokens/s column.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import torch

from worker.engine.kernels import PackedLinear


def best_seconds(fn, repeats: int = 5) -> float:
    fn()  # warm-up (oneDNN/MKL pick their kernels)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else os.cpu_count() or 1
    torch.set_num_threads(threads)
    hidden, inter, kv, layers = 896, 4864, 128, 24  # Qwen2.5-0.5B
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden),
              (hidden, inter)]  # fmt: skip  (out, in) of q, k, v, o, gate, up, down
    weights = [torch.randn(out, inp) for out, inp in shapes]
    params = sum(out * inp for out, inp in shapes) * layers
    cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = [name for name in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "avx2", "fma") if name in cpuinfo]
    print(f"machine: {platform.processor() or platform.machine()}, {' '.join(flags)}, {os.cpu_count()} cores, "
          f"{threads} torch threads, torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"decoder linear layers: {params / 1e6:.0f} M parameters = {2 * params / 1e9:.2f} GFLOP per token\n")
    linears = [torch.nn.Linear(inp, out, bias=False).requires_grad_(False) for out, inp in shapes]
    for linear, weight in zip(linears, weights, strict=True):
        linear.weight.copy_(weight)
    kernels = {"torch (MKL)": linears}
    if PackedLinear.available():
        kernels["oneDNN, prepacked"] = [PackedLinear(linear) for linear in linears]
    print("| kernel | token rows M | one layer's 7 GEMMs, ms | GFLOPS | tokens/s at that speed (linear layers only) |")
    print("|---|---|---|---|---|")
    for name, modules in kernels.items():
        for rows in (64, 128, 256, 512, 1024):
            x = torch.randn(rows, hidden)
            h = torch.randn(rows, inter)

            def layer(x=x, h=h, modules=modules) -> None:
                with torch.inference_mode():
                    for module in modules[:-1]:
                        module(x)
                    modules[-1](h)

            seconds = best_seconds(layer)
            gflops = 2 * rows * params / layers / seconds / 1e9
            print(f"| {name} | {rows} | {seconds * 1e3:.2f} | {gflops:.0f} | {gflops * 1e9 / (2 * params):.0f} |")
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    seconds = best_seconds(lambda: torch.mm(a, b))
    print(f"\nsquare 2048 x 2048 x 2048 GEMM: {2 * 2048**3 / seconds / 1e9:.0f} GFLOPS")


if __name__ == "__main__":
    main()
