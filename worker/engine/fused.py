"""The batched decoder forward with its elementwise work folded into oneDNN's GEMMs.

transformers' decoder layer writes the MLP as `down(silu(gate(x)) * up(x))` and the residuals as
`h + o(...)`, `h + down(...)`: on the CPU each of those elementwise ops reads and writes a whole
(tokens x intermediate) or (tokens x hidden) tensor after the GEMM that produced it, at large
batches out of every cache (docs/performance.md, "Figures behind the engine's choices"). oneDNN
applies such ops inside the GEMM, on the accumulator before it is stored ("post-ops"), and
`kernels.PackedLinear` (the weights the engine has already prepacked) exposes them: `gate` with
SiLU, `up` times that, `o` and `down` plus the residual. The rest of the layer is transformers' own
code, called as it is (its RMSNorm, its rotary tables and `apply_rotary_pos_emb`, the cache
update); attention is two matmuls and a softmax in float32 over the engine's 4D mask
(`_attention`: faster than torch's SDPA kernel on the CPU for these shapes).

The forward is written out term for term, so it runs only the families whose every term it
implements (`FAMILIES`, by the config's `model_type`): Llama and Mistral; Qwen2; Qwen3 (an RMSNorm
over each query and key head before the rotary embedding); SmolLM3 (layers without rotary
positions, `use_rope`); Granite (`embedding_multiplier` on the embeddings, `residual_multiplier` on
each branch before its residual add, `attention_multiplier` as the attention's scale). Another
family may add a term this loop would silently skip: `FusedDecoder.build(decoder)` returns None for
it, as for another MLP, a sliding window, weights not packed or int8, and the engine runs
transformers' decoder instead. The engine's load-time self-check (`selfcheck`) holds whatever
runs to the reference all the same. In float32 the arithmetic is the same up to rounding (the post-op runs on the
accumulator, attention sums in another order). The engine's reference path (`Engine.reference`)
never runs through here, so the tests hold this path to it.

In a low precision (bfloat16) the GEMMs and attention run in it, but the residual stream (the
hidden state each layer adds its branches to, and the norms that read it) stays in float32:
transformers' layers round that sum to bfloat16 at every add, 2 x layers times a ticket. Keeping
it costs one cast per GEMM input and nothing measurable in speed, and cuts the label decisions'
error against float32 by about a third (docs/performance.md) — the error a re-checked precision's
bound (`precision`) is measured on, so fewer tickets are computed again. Attention there is torch's
SDPA kernel on the low-precision queries, keys and values (it accumulates in float32; faster than
`_attention`'s float32 matmuls at that precision).

`keep` (B, K) asks for the hidden states at K positions per row only: the last layer then runs its
attention output, `o` and the MLP for those positions alone (its keys and values are computed for
every position, as the cache needs them), which saves 1/num_layers of the linear work.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.engine.kernels import PackedLinear, dtype_name

log = logging.getLogger(__name__)

_ACTIVATIONS = ("SiLU", "SiLUActivation")
# Which rounding this forward does in a low precision: part of a re-checked precision's cached
# calibration key (`policy`), so a bound measured on an earlier arithmetic is measured again.
ARITHMETIC = "low-precision GEMMs and SDPA, float32 residual stream"
# The model types whose decoder layer this forward computes term for term (see the module doc).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "granite")


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.nn.Module
    post_norm: torch.nn.Module
    q: PackedLinear
    k: PackedLinear
    v: PackedLinear
    o: PackedLinear
    gate: PackedLinear
    up: PackedLinear
    down: PackedLinear
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    q_norm: torch.nn.Module | None  # Qwen3: an RMSNorm over each query head, before the rotary embedding
    k_norm: torch.nn.Module | None  # ... and over each key head
    rope: bool  # False: a layer without rotary positions (SmolLM3's `no_rope_layers`)
    residual: float  # Granite's `residual_multiplier`: each branch's output scaled before its residual add


class FusedDecoder:
    """A decoder of one of `FAMILIES` (its modules, not a copy) run with fused GEMMs; see the module doc."""

    def __init__(self, decoder: torch.nn.Module, layers: list[_Layer]) -> None:
        self.rope = _model_module(decoder).apply_rotary_pos_emb  # the model family's own, op for op
        self.embed = decoder.embed_tokens
        self.dtype = _dtype(decoder)  # the GEMMs' and attention's; the residual stream is float32
        self.rotary = decoder.rotary_emb
        self.norm = decoder.norm
        self.embedding_scale = float(getattr(decoder, "embedding_multiplier", 1.0))  # Granite's
        self.layers = layers
        # float32: SiLU, product and residuals inside the GEMMs. bfloat16 tensors are half the
        # bytes and the post-ops are no faster there, so bf16 runs them as separate ops. A scaled
        # residual (Granite) is not a plain add: separate ops too.
        self.post_ops = self.dtype == torch.float32 and all(
            layer.residual == 1.0 for layer in layers)  # fmt: skip

    @classmethod
    def build(cls, decoder: torch.nn.Module) -> FusedDecoder | None:
        """The fused forward for `decoder`, or None (with the reason logged) where it does not apply."""
        reason = _unsupported(decoder)
        if reason:
            log.info("fused decoder not used: %s; transformers' layers run as they are", reason)
            return None
        layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            heads = attn.q_proj.out_features // attn.head_dim
            kv_heads = attn.k_proj.out_features // attn.head_dim
            layers.append(_Layer(
                layer.input_layernorm, layer.post_attention_layernorm, attn.q_proj, attn.k_proj, attn.v_proj,
                attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj, heads, kv_heads, attn.head_dim, attn.scaling,
                getattr(attn, "q_norm", None), getattr(attn, "k_norm", None), bool(getattr(attn, "use_rope", True)),
                float(getattr(layer, "residual_multiplier", 1.0)),
            ))  # fmt: skip
        return cls(decoder, layers)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache,
                 keep: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The final hidden states (B, W, H) of `ids` (B, W) after `cache`'s contents, or (B, K, H)
        at the positions `keep` (B, K). `mask` is the additive (B, 1, W, KV) mask, `positions` (B, W)."""
        low = self.dtype  # each GEMM's input is cast to it; the residual stream `hidden` stays float32
        hidden = self.embed(ids).float()  # (B, W, H)
        if self.embedding_scale != 1.0:
            hidden = hidden * self.embedding_scale
        cos, sin = self.rotary(hidden[:, :, :0].to(low), positions)  # (B, W, D) each, in the GEMMs' precision
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            rows, width, _ = hidden.shape
            x = layer.input_norm(hidden).to(low)
            q = layer.q(x).view(rows, width, layer.heads, layer.head_dim)  # (B, W, Hq, D)
            k = layer.k(x).view(rows, width, layer.kv_heads, layer.head_dim)  # (B, W, KVH, D)
            if layer.q_norm is not None:  # per head, before the heads move forward (as Qwen3 does)
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, Hq, W, D), (B, KVH, W, D)
            v = layer.v(x).view(rows, width, layer.kv_heads, layer.head_dim).transpose(1, 2)
            if layer.rope:
                q, k = self.rope(q, k, cos, sin)
            k, v = cache.update(k, v, index)  # (B, KVH, KV, D): the prefix's, then this batch's
            if index == last and keep is not None:  # only the asked-for positions go on
                at = keep[:, None, :, None]  # (B, 1, K, 1)
                q = q.gather(2, at.expand(-1, layer.heads, -1, layer.head_dim))  # (B, Hq, K, D)
                mask = mask.gather(2, at.expand(-1, -1, -1, mask.shape[-1]))  # (B, 1, K, KV)
                hidden = hidden.gather(1, keep[:, :, None].expand(-1, -1, hidden.shape[-1]))  # (B, K, H)
            attended = _attention(q, k, v, mask, layer) if low == torch.float32 else _sdpa(q, k, v, mask, layer)
            attended = attended.transpose(1, 2).reshape(*hidden.shape[:2], -1)  # (B, Q, Hq * D)
            if self.post_ops:
                hidden = layer.o.then(attended, hidden, "add")  # o(attended) + hidden
                x = layer.post_norm(hidden)
                gated = layer.gate(x, "swish")  # silu(gate(x)), in the GEMM
                product = layer.up.then(x, gated, "mul")  # up(x) * silu(gate(x))
                hidden = layer.down.then(product, hidden, "add")  # down(...) + hidden
            else:  # a low precision's branch is added to the float32 stream (type promotion)
                hidden = hidden + _scaled(layer.o(attended), layer.residual)
                x = layer.post_norm(hidden).to(low)
                hidden = hidden + _scaled(layer.down(F.silu(layer.gate(x)) * layer.up(x)), layer.residual)
        return self.norm(hidden).to(low)


