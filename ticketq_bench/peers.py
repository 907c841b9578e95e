"""The CPU peers of `ticketq bench`: llama.cpp and OpenVINO on the same model and the same tokens.

What a careful CPU user would run instead of ticketq: llama-cpp-python (the optional extra
`pip install 'ticketq[peers]'`) with the shared system-prompt prefix evaluated once and its KV
cache reused for every ticket, exactly as llama.cpp's server prompt cache does; or OpenVINO
(`pip install 'ticketq[openvino]'`) on the model converted to its IR, length-sorted batches after
the same cached prefix.

- `gguf_model` converts the local model directory to GGUF (f32 or q8_0) with llama.cpp's own
  `convert_hf_to_gguf.py`, taken from the installed llama-cpp-python's source distribution, and
  caches the file under `out/gguf/`.
- `LlamaCppScorer` scores tickets one at a time: `n_tokens` reset to the prefix length (the
  cache beyond it is dropped by `Llama.eval`), the engine's own ticket + suffix token ids
  evaluated (never text: the tokens are exactly the engine's), and the full-vocabulary logits
  at the answer position read from the context for every branch of the label trie; the same
  constrained scoring as `Engine.reference`.

- `openvino_model` converts the local transformers model with `openvino.convert_model` (a traced
  wrapper: the engine's own transformers model, its KV cache passed in and out as tensors, the
  mask built from each row's length, full-vocabulary logits at each row's answer position), saves
  the IR in float32 and caches it under `out/openvino/` (and once more with int8 weights by NNCF,
  for `openvino-int8`). optimum-intel's exporter is what a user would run, but it pins its own
  torch and transformers, so the bench converts the model itself.
- `OpenVinoScorer` compiles the IR on the CPU (`INFERENCE_PRECISION_HINT` f32 or bf16, the
  bench's threads), computes the prefix's KV once, then scores length-sorted batches of
  right-padded tickets after it, the label read from the answer-position logits through the label
  trie, like `Engine.reference`.

Every peer takes a `PeerPrompt` (the engine's prefix, labels and trie as plain data: the bench
runs each peer in its own process) and answers `score_many(tickets)`. This module imports neither
torch, llama_cpp nor openvino at import time; only public llama-cpp-python API is used
(`Llama.eval`, `Llama.n_tokens`, `Llama.ctx`, `llama_get_logits_ith`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from worker.engine import batching
from worker.engine.prompt import EncodedTicket, LabelTrie, PromptTemplate
from worker.results import BatchReport, Prediction

GGUF_TYPES = ("f32", "q8_0")
INSTALL_HINT = "pip install 'ticketq[peers]'"
OPENVINO_HINT = "pip install 'ticketq[openvino]'"
OPENVINO_PRECISIONS = ("f32", "bf16")  # INFERENCE_PRECISION_HINT values
Progress = Callable[[int], None]  # told how many tickets were just scored


@dataclass(frozen=True)
class PeerPrompt:
    """The engine's prompt as plain, picklable data: what a peer needs to score the same tokens."""

    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    labels: tuple[str, ...]
    sequences: dict[str, tuple[int, ...]]  # label -> its token sequence (the trie's input)
    max_ticket_tokens: int

    @classmethod
    def of(cls, prompt: PromptTemplate) -> PeerPrompt:
        return cls(prompt.prefix_ids, prompt.suffix_ids, prompt.labels, dict(prompt.trie.sequences),
                   prompt.max_ticket_tokens)  # fmt: skip

    @property
    def trie(self) -> LabelTrie:
        return LabelTrie(self.sequences)


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


class PeerUnavailable(RuntimeError):
    """The peer cannot run here; the message is the one-line reason the bench prints."""


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
    out = cache / "gguf" / f"{_cache_key(model_dir)}.{outtype}.gguf"
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


def _cache_key(model_dir: Path) -> str:
    """The model files' names, sizes and mtimes, hashed: a converted copy is reused until they change."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    key = hashlib.sha256(repr([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]).encode())
    return f"{Path(model_dir).resolve().name}-{key.hexdigest()[:12]}"


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
        return _choice_logprobs(logits, kids)

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
        return _prediction(logprobs, encoded), reports

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


def _choice_logprobs(logits, kids: Sequence[int]) -> list[float]:
    """Full-vocabulary log-probs (V,) restricted to `kids` and renormalised over them, as `Engine.reference`."""
    import numpy as np

    full = logits.astype(np.float64)
    full = full - full.max()
    log_z = math.log(float(np.exp(full).sum()))
    allowed = full[list(kids)] - log_z  # (C,) full-vocabulary log-probs, as the reference takes them
    allowed = allowed - allowed.max()
    return list(allowed - math.log(float(np.exp(allowed).sum())))  # renormalised over the choices


def _prediction(logprobs: dict[str, float], encoded: EncodedTicket) -> Prediction:
    probs = {name: math.exp(lp) for name, lp in logprobs.items()}
    ranked = sorted(probs, key=probs.__getitem__, reverse=True)
    return Prediction(ranked[0], probs, probs[ranked[0]] - probs[ranked[1]], encoded.truncated, encoded.ticket_tokens)


# ----- OpenVINO -----------------------------------------------------------------------------


def openvino_version() -> str:
    """The installed OpenVINO's version, or PeerUnavailable with the install hint."""
    if importlib.util.find_spec("openvino") is None:
        raise PeerUnavailable(f"openvino is not installed ({OPENVINO_HINT})")
    from importlib.metadata import version

    return version("openvino")


