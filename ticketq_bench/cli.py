"""`ticketq bench` on the command line (typer): the options and their help, and the exit status.

`ticketq_cli/cli.py` forwards `ticketq bench ARGS` to `main(ARGS)`, so that `ticketq` itself starts
without loading the benchmark; nothing here imports torch (`--help` stays instant).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from ticketq.cli import CONTEXT_SETTINGS, plain_metavars
from ticketq.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from ticketq_bench.figures import strict_failure, summarise
from ticketq_bench.header import make_header
from ticketq_bench.procs import ROOT
from ticketq_bench.records import DEFAULT_MODES, DEFAULTS, FIELD_MODES, MODES, QUICK, SCHEMA_MODES, Options
from ticketq_bench.report import print_report, write_outputs
from ticketq_bench.runner import load_tickets, run_modes, setup

PROG = "ticketq bench"
DEFAULT_SCHEMA = ROOT / "examples" / "schema.toml"
DESCRIPTION = (
    "Load one model once and classify the same tickets in every mode below, the modes "
    "interleaved in rounds. Per mode: median items/s over the rounds and their range, speedup over "
    "sequential, padding ratio (pad / tokens computed), tokens computed per ticket and tokens/s "
    "(where the time goes), agreement and max |delta prob| against sequential, disagreements "
    "on near-ties and on the rest, peak RSS. A rich table on stdout; optionally JSON and "
    "Markdown (rewritten after every mode) and a PNG chart."
)
MODE_HELP = """\
modes (run in this order on the same tickets, round after round):
  generate       chat template + model.generate (4 new tokens, greedy) per
                 ticket, label parsed from the text
  sequential     one ticket at a time, full prompt, constrained label
                 scoring (Engine.reference) = reference
  naive          fixed-size batches in arrival order, padded to the batch's
                 longest, full prompt per row
  naive-global   the same, every batch padded to the longest ticket of all
  sorted         length-sorted fixed-size batches, full prompt per row (the
                 article's method)
  ticketq        the engine: autotuned cost model, DP plan, prefix KV cache,
                 label-only head, duplicates computed once (float32 unless
                 --dtype says otherwise)
  ticketq-checked
                 the same in the precision TICKETQ_DTYPE=auto picks here
                 (bfloat16 or int8), answers within its measured error
                 bound re-checked in float32 (skipped where nothing beats
                 float32)
  ticketq-bf16   the same in bfloat16, unchecked (inexact)
  ticketq-int8   the same, decoder linear layers in dynamic int8, unchecked
                 (inexact, CPU; TICKETQ_DTYPE=int8 TICKETQ_RECHECK=never)
  ticketq-nodedup
                 ticketq computing every ticket, duplicates too
                 (TICKETQ_DEDUP=false; see --duplicates)
  ticketq-queue  the same through Redis and a real `ticketq worker` process
                 (skipped if Redis is down)
  llama-cpp      llama.cpp on the same model in GGUF f32: prompt cache, one
                 ticket at a time, the engine's token ids, label from the
                 answer-position logits (needs pip install 'ticketq[peers]')
  llama-cpp-q8   the same in GGUF q8_0
  openvino       OpenVINO on the same model (IR converted once), the
                 prefix's KV computed once, length-sorted batches, label
                 from the answer-position logits, float32 (needs
                 pip install 'ticketq[openvino]')
  openvino-bf16  the same with INFERENCE_PRECISION_HINT bf16
  openvino-int8  the same in float32, int8 weights (NNCF compress_weights)
  one-field      a schema's first field alone (--schema, default
                 examples/schema.toml), its labels in the system prompt
  fields         every field of the schema in one pass per ticket
                 (Engine.fields)
  full-prompts   a full prompt per field: each field alone, every ticket
  one-schema     a worker's SchemaSet serving the schema alone
  schemas        a SchemaSet serving 3 schemas at once (the schema and two
                 variants, each its own cached prefix), tickets round-robin

