"""A forward batch's tensors after a cached prefix: right-padded token rows and additive 4D masks.

Two layouts. `prefix_mask`: each row one ticket (the single-field path), its real tokens causal,
its pads never seen, and optionally continuation tokens stored after the padded rows (a label
trie's shared tokens). `packed_mask`: each row a ticket's shared part followed by several short
segments that see the shared part and themselves only (`fields.FieldsEngine`). In both, every
query sees the whole cached prefix, so no row of the softmax is empty.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def padded_ids(rows: Sequence[Sequence[int]], width: int, pad_id: int, device: torch.device) -> torch.Tensor:
    """Token rows right-padded with `pad_id` to `width`: (B, W)."""
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, device=device)
    return ids


def prefix_mask(P: int, lengths: torch.Tensor, width: int, extra: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask after a prefix of `P` tokens: prefix always visible, each row's real tokens
    (`lengths`, (B,)) causally, pads never.

    With `extra` > 0 the queries are `extra` continuation tokens stored after the padded rows.
    """
    device = lengths.device
    kv = torch.arange(P + width + extra, device=device)  # (KV,)
    q = torch.arange(extra or width, device=device)  # (Q,)
    slot = kv - P  # position of a key inside the row region
    real = (slot >= 0) & (slot < width) & (slot[None, :] < lengths[:, None])  # (B, KV)
    if extra:
        own = (kv >= P + width)[None, :] & (kv[None, :] - P - width <= q[:, None])  # (Q, KV)
        allowed = (slot < 0)[None, None, :] | real[:, None, :] | own[None]  # (B, Q, KV)
    else:
        causal = slot[None, :] <= q[:, None]  # (Q, KV)
        allowed = (slot < 0)[None, None, :] | (real[:, None, :] & causal[None])  # (B, Q, KV)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]  # (B, 1, Q, KV)


def packed_mask(P: int, segment: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4D mask of packed rows: `segment` (B, W) is -1 on the shared part, k on segment k, -2 on pads.

    Every query sees the cached prefix. A shared-part query sees the shared part causally; a segment's
    query sees the whole shared part and its own segment causally; nothing sees another segment or
    a pad (a pad query sees the prefix and the shared part, so no row of the softmax is empty).
    """
    rows, width = segment.shape
    q = torch.arange(width, device=segment.device)
    causal = q[None, :] <= q[:, None]  # (Q, K)
    key, query = segment[:, None, :], segment[:, :, None]  # (B, 1, K), (B, Q, 1)
    allowed = causal[None] & ((key == -1) | ((key == query) & (query >= 0)))  # (B, Q, K)
    mask = torch.zeros((rows, width, P + width), dtype=dtype, device=segment.device)
    mask[:, :, P:].masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]  # (B, 1, Q, P+K)