def openvino_model(model_dir: Path, cache: Path, weights: str = "f32") -> Path:
    """`model_dir` converted to OpenVINO IR, cached by the model files' size and mtime.

    `weights` "f32" keeps the model's weights in float32; "int8" is that IR with its weights
    compressed by NNCF (`compress_weights`, INT8_ASYM: per output channel, asymmetric), what an
    OpenVINO user's `optimum-cli export openvino --weight-format int8` gives.
    """
    openvino_version()
    if weights == "int8":
        return _int8_weights(openvino_model(model_dir, cache))
    if weights != "f32":
        raise ValueError(f'weights must be "f32" or "int8", got {weights!r}')
    if not Path(model_dir, "config.json").is_file():
        raise PeerUnavailable(f"{model_dir} is not a local model directory; OpenVINO needs one to convert")
    out = cache / "openvino" / _cache_key(model_dir) / "model.xml"
    if out.is_file():
        return out
    import openvino as ov
    import torch
    from transformers import AutoModelForCausalLM

    from worker.engine.loading import new_cache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = model.config
    if not hasattr(model.get_decoder(), "layers") or not hasattr(new_cache(model.config), "layers"):
        raise PeerUnavailable("the OpenVINO conversion needs a decoder-only model and transformers >= 4.56")
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    past = torch.zeros(layers, 1, kv_heads, 7, head_dim)  # (L, 1, KVH, P, D): an example prefix of 7 tokens
    example = (torch.ones(2, 5, dtype=torch.long), torch.tensor([5, 3]), past, past)
    shapes = [[-1, -1], [-1], [layers, 1, kv_heads, -1, head_dim], [layers, 1, kv_heads, -1, head_dim]]
    with torch.no_grad():
        converted = ov.convert_model(
            _answer_logits_module()(model), example_input=example, input=[ov.PartialShape(shape) for shape in shapes]
        )
    for port, name in zip(converted.inputs, ("input_ids", "lengths", "past_keys", "past_values"), strict=True):
        port.get_tensor().set_names({name})
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name("partial.xml")
    ov.save_model(converted, partial, compress_to_fp16=False)  # float32 weights: the f32 mode must be exact
    partial.with_suffix(".bin").rename(out.with_suffix(".bin"))
    partial.rename(out)
    return out


def _int8_weights(xml: Path) -> Path:
    """The float32 IR beside `xml` with int8 weights (NNCF), converted once."""
    out = xml.with_name("model-int8.xml")
    if out.is_file():
        return out
    if importlib.util.find_spec("nncf") is None:
        raise PeerUnavailable(f"int8 weights need nncf ({OPENVINO_HINT})")
    import nncf
    import openvino as ov

    compressed = nncf.compress_weights(ov.Core().read_model(xml), mode=nncf.CompressWeightsMode.INT8_ASYM)
    partial = out.with_name("partial-int8.xml")
    ov.save_model(compressed, partial, compress_to_fp16=False)
    partial.with_suffix(".bin").rename(out.with_suffix(".bin"))
    partial.rename(out)
    return out


def _answer_logits_module():
    """The wrapper class, defined on first use: this module imports no torch at import time."""
    import inspect

    import torch

    from worker.engine.loading import new_cache

    class AnswerLogits(torch.nn.Module):
        """The traced graph: a batch after a cached prefix, full-vocabulary logits at each row's last token.

        In: input_ids (B, W) right-padded, lengths (B,), past_keys / past_values (L, 1, KVH, P, D),
        the prefix's cache, shared by every row. Out: logits (B, V) at position lengths - 1, and the
        cache after the batch (L, B, KVH, P + W, D): the prefix's is read from it once.
        """

        def __init__(self, model) -> None:
            super().__init__()
            self.model = model
            forward = inspect.signature(model.get_decoder().forward).parameters
            self.cache_kwarg = "cache" if "cache" in forward else "past_key_values"

        def forward(self, input_ids, lengths, past_keys, past_values):
            rows, width = input_ids.shape
            prefix = past_keys.shape[3]
            cache = new_cache(self.model.config)
            for index, layer in enumerate(cache.layers):
                keys = past_keys[index].expand(rows, -1, -1, -1)  # (B, KVH, P, D), a view
                values = past_values[index].expand(rows, -1, -1, -1)
                # set the layer's tensors directly: its first update() would concatenate an empty
                # 1-D tensor, which OpenVINO's converter rejects
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
            slot = torch.arange(prefix + width) - prefix  # (KV,) key position inside the row region
            query = torch.arange(width)  # (W,)
            real = (slot[None, :] >= 0) & (slot[None, :] < lengths[:, None])  # (B, KV)
            allowed = (slot < 0)[None, None, :] | (real[:, None, :] & (slot[None, :] <= query[:, None])[None])
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
            positions = prefix + query[None, :].expand(rows, -1)  # (B, W)
            out = self.model.get_decoder()(
                input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **{self.cache_kwarg: cache},
            )  # fmt: skip
            last = out.last_hidden_state[torch.arange(rows), lengths - 1]  # (B, H)
            logits = self.model.get_output_embeddings()(last)  # (B, V)
            keys, values = zip(*((layer.keys, layer.values) for layer in cache.layers), strict=True)
            return logits, torch.stack(keys), torch.stack(values)  # (B, V), (L, B, KVH, P + W, D) twice

    return AnswerLogits