def _scaled(branch: torch.Tensor, multiplier: float) -> torch.Tensor:
    """A branch's output before its residual add: times Granite's `residual_multiplier`, where not 1."""
    return branch if multiplier == 1.0 else branch * multiplier


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, layer: _Layer) -> torch.Tensor:
    """softmax(q kᵀ scale + mask) v in float32, the query heads of a key/value head as one matrix.

    Two batched matmuls and a softmax: on the CPU, for the batches the planner makes (tens to a few
    hundred tokens a row after a short prefix), at least as fast as torch's fused SDPA kernel
    (docs/performance.md), and in float32 for every dtype, as the SDPA kernel accumulates.
    (B, Hq, Q, D) queries, (B, KVH, KV, D) keys and values, (B, 1, Q, KV) mask.
    """
    rows, heads, queries, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads  # query head h reads key/value head h // groups
    grouped = q.float().reshape(rows, kv_heads, groups * queries, dim)  # (B, KVH, G*Q, D)
    scores = torch.matmul(grouped, k.float().transpose(-1, -2)).view(rows, kv_heads, groups, queries, keys)
    scores.mul_(layer.scaling).add_(mask[:, :, None].float())  # (B, KVH, G, Q, KV); one mask for all heads
    probs = torch.softmax(scores, dim=-1).view(rows, kv_heads, groups * queries, keys)
    out = torch.matmul(probs, v.float()).view(rows, heads, queries, dim)  # (B, Hq, Q, D)
    return out.to(q.dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, layer: _Layer) -> torch.Tensor:
    """softmax(q kᵀ scale + mask) v by torch's SDPA kernel in the tensors' (low) precision, which
    accumulates in float32; `_attention` where this torch has no grouped-query SDPA (before 2.5)."""
    if not _SDPA_GQA:
        return _attention(q, k, v, mask, layer)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype), scale=layer.scaling, enable_gqa=True)


