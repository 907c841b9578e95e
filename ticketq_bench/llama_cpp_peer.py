"""The llama.cpp peer of `ticketq bench`: llama-cpp-python on the same model in GGUF, the same tokens.

What a careful CPU user would run instead of ticketq: llama-cpp-python (the optional extra
`pip install 'ticketq[peers]'`) with the shared system-prompt prefix evaluated once and its KV
cache reused for every ticket, exactly as llama.cpp's server prompt cache does.

- `gguf_model` converts the local model directory to GGUF (f32 or q8_0) with llama.cpp's own
  `convert_hf_to_gguf.py`, taken from the installed llama-cpp-python's source distribution, and
  caches the file under `out/gguf/`.
- `LlamaCppScorer` scores tickets one at a time: `n_tokens` reset to the prefix length (the
  cache beyond it is dropped by `Llama.eval`), the engine's own ticket + suffix token ids
  evaluated (never text: the tokens are exactly the engine's), and the full-vocabulary logits
  at the answer position read from the context for every branch of the label trie; the same
  constrained scoring as `Engine.reference`.

Imports llama_cpp only when a scorer is built; only public llama-cpp-python API is used
(`Llama.eval`, `Llama.n_tokens`, `Llama.ctx`, `llama_get_logits_ith`).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ticketq_bench.peers import PeerPrompt, PeerUnavailable, Progress, cache_key, choice_logprobs, prediction_of
from worker.engine.prompt import EncodedTicket, PromptTemplate
from worker.results import BatchReport, Prediction

GGUF_TYPES = ("f32", "q8_0")
INSTALL_HINT = "pip install 'ticketq[peers]'"

# The Qwen2 converter tries sentencepiece first and only falls back to GPT-2 BPE on
# FileNotFoundError; without the sentencepiece package the import fails with ImportError instead.
CONVERT_SHIM = """\
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(1, sys.argv[1] + "/gguf-py")
import convert_hf_to_gguf
from conversion.qwen import Qwen2Model
if importlib.util.find_spec("sentencepiece") is None:
    Qwen2Model.set_vocab = Qwen2Model._set_vocab_gpt2
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version, or PeerUnavailable with the install hint."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise PeerUnavailable(f"llama-cpp-python is not installed ({INSTALL_HINT})")
    from importlib.metadata import version

    return version("llama-cpp-python")


def converter_dir(cache: Path, source: Path | None = None) -> Path:
    """A directory holding llama.cpp's `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/`.

    `source` (a `vendor/llama.cpp` checkout) wins; else the files are extracted once from the
    installed llama-cpp-python version's sdist (`pip download`), which vendors them, so the
    converter matches the library that reads the file.
    """
    if source is not None:
        if not (source / "convert_hf_to_gguf.py").is_file():
            raise PeerUnavailable(f"{source}: no convert_hf_to_gguf.py (expected a llama.cpp source tree)")
        return source
    ver = llama_cpp_version()
    target = cache / f"llama.cpp-convert-{ver}"
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        fetched = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
             f"llama-cpp-python=={ver}", "-d", tmp],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if fetched.returncode or not sdists:
            raise PeerUnavailable(f"cannot fetch the llama-cpp-python {ver} sdist for its GGUF converter: "
                                  f"{(fetched.stderr.strip().splitlines() or ['?'])[-1]}")  # fmt: skip
        _extract_converter(sdists[0], target)
    return target


def _extract_converter(sdist: Path, target: Path) -> None:
    marker = "/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            _, found, inner = member.name.partition(marker)
            if found and inner.startswith(CONVERTER_FILES) and (member.isfile() or member.isdir()):
                member.name = inner
                members.append(member)
        target.mkdir(parents=True, exist_ok=True)
        tar.extractall(target, members=members, filter="data")


def gguf_model(model_dir: Path, outtype: str, cache: Path, source: Path | None = None) -> Path:
    """`model_dir` converted to GGUF `outtype` (f32 or q8_0), cached by the model files' size and mtime."""
    if outtype not in GGUF_TYPES:
        raise ValueError(f"GGUF type must be one of {GGUF_TYPES}, got {outtype!r}")
    if not Path(model_dir, "config.json").is_file():
        raise PeerUnavailable(f"{model_dir} is not a local model directory; llama.cpp needs one to convert")
    out = cache / "gguf" / f"{cache_key(model_dir)}.{outtype}.gguf"
    if out.is_file():
        return out
    convert = converter_dir(cache, source)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    done = subprocess.run(
        [sys.executable, "-c", CONVERT_SHIM, str(convert), str(model_dir), "--outtype", outtype,
         "--outfile", str(partial)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode or not partial.is_file():
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise PeerUnavailable(f"GGUF conversion ({outtype}) failed: {tail}")
    partial.rename(out)
    return out


class LlamaCppScorer:
    """One llama.cpp context with the prompt prefix cached; tickets scored one at a time."""

    def __init__(self, gguf: Path, prompt: PromptTemplate | PeerPrompt, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.prompt = prompt
        self.trie = prompt.trie
        self.llm = Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=n_ctx,  # a whole ticket in one decode call
            n_ubatch=min(n_ctx, 512),
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )
        self.n_vocab = self.llm.n_vocab()
        self.llm.eval(list(prompt.prefix_ids))  # the prompt cache: evaluated once, kept in the KV cache
        self.prefix_len = self.llm.n_tokens

    def _eval(self, start: int, ids: Sequence[int]) -> None:
        """Evaluate `ids` after the first `start` cached tokens."""
        self.llm.n_tokens = start  # eval() drops the KV cache beyond this point, the prefix stays
        self.llm.eval(list(ids))

    def _choice(self, kids: Sequence[int]) -> list[float]:
        """Log-probs of `kids` at the last evaluated position, renormalised over them."""
        import llama_cpp
        import numpy as np

        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))
        return choice_logprobs(logits, kids)

    def score(self, encoded: EncodedTicket) -> tuple[Prediction, list[BatchReport]]:
        """The ticket's constrained label probabilities and one report per llama.cpp evaluation.

        The ticket is evaluated once after the cached prefix; the root is a branch only where the
        labels' first tokens differ, and every deeper branch continues after the ticket's tokens.
        """
        started = time.perf_counter()
        self._eval(self.prefix_len, encoded.ids)
        after_ticket = self.prefix_len + len(encoded.ids)
        branch = {}
        reports = [BatchReport(1, len(encoded.ids), len(encoded.ids), time.perf_counter() - started)]
        for path, kids in sorted(self.trie.branches.items(), key=lambda item: len(item[0])):  # root first
            started = time.perf_counter()
            if path:  # a shared label prefix: continue after the ticket's own tokens
                self._eval(after_ticket, path)
                reports.append(BatchReport(1, len(path), len(path), time.perf_counter() - started))
            branch[path] = self._choice(kids)
        logprobs = {
            name: sum(branch[path][child] for path, child in self.trie.decisions(name)) for name in self.prompt.labels
        }
        return prediction_of(logprobs, encoded), reports

    def score_many(
        self, tickets: Sequence[EncodedTicket], progress: Progress | None = None
    ) -> tuple[list[Prediction], list[BatchReport]]:
        """Every ticket in order, one at a time (llama.cpp's prompt cache serves one sequence)."""
        predictions, reports = [], []
        for encoded in tickets:
            prediction, ticket_reports = self.score(encoded)
            predictions.append(prediction)
            reports += ticket_reports
            if progress is not None:
                progress(1)
        return predictions, reports