class OpenVinoScorer:
    """The IR compiled on the CPU, the prefix's KV computed once; length-sorted batches scored after it."""

    def __init__(self, xml: Path, prompt: PeerPrompt, threads: int, precision: str, batch_size: int) -> None:
        import numpy as np
        import openvino as ov

        if precision not in OPENVINO_PRECISIONS:
            raise ValueError(f"precision must be one of {OPENVINO_PRECISIONS}, got {precision!r}")
        self.prompt, self.trie, self.batch_size = prompt, prompt.trie, batch_size
        self.core = ov.Core()
        self.config = {
            "INFERENCE_PRECISION_HINT": precision,  # f32 must be asked for: bf16 is the default on AMX CPUs
            "INFERENCE_NUM_THREADS": threads,
            "PERFORMANCE_HINT": "LATENCY",
            "NUM_STREAMS": 1,
        }
        model = self.core.read_model(xml)
        layers, _, kv_heads, _, head_dim = _static_dims(model.input("past_keys").get_partial_shape())
        empty = np.zeros((layers, 1, kv_heads, 0, head_dim), np.float32)  # no cache before the prefix
        with_cache = self.core.compile_model(model, "CPU", self.config)
        prefix = np.array([prompt.prefix_ids], np.int64)  # (1, P)
        out = with_cache([prefix, np.array([prefix.shape[1]], np.int64), empty, empty])
        self.past = (out[1].copy(), out[2].copy())  # (L, 1, KVH, P, D) each: the prompt cache
        del with_cache, out
        # the same graph without the cache outputs: batches read only their answer-position logits
        logits_only = ov.Model([model.get_results()[0]], model.get_parameters(), "answer-logits")
        self.compiled = self.core.compile_model(logits_only, "CPU", self.config)
        self.request = self.compiled.create_infer_request()
        self.prefix_len = prefix.shape[1]
        self.precision = self.compiled.get_property("INFERENCE_PRECISION_HINT").to_string()  # "f32", "bf16"

    def _logits(self, rows: Sequence[Sequence[int]], width: int):
        """(B, V) float32 logits at each row's last token; rows right-padded to `width`."""
        import numpy as np

        ids = np.full((len(rows), width), self.prompt.suffix_ids[0], np.int64)  # (B, W); pads are masked out
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        lengths = np.array([len(row) for row in rows], np.int64)  # (B,)
        self.request.infer([ids, lengths, *self.past])
        return self.request.get_output_tensor(0).data  # (B, V)

    def score_batch(self, rows: Sequence[EncodedTicket], width: int) -> tuple[list[Prediction], list[BatchReport]]:
        """One forward per trie branch: the root after the tickets, a shared label prefix appended to each."""
        branch, reports = {}, []
        for path, kids in self.trie.branches.items():
            started = time.perf_counter()
            sequences = [(*row.ids, *path) for row in rows]
            logits = self._logits(sequences, width + len(path))
            branch[path] = [_choice_logprobs(logits[i], kids) for i in range(len(rows))]
            real = sum(map(len, sequences))
            reports.append(BatchReport(len(rows), width + len(path), real, time.perf_counter() - started))
        predictions = []
        for i, row in enumerate(rows):
            logprobs = {
                name: sum(branch[path][i][child] for path, child in self.trie.decisions(name))
                for name in self.prompt.labels
            }
            predictions.append(_prediction(logprobs, row))
        return predictions, reports

    def score_many(
        self, tickets: Sequence[EncodedTicket], progress: Progress | None = None
    ) -> tuple[list[Prediction], list[BatchReport]]:
        """Length-sorted batches of `batch_size` rows, each padded to its longest; answers in ticket order."""
        plan = batching.plan_fixed([len(t.ids) for t in tickets], self.batch_size, sort=True)
        predictions: list[Prediction | None] = [None] * len(tickets)
        reports = []
        for batch in plan.batches:
            got, batch_reports = self.score_batch([tickets[i] for i in batch.indices], batch.width)
            for index, prediction in zip(batch.indices, got, strict=True):
                predictions[index] = prediction
            reports += batch_reports
            if progress is not None:
                progress(batch.rows)
        return predictions, reports  # type: ignore[return-value]


def _static_dims(shape) -> tuple[int, int, int, int, int]:
    """(L, 1, KVH, P, D) of the cache input, P dynamic (read as 0)."""
    return tuple(dim.get_length() if dim.is_static else 0 for dim in shape)  # type: ignore[return-value]
