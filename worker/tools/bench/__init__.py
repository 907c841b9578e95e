"""`ticketq bench`: one model, one ticket list, every way of classifying it, side by side.

The model is loaded once and each mode classifies the same tickets, one mode after another in
this process (warm-up first, torch threads set once):

- `generate`      what a newcomer writes: chat template + `model.generate` (4 new tokens, greedy)
                  per ticket, the label parsed from the decoded text. Off by default (slowest).
- `sequential`    the article's baseline and everyone's reference: one ticket at a time, full
                  prompt, constrained label scoring (`Engine.reference`).
- `naive`         fixed-size batches in arrival order, padded to the batch's longest, full prompt.
- `naive-global`  the same, every batch padded to the longest ticket of all (the article's 70%).
- `sorted`        the article's method: length-sorted fixed-size batches, full prompt.
- `ticketq`       the engine: autotuned cost model, DP plan, prefix KV cache, label-only head.
- `ticketq-int8`  the same with the decoder's linear layers in dynamic int8 (inexact; opt-in).
- `ticketq-queue` the same end to end: Redis, a real worker process, the producer API.
- `llama-cpp`     the CPU peer: llama.cpp (llama-cpp-python) on the same model in GGUF f32,
                  prompt cache, one ticket at a time, label from the answer-position logits.
- `llama-cpp-q8`  the same in GGUF q8_0 (llama.cpp's 8-bit weights). Both opt-in, `worker.tools.peers`.

Per mode: items/s, speedup over `sequential`, padding ratio (pad / tokens actually computed, so
the full-prompt modes count the prefix they re-run), agreement with `sequential`, max |Δprob|,
disagreements split into near-ties (reference margin below `--tie-tolerance`) and the rest, and
peak RSS. Output: a rich table, `--json`, `--chart`, `--markdown`.

Modules, each one job:

- `cli`        the typer command: options and help, `Options` built, the exit status.
- `records`    plain records shared by the others: mode names, `Options`, `Answer`, `ModeResult`.
- `runner`     set-up (tickets, settings, engine, autotune) and how each mode runs and is timed,
               the queue mode's worker process included (`worker.tools.procs`).
- `baselines`  sequential, full-prompt batches and generate: calls into the engine's scoring
               (`Engine.reference`, `Engine.full_prompt_batch`, `Engine.generate`), no tensors.
- `report`     statistics per mode, the run's header, the table, Markdown, JSON and the chart.
"""
