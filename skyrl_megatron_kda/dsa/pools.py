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
import triton
import triton.language as tl


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


POOL_BLOCK = 128
"""Selected pools per step of ``write_pool_tokens``'s program."""


@triton.jit
def _pool_tokens(ids_ptr, starts_ptr, q_pos_ptr, doc_ptr, out_ptr, k, n_pools, out_stride,
                 KPOOL: tl.constexpr, KP2: tl.constexpr, BLOCK: tl.constexpr):
    """One query's row of ``pool_token_indices``: its pools' tokens in selection order (-1 for
    none, an id that is no pool, or a pool it may not see), then its tail, -1 padded."""
    row = tl.program_id(0).to(tl.int64)
    q = tl.load(q_pos_ptr + row)
    d = tl.load(doc_ptr + row)
    j = tl.arange(0, KP2)
    out_row = out_ptr + row * out_stride
    for c0 in range(0, k, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        pid = tl.load(ids_ptr + row * k + c, mask=c < k, other=-1)
        chosen = (pid >= 0) & (pid < n_pools)
        first = tl.load(starts_ptr + tl.where(chosen, pid, 0), mask=chosen, other=0)
        visible = chosen & (first >= d) & (first + KPOOL - 1 <= q)
        tokens = tl.where(visible[:, None], first[:, None] + j[None, :], -1)
        tl.store(out_row + c[:, None] * KPOOL + j[None, :], tokens.to(tl.int32),
                 mask=(c < k)[:, None] & (j < KPOOL)[None, :])
    tail_n = (q - d + 1) % KPOOL
    tail = tl.where(j < tail_n, q + 1 - tail_n + j, -1)
    tl.store(out_row + k * KPOOL + j, tail.to(tl.int32), mask=j < KPOOL - 1)


def write_pool_tokens(out: torch.Tensor, pool_ids: torch.Tensor, starts: torch.Tensor,
                      q_pos: torch.Tensor, doc_start: torch.Tensor, kpool: int) -> None:
    """``pool_token_indices(pool_ids, ...)`` (ids not checked) written into ``out`` [s, k * kpool
    + kpool - 1]: on CUDA one Triton program per query (int32 ``out`` whose rows are contiguous;
    the torch function takes about fifteen launches per query block), elsewhere the torch
    function."""
    if out.is_cuda:
        pool_tokens_kernel(out, pool_ids, starts, q_pos, doc_start, kpool)
    else:
        out.copy_(pool_token_indices(pool_ids, starts, q_pos, doc_start, kpool, checked=False))


def pool_tokens_kernel(out: torch.Tensor, pool_ids: torch.Tensor, starts: torch.Tensor,
                       q_pos: torch.Tensor, doc_start: torch.Tensor, kpool: int) -> None:
    """``write_pool_tokens``'s Triton program, on any device Triton runs on."""
    s, k = pool_ids.shape
    if out.dtype != torch.int32 or out.shape != (s, k * kpool + kpool - 1) or out.stride(1) != 1:
        raise ValueError(f"out must be int32 [{s}, {k * kpool + kpool - 1}] with contiguous "
                         f"rows, got {out.dtype} {list(out.shape)} strides {out.stride()}")
    if s:
        _pool_tokens[(s,)](pool_ids.long().contiguous(), starts.long().contiguous(),
                           q_pos.long().contiguous(), doc_start.long().contiguous(), out, k,
                           starts.numel(), out.stride(0), KPOOL=kpool,
                           KP2=triton.next_power_of_2(kpool), BLOCK=POOL_BLOCK, num_warps=4)


def index_violations(indices: torch.Tensor, q_pos: torch.Tensor, doc_start: torch.Tensor) -> int:
    """How many selected token indices [s, n] (-1 = none) lie past their query or before its
    document's start: 0 for a causal, per-document selection."""
    chosen = indices >= 0
    bad = chosen & ((indices > q_pos[:, None]) | (indices < doc_start[:, None]))
    return int(bad.sum())