Default: every mode but generate, ticketq-bf16, ticketq-int8,
ticketq-nodedup, the peers (llama-cpp*, openvino*) and the schema modes:
list them, or --modes all; --schema alone runs one-field, fields and
full-prompts. A mode's baseline always runs with it: sequential (the
reference for agreement, the baseline for speedup),
one-field for fields and full-prompts (their cost ratio), one-schema for
schemas. The schema modes are checked against their own per-field
reference on --reference-tickets tickets. Each peer runs in a process of
its own: a crash there is that mode's row, not the run's end.
--quick = {tickets} tickets, batch size {batch_size}, {warmup} warm-up ticket, a {autotune_s:.0f} s autotune,
{rounds} round, no generate; explicit options still win.
"""  # lines under 78 characters: the help is printed 80 wide where there is no terminal
# Help panels: the option groups of `--help`.
MODEL, TICKETS, RUN, OUTPUT = "model (defaults come from the TICKETQ_* settings)", "tickets", "run", "output"


class Dtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    int8 = "int8"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


def _modes(value: str | None) -> tuple[str, ...] | None:
    """`--modes a,b` or `all` as a tuple of known modes; None when not given (the default set)."""
    if value is None:
        return None
    wanted = [m.strip() for m in value.split(",") if m.strip()]
    if wanted == ["all"]:
        return MODES
    unknown = [m for m in wanted if m not in MODES]
    if unknown or not wanted:
        raise typer.BadParameter(f"unknown {unknown or 'empty list'}; choose from {', '.join(MODES)} or 'all'")
    return tuple(wanted)


# One alias per option, by help panel: the command's signature below is one line per option.
# model
ModelOpt = Annotated[str | None, typer.Option(metavar="ID|DIR", rich_help_panel=MODEL,
                     help="hub id or local directory (default: TICKETQ_MODEL)")]  # fmt: skip
DtypeOpt = Annotated[Dtype | None, typer.Option(rich_help_panel=MODEL, help="the precision of ticketq and every "
                     "mode built on it, unchecked (default: float32; ticketq-checked adds auto's)")]  # fmt: skip
DeviceOpt = Annotated[Device | None, typer.Option(rich_help_panel=MODEL, help="(default: TICKETQ_DEVICE)")]
ThreadsOpt = Annotated[int | None, typer.Option(metavar="N", min=1, rich_help_panel=MODEL,
                       help="torch threads, set once for every mode")]  # fmt: skip
# tickets
TicketsOpt = Annotated[int | None, typer.Option(metavar="N", min=1, rich_help_panel=TICKETS,
                       help="how many (default: 600; with a file: all)")]  # fmt: skip
TicketsFileOpt = Annotated[Path | None, typer.Option(metavar="PATH", rich_help_panel=TICKETS,
                           help="JSONL {id, text} (or CSV) instead of synthetic long-tail tickets")]  # fmt: skip
SeedOpt = Annotated[int, typer.Option(metavar="SEED", show_default=False, rich_help_panel=TICKETS,
                    help="synthetic ticket seed (default: 0)")]  # fmt: skip
DuplicatesOpt = Annotated[float, typer.Option(metavar="SHARE", min=0.0, max=0.95, show_default=False,
                          rich_help_panel=TICKETS, help="this share of the synthetic tickets repeats another's "
                          "text exactly, in a seeded order (default: 0); compare ticketq-nodedup")]  # fmt: skip
# run
ModesOpt = Annotated[str | None, typer.Option(metavar="LIST", callback=_modes, rich_help_panel=RUN,
                     help="comma-separated modes, or 'all' (default: all but generate)")]  # fmt: skip
BatchSizeOpt = Annotated[int | None, typer.Option(metavar="N", min=1, rich_help_panel=RUN,
                         help="rows per batch in naive, naive-global, sorted (default: 16)")]  # fmt: skip
MaxBatchTokensOpt = Annotated[int | None, typer.Option(metavar="N", min=1, rich_help_panel=RUN,
                              help="ticketq's padded-token budget; given, autotune is skipped")]  # fmt: skip
NoAutotuneOpt = Annotated[bool, typer.Option("--no-autotune", rich_help_panel=RUN,
                          help="plan with the TICKETQ_COST_* model as configured")]  # fmt: skip
AutotuneSOpt = Annotated[float | None, typer.Option(metavar="S", rich_help_panel=RUN,
                         help="autotune measuring budget (default: 20)")]  # fmt: skip
WarmupOpt = Annotated[int | None, typer.Option(metavar="N", min=0, rich_help_panel=RUN,
                      help="warm-up tickets per mode and round, the shortest (default: 4)")]  # fmt: skip
RoundsOpt = Annotated[int | None, typer.Option(metavar="N", min=1, rich_help_panel=RUN,
                      help="rounds of every mode, interleaved; the median is shown (default: 3; "
                      "1 with --quick or the reference alone)")]  # fmt: skip
TieToleranceOpt = Annotated[float, typer.Option(metavar="P", min=0.0, show_default=False, rich_help_panel=RUN,
                            help="a reference margin below this is a near-tie (default: 0.01)")]  # fmt: skip
SchemaOpt = Annotated[Path | None, typer.Option(metavar="PATH", rich_help_panel=RUN, help=(
    "the schema (TOML) of the schema modes (default: examples/schema.toml); alone, it runs "
    "one-field, fields and full-prompts"))]  # fmt: skip
ReferenceTicketsOpt = Annotated[int, typer.Option(metavar="N", min=0, show_default=False, rich_help_panel=RUN,
                                help="tickets the schema modes are checked on against their per-field "
                                "reference (default: 20; 0: none)")]  # fmt: skip
LlamaCppSrcOpt = Annotated[Path | None, typer.Option(metavar="DIR", rich_help_panel=RUN, help=(
    "llama.cpp source tree with convert_hf_to_gguf.py (default: from the llama-cpp-python sdist)"))]  # fmt: skip
QuickOpt = Annotated[bool, typer.Option("--quick", rich_help_panel=RUN,
                     help="a short run for a slow machine (see below)")]  # fmt: skip
StrictOpt = Annotated[bool, typer.Option("--strict", rich_help_panel=RUN,
                      help="exit 1 on any disagreement that is not a near-tie")]  # fmt: skip
# output
JsonOpt = Annotated[Path | None, typer.Option(metavar="PATH", rich_help_panel=OUTPUT,
                    help=escape("write [header, one object per mode] as JSON"))]  # fmt: skip
ChartOpt = Annotated[Path | None, typer.Option(metavar="PATH", rich_help_panel=OUTPUT,
                     help="write a PNG: items/s and padding ratio per mode")]  # fmt: skip
MarkdownOpt = Annotated[Path | None, typer.Option(metavar="PATH", rich_help_panel=OUTPUT,
                        help="write the table as Markdown (for a README)")]  # fmt: skip

app = typer.Typer(add_completion=False, context_settings=CONTEXT_SETTINGS, pretty_exceptions_enable=False)


@app.command(help=escape(DESCRIPTION), epilog=escape(MODE_HELP.format(**QUICK)))
def bench(
    ctx: typer.Context,
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    threads: ThreadsOpt = None,
    tickets: TicketsOpt = None,
    tickets_file: TicketsFileOpt = None,
    seed: SeedOpt = 0,
    duplicates: DuplicatesOpt = 0.0,
    modes: ModesOpt = None,
    batch_size: BatchSizeOpt = None,
    max_batch_tokens: MaxBatchTokensOpt = None,
    no_autotune: NoAutotuneOpt = False,
    autotune_s: AutotuneSOpt = None,
    warmup: WarmupOpt = None,
    rounds: RoundsOpt = None,
    tie_tolerance: TieToleranceOpt = 0.01,
    schema: SchemaOpt = None,
    reference_tickets: ReferenceTicketsOpt = 20,
    llama_cpp_src: LlamaCppSrcOpt = None,
    quick: QuickOpt = False,
    strict: StrictOpt = False,
    json: JsonOpt = None,
    chart: ChartOpt = None,
    markdown: MarkdownOpt = None,
) -> None:
    raise typer.Exit(run(options_from(ctx.params, ctx.obj or [])))


def options_from(params: dict[str, Any], argv: Sequence[str]) -> Options:
    """The parsed options as an `Options`, every default resolved (`--quick` picks the short ones)."""
    defaults = QUICK if params["quick"] else DEFAULTS
    tickets = params["tickets"]
    if tickets is None and params["tickets_file"] is None:  # with a file and no --tickets: all of its rows
        tickets = defaults["tickets"]
    requested = params["modes"] or (FIELD_MODES if params["schema"] else DEFAULT_MODES)
    schema = params["schema"]
    if schema is not None and not set(requested) & {*FIELD_MODES, *SCHEMA_MODES}:
        raise typer.BadParameter(f"--schema is for the modes {', '.join((*FIELD_MODES, *SCHEMA_MODES))}; "
                                 "none of them is listed")  # fmt: skip
    if schema is None and set(requested) & {*FIELD_MODES, *SCHEMA_MODES}:
        schema = DEFAULT_SCHEMA
    given = {name: params[name] for name in ("batch_size", "warmup", "autotune_s")}
    options = Options(
        model=params["model"],
        dtype=params["dtype"].value if params["dtype"] else None,
        device=params["device"].value if params["device"] else None,
        threads=params["threads"],
        tickets=tickets,
        tickets_file=params["tickets_file"],
        seed=params["seed"],
        duplicates=params["duplicates"],
        requested_modes=requested,  # the default set has no generate, --quick or not
        **{name: defaults[name] if value is None else value for name, value in given.items()},
        max_batch_tokens=params["max_batch_tokens"],
        no_autotune=params["no_autotune"],
        tie_tolerance=params["tie_tolerance"],
        schema=schema,
        reference_tickets=params["reference_tickets"],
        llama_cpp_src=params["llama_cpp_src"],
        quick=params["quick"],
        strict=params["strict"],
        json=params["json"],
        chart=params["chart"],
        markdown=params["markdown"],
        command=shlex.join(["ticketq", "bench", *argv]),
    )
    rounds = params["rounds"] or (defaults["rounds"] if len(options.mode_list) > 1 else 1)
    return replace(options, rounds=rounds)


def parse_args(argv: Sequence[str]) -> Options:
    """The options `ticketq bench ARGV` would run with, without running (typer.BadParameter if invalid)."""
    ctx = typer.main.get_command(app).make_context(PROG, list(argv))
    return options_from(ctx.params, argv)


def run(options: Options) -> int:
    """Load, run every mode, report; 0 done, 1 a real disagreement or unstable answer under --strict, 2 bad input."""
    console = Console()
    if not console.is_terminal:  # files and pipes: wide enough for the whole table
        console.width = max(console.width, 120)
    tickets = load_tickets(options, console)
    bench = setup(options, console) if tickets is not None else None
    if bench is None:
        return EXIT_USAGE

    def write_so_far(results: list) -> None:  # after every mode: a killed run keeps what finished
        rows = [summarise(result, results, options.tie_tolerance) for result in results]
        write_outputs(options, make_header(bench, tickets, rows, finished=False), rows, None, chart=False)

    results = run_modes(bench, tickets, console, after_mode=write_so_far if options.json or options.markdown else None)
    rows = [summarise(result, results, options.tie_tolerance) for result in results]
    header = make_header(bench, tickets, rows)
    print_report(console, header, rows)
    write_outputs(options, header, rows, console)
    return EXIT_FAILED if options.strict and strict_failure(rows) else EXIT_OK


def command() -> Any:
    """`app` as a click command, its help in click's words (a flag shows no `<bool>`: `ticketq.cli.plain_metavars`)."""
    built = typer.main.get_command(app)
    plain_metavars(built)
    return built


def main(argv: Sequence[str] | None = None) -> int:
    """`ticketq bench ARGV`; the exit status (0 ok, 1 --strict failure, 2 bad options or setup)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        command()(argv, prog_name=PROG, obj=argv)  # obj: the command as typed, for the report
    except SystemExit as exc:  # click's standalone mode ends every run, good or bad, in SystemExit
        return 0 if exc.code is None else int(exc.code)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