_SDPA_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa came in 2.5


def _model_module(decoder: torch.nn.Module):
    """The transformers module defining `decoder`'s layers (`modeling_qwen2`, `modeling_llama`, ...)."""
    return sys.modules[type(decoder.layers[0].self_attn).__module__]


def _dtype(decoder: torch.nn.Module) -> torch.dtype:
    """What the decoder computes in: its embeddings' (a cast copy's `configure.CastTable` says)."""
    embed = decoder.embed_tokens
    return getattr(embed, "dtype", None) or embed.weight.dtype


def _unsupported(decoder: torch.nn.Module) -> str | None:
    """Why `decoder` cannot run fused, or None."""
    family = getattr(getattr(decoder, "config", None), "model_type", None)
    if family not in FAMILIES:
        return f"its family ({family}) is not one it computes term for term ({', '.join(FAMILIES)})"
    for attr in ("embed_tokens", "rotary_emb", "norm", "layers"):
        if not hasattr(decoder, attr):
            return f"{type(decoder).__name__} has no {attr}"
    if not len(decoder.layers):
        return f"{type(decoder).__name__} has no layers"
    if _dtype(decoder) not in (torch.float32, torch.bfloat16):
        return f"its weights are {dtype_name(_dtype(decoder))}"
    for layer in decoder.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(linear, PackedLinear) for linear in linears):
            return "its linear layers are not prepacked for oneDNN (TICKETQ_MATMUL=onednn)"
        if type(getattr(mlp, "act_fn", None)).__name__ not in _ACTIVATIONS:
            return f"its MLP's activation is {type(getattr(mlp, 'act_fn', None)).__name__}, not SiLU"
        if getattr(attn, "sliding_window", None) is not None:
            return "it uses sliding-window attention"
        if not all(hasattr(layer, name) for name in ("input_layernorm", "post_attention_layernorm")):
            return f"{type(layer).__name__} is not a pre-norm layer"
        if not hasattr(attn, "head_dim") or not hasattr(attn, "scaling"):
            return f"{type(attn).__name__} has no head_dim / scaling"
        norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
        if any(norms) and not all(getattr(n, "weight", None) is not None and n.weight.shape == (attn.head_dim,)
                                  for n in norms):  # fmt: skip
            return f"{type(attn).__name__}'s q/k norms are not one per head"  # (OLMo 2 norms whole projections)
    if not hasattr(_model_module(decoder), "apply_rotary_pos_emb"):
        return f"{_model_module(decoder).__name__} has no apply_rotary_pos_emb"
    return None
