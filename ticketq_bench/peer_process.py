"""Each peer mode in a process of its own, so that a crash in a native library is that mode's row, not the run's end.

`PeerProcess` starts a spawned child for one peer mode (llama.cpp, OpenVINO). The child loads
the peer once (converting the model first where no cached copy exists) and then runs one round
per request from the bench: a warm-up on the shortest tickets, then every ticket timed, the
answers, reports, seconds and its own peak RSS sent back. The tickets travel as the engine's
token ids (`EncodedTicket`) and the prompt as a `PeerPrompt`, so the peer scores exactly the
engine's tokens. Messages on the pipe, child to parent: `("ready", notes)`, `("skipped", reason)`,
`("failed", reason)`, `("progress", tickets)`, `("round", answers, reports, seconds, peak_rss_mb)`;
parent to child: `"round"` or `"stop"`.

A child that dies (a signal, `os._exit`) ends nothing but its mode: `PeerCrashed` says how it
died ("crashed: signal 11 (SIGSEGV)"). `TICKETQ_TEST_PEER_CRASH=MODE[@ROUND]` (test-only) makes
the child of MODE kill itself with SIGSEGV at its start (before the peer loads) or at the start
of round ROUND; a comma-separated list names several.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ticketq.errors import TicketqError
from ticketq_bench.memory import peak_rss_mb, reset_peak_rss
from ticketq_bench.peers import PeerPrompt, PeerUnavailable
from ticketq_bench.records import Answer
from worker.engine.prompt import EncodedTicket
from worker.results import BatchReport

# mode -> (peer, variant): the GGUF type for llama.cpp, the inference precision (or int8 weights) for OpenVINO
PEER_MODES = {
    "llama-cpp": ("llama-cpp", "f32"),
    "llama-cpp-q8": ("llama-cpp", "q8_0"),
    "openvino": ("openvino", "f32"),
    "openvino-bf16": ("openvino", "bf16"),
    "openvino-int8": ("openvino", "int8"),  # int8 weights (NNCF), float32 activations
}
CRASH_ENV = "TICKETQ_TEST_PEER_CRASH"
POLL_S = 0.2  # how often the parent looks whether a silent child is still alive


class PeerCrashed(TicketqError, RuntimeError):
    """The peer's process died; the message says how ("crashed: signal 11 (SIGSEGV)")."""


class PeerFailed(TicketqError, RuntimeError):
    """The peer raised in its process; the message is its error."""


@dataclass(frozen=True)
class PeerJob:
    """What a peer's process needs: the model, its threads, the prompt and the tickets as token ids."""

    mode: str
    model_dir: str
    cache_dir: str  # converted models are kept here (out/)
    threads: int
    prompt: PeerPrompt
    tickets: tuple[EncodedTicket, ...]
    warm: tuple[EncodedTicket, ...]
    batch_size: int  # rows per length-sorted batch, where the peer batches
    llama_cpp_src: str | None = None


@dataclass
class PeerRound:
    answers: list[Answer]
    reports: list[BatchReport]
    seconds: float
    peak_rss_mb: float | None


class PeerProcess:
    """The parent's side: start the child, wait until it is ready, run rounds, stop it."""

    def __init__(self, job: PeerJob) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch threads
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=child_main, args=(job, child_conn), name=f"bench-{job.mode}", daemon=True)
        self.process.start()
        child_conn.close()  # the child holds the only other end: EOF here when it dies

    def ready(self) -> list[str]:
        """The peer's notes once loaded; PeerUnavailable (skip), PeerFailed or PeerCrashed otherwise."""
        kind, payload = self._receive()
        if kind == "skipped":
            raise PeerUnavailable(payload[0])
        if kind == "failed":
            raise PeerFailed(payload[0])
        return payload[0]

    def run_round(self, progress: Callable[[int], None] | None = None) -> PeerRound:
        """One warm-up and one timed pass over every ticket in the child."""
        self.conn.send("round")
        kind, payload = self._receive(progress)
        if kind == "failed":
            raise PeerFailed(payload[0])
        return PeerRound(*payload)

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):  # the child is gone already
                self.conn.send("stop")
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()

    def _receive(self, progress: Callable[[int], None] | None = None) -> tuple[str, list]:
        """The child's next message but progress; PeerCrashed when it died first."""
        while True:
            try:
                if self.conn.poll(POLL_S):
                    kind, *payload = self.conn.recv()
                    if kind != "progress":
                        return kind, payload
                    if progress is not None:
                        progress(payload[0])
                    continue
            except (EOFError, OSError):  # the pipe closed: the child is gone or going
                self.process.join(timeout=10)
            if not self.process.is_alive():
                self.process.join()
                raise PeerCrashed(describe_exit(self.process.exitcode))


