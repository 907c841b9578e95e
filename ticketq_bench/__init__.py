"""`ticketq bench`: one model, one ticket list, every way of classifying it, side by side.

The model is loaded once and each mode classifies the same tickets, the modes interleaved in
rounds (A B C A B C …, `--rounds`, 3 by default; a warm-up first each time, torch threads set
once); the peers run in processes of their own:

- `generate`      what a newcomer writes: chat template + `model.generate` (4 new tokens, greedy)
                  per ticket, the label parsed from the decoded text. Off by default.
- `sequential`    the article's baseline and everyone's reference: one ticket at a time, full
                  prompt, constrained label scoring (`Engine.reference`).
- `naive`         fixed-size batches in arrival order, padded to the batch's longest, full prompt.
- `naive-global`  the same, every batch padded to the longest ticket of all.
- `sorted`        the article's method: length-sorted fixed-size batches, full prompt.
- `ticketq`       the engine: autotuned cost model, DP plan, prefix KV cache, label-only head.
- `ticketq-int8`  the same with the decoder's linear layers in dynamic int8 (inexact; opt-in).
- `ticketq-queue` the same end to end: Redis, a real worker process, the producer API.
- `llama-cpp`     the CPU peer: llama.cpp (llama-cpp-python) on the same model in GGUF f32,
                  prompt cache, one ticket at a time, label from the answer-position logits.
- `llama-cpp-q8`  the same in GGUF q8_0 (llama.cpp's 8-bit weights). Both opt-in, `ticketq_bench.llama_cpp_peer`.
- `openvino`      the CPU peer OpenVINO on the same model (converted to its IR once), the prefix's KV
                  computed once, length-sorted batches, label from the answer-position logits, float32.
- `openvino-bf16` the same with `INFERENCE_PRECISION_HINT` bf16.
- `openvino-int8` the same in float32 with int8 weights (NNCF `compress_weights`). All three opt-in.
- `one-field`, `fields`, `full-prompts`, `one-schema`, `schemas`: a schema's fields (`--schema`): its
                  first field alone, every field in one pass, a full prompt per field; a worker
                  serving the schema alone, and three at once (`ticketq_bench.multifield`). Opt-in.

Per mode: the median items/s over the rounds and their range (min–max), speedup over its baseline
(the ratio of the medians: `sequential`, or for the schema modes `one-field` and `one-schema`),
padding ratio (pad / tokens actually computed, so the full-prompt modes count the prefix they
re-run), agreement with `sequential` (the schema modes: with their own per-field reference), max
|Δprob|, disagreements split into near-ties (reference margin below `--tie-tolerance`) and the rest, peak
RSS, and whether the answers were the same in every round; the load average at each round's start.
Output: a rich table, `--json` and `--markdown` (rewritten after every mode: a killed run keeps
what finished), `--chart`. A peer whose process dies is a row with the reason ("crashed: signal
11 (SIGSEGV)"), never the run's end.

Modules, each one job:

- `cli`        the typer command: options and help, `Options` built, the exit status.
- `records`    plain records shared by the others: mode names, `Options`, `Answer`, `ModeResult`, `Bench`.
- `runner`     set-up (tickets, settings, engine, autotune) and the modes run round after round.
- `modes`      how each mode runs and is timed: in this process, a peer beside it, or through the
               queue to a worker process (`procs`).
- `peer_process` a peer mode in a spawned process of its own, and how its death is told.
- `memory`     peak RSS per mode.
- `baselines`  sequential (`Engine.reference`), full-prompt batches and generate, scored with the
               engine's scoring (`worker.engine.scoring`).
- `multifield` the schema modes: their FieldsEngines or SchemaSet, each checked against the
               per-field reference (`FieldsEngine.reference`).
- `figures`    a row of figures per mode (medians, ranges, speedup, agreement), `--strict`'s verdict.
- `header`     the run's header (machine, load, versions, model, planner) and the notes under the table.
- `report`     the rich table, Markdown, JSON and the chart, each file replaced whole.
- `ceiling`    the linear layers' ceiling at a batch's size, beside the engine's tokens/s.
- `peers`      what the peers share (the prompt as plain data, constrained scoring) and the OpenVINO runner.
- `llama_cpp_peer` the llama.cpp runner: GGUF conversion, the prompt-cached scorer.

Beside the bench, in this package because they measure the same way:

- `loadtest`   `ticketq loadtest`: open-loop Poisson arrivals through Redis and a real worker.
- `procs`      a `ticketq worker` subprocess started, waited for and stopped; free ports; `/metrics`
               scraping (the bench's queue mode, the load test, the demo, the tests).
"""
