"""GLM's key pools and the token indices a query attends to, for the sparse MLA core.

A key pool is ``kpool`` consecutive tokens counted from its document's start; only complete pools
exist (a document's last ``len % kpool`` tokens form no pool). A query at natural position ``i`` in
a document starting at ``d`` may use a pool only when the pool lies inside the document and its
last token is <= ``i``; the query's own incomplete pool (the tail: the last
``(i - d + 1) % kpool`` tokens up to ``i``) is always attended to.

This is the same geometry and the same index layout as ``pool_topk.select_pools`` (pools' tokens
in selection order, then the tail, padded with -1), split out so that an indexer that returns
pool ids (``pool_topk``) and the sparse attention core (``sparse_mla``) share one definition.
"""

from __future__ import annotations

import torch


def pool_starts(cu_seqlens: torch.Tensor, kpool: int) -> torch.Tensor:
    """Natural position of the first token of every complete pool, ascending: LongTensor [n_pool].
    Pool ids are indices into this tensor."""
    if kpool < 1:
        raise ValueError(f"kpool must be >= 1, got {kpool}")
    cu = cu_seqlens.to(torch.long)
    starts, lens = cu[:-1], cu.diff()
    per_doc = lens // kpool
    doc = torch.repeat_interleave(torch.arange(len(lens), device=cu.device), per_doc)
    first_of_doc = (per_doc.cumsum(0) - per_doc)[doc]
    return starts[doc] + kpool * (torch.arange(doc.numel(), device=cu.device) - first_of_doc)


def document_starts(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Natural position of the first token of the document holding each of ``positions``."""
    cu = cu_seqlens.to(torch.long)
    return cu[torch.bucketize(positions, cu[1:], right=True)]


def pooled_keys(keys: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor,
                starts: torch.Tensor, kpool: int) -> torch.Tensor:
    """One indexer key per pool [n_pool, d]: the pool's keys [T, d] mixed by a softmax over its
    ``kpool`` tokens of ``gate`` [T, d] + ``ape`` [kpool, d] (GLM's learned pool compression)."""
    tok = starts[:, None] + torch.arange(kpool, device=keys.device)
    logits = gate.float()[tok] + ape.float()[None]
    return (logits.softmax(dim=1).to(keys.dtype) * keys[tok]).sum(dim=1)


def pool_token_indices(pool_ids: torch.Tensor, starts: torch.Tensor, q_pos: torch.Tensor,
                       doc_start: torch.Tensor, kpool: int, checked: bool = True) -> torch.Tensor:
    """Token indices [s, k * kpool + kpool - 1] for queries at natural positions ``q_pos`` [s]
    (documents starting at ``doc_start`` [s]) that selected ``pool_ids`` [s, k] (-1 = none).

    A selected pool the query may not see (past the query, or outside its document) is dropped
    (-1), so the result is causal and per-document whatever the selection holds; an indexer with
    fewer visible pools than ``k`` leaves such entries in its top-k. Then the tail; -1 pads.
    ``checked=False`` skips the check that the ids are pool ids (it reads them on the host).
    """
    if pool_ids.dim() != 2 or pool_ids.shape[0] != q_pos.shape[0]:
        raise ValueError(f"pool_ids must be [queries={q_pos.shape[0]}, k], got {list(pool_ids.shape)}")
    if checked and pool_ids.numel() and (int(pool_ids.min()) < -1
                                         or int(pool_ids.max()) >= starts.numel()):
        raise ValueError(f"pool ids must lie in [-1, {starts.numel()}), got "
                         f"[{int(pool_ids.min())}, {int(pool_ids.max())}]")
    offs = torch.arange(kpool, device=pool_ids.device)
    first = starts[pool_ids.clamp(min=0)] if starts.numel() else torch.zeros_like(pool_ids)
    visible = (pool_ids >= 0) & (first >= doc_start[:, None]) & (first + kpool - 1 <= q_pos[:, None])
    tokens = (first[..., None] + offs).masked_fill(~visible[..., None], -1).flatten(-2)

    tail_n = (q_pos - doc_start + 1) % kpool
    tail_offs = offs[: kpool - 1]
    tail = (q_pos + 1 - tail_n)[:, None] + tail_offs
    tail = tail.masked_fill(tail_offs[None] >= tail_n[:, None], -1)
    return torch.cat([tokens, tail], dim=-1)


def index_violations(indices: torch.Tensor, q_pos: torch.Tensor, doc_start: torch.Tensor) -> int:
    """How many selected token indices [s, n] (-1 = none) lie past their query or before its
    document's start: 0 for a causal, per-document selection."""
    chosen = indices >= 0
    bad = chosen & ((indices > q_pos[:, None]) | (indices < doc_start[:, None]))
    return int(bad.sum())