def describe_exit(code: int | None) -> str:
    """A dead child's exit code in words: "crashed: signal 11 (SIGSEGV)" or "crashed: exit status 3"."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"crashed: signal {-code} ({name})"
    return f"crashed: exit status {code}"


# ----- the child ----------------------------------------------------------------------------


def child_main(job: PeerJob, conn) -> None:
    """The peer's process: load once, then a warm-up and a timed pass per "round" until "stop"."""
    _crash_if_asked(job.mode, 0)
    try:
        scorer, notes = open_peer(job)
    except PeerUnavailable as exc:
        conn.send(("skipped", f"{job.mode} skipped: {exc}"))
        return
    except Exception as exc:  # the process boundary: any error becomes the mode's row
        conn.send(("failed", f"{job.mode} failed while loading: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", notes))
    rounds = 0
    while _next_request(conn) == "round":
        rounds += 1
        _crash_if_asked(job.mode, rounds)
        try:
            conn.send(("round", *_timed_round(scorer, job, conn)))
        except Exception as exc:  # as above
            conn.send(("failed", f"{job.mode} failed in round {rounds}: {type(exc).__name__}: {exc}"))
            return


def _next_request(conn) -> str:
    """The bench's next request; "stop" when the bench is gone (killed: its end of the pipe closed)."""
    try:
        return conn.recv()
    except (EOFError, OSError):
        return "stop"


def _timed_round(scorer, job: PeerJob, conn) -> tuple[list[Answer], list[BatchReport], float, float | None]:
    if job.warm:
        scorer.score_many(job.warm)
    reset_peak_rss()
    start = time.perf_counter()
    predictions, reports = scorer.score_many(job.tickets, lambda n: conn.send(("progress", n)))
    seconds = time.perf_counter() - start
    return [Answer.of(p) for p in predictions], reports, seconds, peak_rss_mb("self")


def open_peer(job: PeerJob):
    """The loaded scorer and its notes; PeerUnavailable where the peer cannot run here."""
    peer, variant = PEER_MODES[job.mode]
    if peer == "llama-cpp":
        return _open_llama_cpp(job, variant)
    return _open_openvino(job, variant)


def _open_llama_cpp(job: PeerJob, outtype: str):
    from ticketq_bench.llama_cpp_peer import LlamaCppScorer, gguf_model, llama_cpp_version

    version = llama_cpp_version()
    source = Path(job.llama_cpp_src) if job.llama_cpp_src else None
    path = gguf_model(Path(job.model_dir), outtype, Path(job.cache_dir), source)
    n_ctx = len(job.prompt.prefix_ids) + job.prompt.max_ticket_tokens + len(job.prompt.suffix_ids) + 16
    scorer = LlamaCppScorer(path, job.prompt, threads=job.threads, n_ctx=n_ctx)  # one context per mode
    note = (
        f"{job.mode}: llama-cpp-python {version}, {path.name}, {job.threads} threads, prompt cache of "
        f"{scorer.prefix_len} tokens, one ticket per decode call"
    )
    return scorer, [note]


def _open_openvino(job: PeerJob, variant: str):
    from ticketq_bench.peers import OpenVinoScorer, openvino_model, openvino_version

    version = openvino_version()
    weights, precision = ("int8", "f32") if variant == "int8" else ("f32", variant)
    xml = openvino_model(Path(job.model_dir), Path(job.cache_dir), weights)
    scorer = OpenVinoScorer(xml, job.prompt, job.threads, precision, job.batch_size)
    continued = (
        "; a label sharing its first tokens with another costs one more forward per branch, the ticket recomputed"
        if set(scorer.trie.branches) != {()}
        else ""
    )
    note = (
        f"{job.mode}: OpenVINO {version} on the CPU, the transformers model converted with openvino.convert_model "
        f"({'int8 weights by NNCF compress_weights INT8_ASYM' if weights == 'int8' else 'float32 IR'}), "
        f"INFERENCE_PRECISION_HINT {precision}"
        f"{'' if scorer.precision == precision else f' asked, {scorer.precision} run (no fast {precision} here)'}, "
        f"{job.threads} threads, the prefix's KV "
        f"({scorer.prefix_len} tokens) computed once and reused, length-sorted batches of {job.batch_size}, "
        f"full-vocabulary logits at the answer position{continued}"
    )
    return scorer, [note]


def _crash_if_asked(mode: str, round_no: int) -> None:
    """Test-only: die of SIGSEGV where TICKETQ_TEST_PEER_CRASH names this mode (and this round)."""
    for entry in filter(None, os.environ.get(CRASH_ENV, "").split(",")):
        name, _, at = entry.strip().partition("@")
        if name == mode and int(at or 0) == round_no:
            os.kill(os.getpid(), signal.SIGSEGV)
