"""Block metadata and the compact KV-block -> query index (CSR) of selected attention.

Everything here runs on the device of its inputs with no host sync: every buffer is
sized from shapes alone (static upper bounds), never from values.

Two levels, so that work is shared where it can be:

* :func:`prepare_block_meta` depends only on ``cu_seqlens`` and the block size. It is
  computed once per batch and reused by every layer.
* :func:`build_selection_csr` depends on one layer's ``block_indices``. Its result is
  saved by the forward and reused by the backward of that layer.

Global KV blocks. Sequence ``i`` of length ``L_i`` owns ``ceil(L_i / bs)`` blocks; they are
numbered consecutively over the packed stream. Their number is at most
``T // bs + N`` (``N`` sequences), the static bound ``num_blocks`` used to size everything.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flash_msa.utils.cache import per_batch


@dataclass
class BlockMeta:
    """Per-batch metadata derived from ``cu_seqlens`` (see :func:`prepare_block_meta`)."""

    T: int
    block_size: int
    num_blocks: int            # static bound on the number of global KV blocks
    tok_start: torch.Tensor    # int32 [T]: start of each token's sequence
    tok_block0: torch.Tensor   # int32 [T]: global id of block 0 of each token's sequence
    block_start: torch.Tensor  # int32 [num_blocks]: first key of each global block
    block_end: torch.Tensor    # int32 [num_blocks]: one past its last key (== start if unused)


@dataclass
class SelectionCSR:
    """Valid (query, KV head, slot) entries grouped by key = (chunk, KV head, global block).

    ``entry_ids[key_offsets[key]:key_offsets[key + 1]]`` are the entries of one key, in
    increasing token order. An entry id is ``(t * HK + hk) * S + s``. Memory is O(T * HK * S).
    Queries are split into chunks of ``chunk_size`` tokens so that the kernels can bound
    their partial buffers by one partition: a chunk and one or all KV heads, whose keys are
    consecutive (docs/selected_attention.md).
    """

    meta: BlockMeta
    HK: int
    S: int
    chunk_size: int
    num_chunks: int
    entry_ids: torch.Tensor    # int32 [T * HK * S], valid entries first
    key_offsets: torch.Tensor  # int32 [num_chunks * HK * num_blocks + 1]
    local: int = 0             # each query's last ``local`` blocks are left out (valid_entries)

    @property
    def keys_per_chunk(self) -> int:
        return self.HK * self.meta.num_blocks


def prepare_block_meta(cu_seqlens: torch.Tensor, T: int, block_size: int) -> BlockMeta:
    """Token -> sequence start and global block numbering, for one packed batch.

    Args:
        cu_seqlens: int32 [N+1] offsets of the N packed sequences.
        T: number of packed tokens (cu_seqlens[-1]), a Python int.
        block_size: keys per KV block.
    """
    device = cu_seqlens.device
    N = cu_seqlens.numel() - 1
    num_blocks = T // block_size + N
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    nblk = (lengths + block_size - 1) // block_size  # [N]
    blk_end_incl = nblk.cumsum(0)  # [N]
    blk_off = blk_end_incl - nblk
    t = torch.arange(T, device=device)
    seq = torch.searchsorted(cu[1:], t, right=True).clamp_max(N - 1)  # [T]
    j = torch.arange(num_blocks, device=device)
    bseq = torch.searchsorted(blk_end_incl, j, right=True)  # [num_blocks], N for unused ids
    used = bseq < N
    bseq = bseq.clamp_max(N - 1)
    bstart = cu[bseq] + (j - blk_off[bseq]) * block_size
    bend = torch.minimum(bstart + block_size, cu[bseq + 1])
    bstart = torch.where(used, bstart, torch.zeros_like(bstart))
    bend = torch.where(used, bend, torch.zeros_like(bend))
    return BlockMeta(
        T=T, block_size=block_size, num_blocks=num_blocks,
        tok_start=cu[seq].to(torch.int32), tok_block0=blk_off[seq].to(torch.int32),
        block_start=bstart.to(torch.int32), block_end=bend.to(torch.int32))


def get_block_meta(cu_seqlens: torch.Tensor, T: int, block_size: int) -> BlockMeta:
    """:func:`prepare_block_meta`, computed once per ``cu_seqlens`` tensor and block size
    (:func:`flash_msa.utils.cache.per_batch`): all layers of a step share one BlockMeta."""
    return per_batch(prepare_block_meta, cu_seqlens, T, block_size)


def valid_entries(block_indices: torch.Tensor, meta: BlockMeta, local: int = 0) -> torch.Tensor:
    """bool [T, HK, S]: entry names a block at or before the query's own block, less the last
    ``local`` of them (own - local + 1 .. own), which another kernel computes (flash_msa/fused.py)."""
    T = block_indices.shape[0]
    own = (torch.arange(T, device=block_indices.device) - meta.tok_start) // meta.block_size  # [T]
    return (block_indices >= 0) & (block_indices <= own[:, None, None] - local)


# build_selection_csr sorts int16 keys while num_keys + 1 values fit them (tests lower it)
SHORT_KEYS_BELOW = 1 << 16


@triton.jit
def _entry_keys_kernel(block_indices, tok_start, tok_block0, key, N, chunk_size, NB, num_keys,
                       HK: tl.constexpr, S: tl.constexpr, BS: tl.constexpr, LOCAL: tl.constexpr,
                       SHORT: tl.constexpr, BLOCK: tl.constexpr):
    # the sort key of each entry (t, hk, s) of block_indices [T, HK, S]: (chunk, KV head, global
    # block), num_keys for an invalid entry; int32 arithmetic (num_keys < 2^31, checked by the caller)
    o_e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_e = o_e < N
    b_idx = tl.load(block_indices + o_e, mask=m_e, other=-1)
    b_t = (o_e // (HK * S)).to(tl.int32)
    b_hk = ((o_e // S) % HK).to(tl.int32)
    own = (b_t - tl.load(tok_start + b_t, mask=m_e, other=0)) // BS
    valid = (b_idx >= 0) & (b_idx <= own - LOCAL)
    b_key = ((b_t // chunk_size) * HK + b_hk) * NB + tl.load(tok_block0 + b_t, mask=m_e, other=0) + b_idx
    b_key = tl.where(valid, b_key, num_keys)
    if SHORT:
        tl.store(key + o_e, (b_key - 32768).to(tl.int16), mask=m_e)
    else:
        tl.store(key + o_e, b_key, mask=m_e)


def entry_keys(block_indices: torch.Tensor, meta: BlockMeta, chunk_size: int, local: int = 0,
               short: bool = False) -> torch.Tensor:
    """The flat sort keys of :func:`build_selection_csr`: (chunk, KV head, global block) of each
    entry of ``block_indices`` [T, HK, S], ``num_keys`` for an invalid one (:func:`valid_entries`);
    with ``short`` as int16, shifted by -2^15. One Triton kernel on the GPU (written by hand: the same
    in PyTorch is about ten elementwise passes over the T * HK * S entries, 0.2 ms at 64K on the H200,
    benchmarks/results/profile/variants.md#profile_nsa_by_op_64k_a17dfc8); the PyTorch form on the CPU."""
    T, HK, S = block_indices.shape
    NB = meta.num_blocks
    num_keys = _num_keys(T, HK, NB, chunk_size)
    block_indices = block_indices.contiguous()  # the kernel reads it flat
    if block_indices.is_cuda or _interpret():
        key = torch.empty(T * HK * S, device=block_indices.device, dtype=torch.int16 if short else torch.int32)
        BLOCK = 1024
        _entry_keys_kernel[(triton.cdiv(T * HK * S, BLOCK),)](
            block_indices, meta.tok_start, meta.tok_block0, key, T * HK * S, chunk_size, NB, num_keys,
            HK=HK, S=S, BS=meta.block_size, LOCAL=local, SHORT=short, BLOCK=BLOCK)
        return key
    return entry_keys_torch(block_indices, meta, chunk_size, local, short)


def entry_keys_torch(block_indices: torch.Tensor, meta: BlockMeta, chunk_size: int, local: int = 0,
                     short: bool = False) -> torch.Tensor:
    """:func:`entry_keys` in PyTorch (the CPU path, and the kernel's reference in the tests)."""
    T, HK = block_indices.shape[:2]
    device = block_indices.device
    NB = meta.num_blocks
    num_keys = _num_keys(T, HK, NB, chunk_size)
    valid = valid_entries(block_indices, meta, local)
    t = torch.arange(T, device=device, dtype=torch.int32)
    gblk = meta.tok_block0[:, None, None] + block_indices  # [T, HK, S]
    head = torch.arange(HK, device=device, dtype=torch.int32)[None, :, None]
    key = ((t // chunk_size)[:, None, None] * HK + head) * NB + gblk
    key = torch.where(valid, key, torch.full_like(key, num_keys)).flatten()
    return (key - (1 << 15)).to(torch.int16) if short else key


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _num_keys(T: int, HK: int, NB: int, chunk_size: int) -> int:
    """Keys of the CSR: (query chunk, KV head, global block); also the invalid entries' sort key."""
    return -(-T // chunk_size) * HK * NB


def build_selection_csr(block_indices: torch.Tensor, meta: BlockMeta, chunk_size: int, local: int = 0) -> SelectionCSR:
    """Groups the valid entries of ``block_indices`` [T, HK, S] by (chunk, KV head, block);
    with ``local`` > 0 the entries of a query's last ``local`` blocks are left out (:func:`valid_entries`).

    A stable sort of one int32 key per entry (invalid entries sort last), then offsets by
    ``searchsorted``: no host sync, no O(T^2 / block_size) map.
    """
    T, HK, S = block_indices.shape
    device = block_indices.device
    NB = meta.num_blocks
    num_chunks = (T + chunk_size - 1) // chunk_size
    num_keys = _num_keys(T, HK, NB, chunk_size)
    if num_keys >= 2 ** 31 or T * HK * S >= 2 ** 31:
        raise ValueError(f"T * HK * S = {T * HK * S} entries is too large for int32 indices (must be < 2^31)")
    # keys and the invalid mark fit 16 bits: a radix sort of int16 keys takes half the passes
    # (8.4M entries at 64K: 0.25 against 0.41 ms on the H200, selected/variants.md#selected_variants5)
    short = num_keys < SHORT_KEYS_BELOW
    key = entry_keys(block_indices, meta, chunk_size, local, short)
    bounds = torch.arange(num_keys + 1, device=device, dtype=torch.int32)
    if short:
        bounds = (bounds - (1 << 15)).to(torch.int16)
    sorted_key, order = torch.sort(key, stable=True)
    key_offsets = torch.searchsorted(sorted_key, bounds, out_int32=True)
    return SelectionCSR(meta=meta, HK=HK, S=S, chunk_size=chunk_size, num_chunks=num_chunks,
                        entry_ids=order.to(torch.int32), key_offsets=key_offsets, local=local)


def tile_bound(entries: int, G: int, R: int, keys: int) -> int:
    """Static bound on the tiles of R rows that ``entries`` entries (G rows each) spread over at
    most ``keys`` keys fill: each key adds at most one partial tile. Sizes launch grids without
    a host sync."""
    return (entries * G + R - 1) // R + min(entries, keys)


def _key_tile_starts(csr: SelectionCSR, G: int, BM: int) -> torch.Tensor:
    """int64 [num_keys + 1]: first tile of BM rows (G per entry) of each key, then the total."""
    counts = (csr.key_offsets[1:] - csr.key_offsets[:-1]).to(torch.int64)  # [num_keys]
    ntiles = (counts * G + BM - 1) // BM
    incl = ntiles.cumsum(0)
    return torch.cat([incl - ntiles, incl[-1:]])


def tile_schedule(csr: SelectionCSR, G: int, BM: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row tiles of BM (entry, head-in-group) rows: row r of a key is entry r // G, head r % G.

    Returns:
        tile_key: int32 [bound]: the key of each tile (entries past the last tile are junk).
        tile_first: int32 [num_keys + 1]: index of the first tile of each key, then the total.
            Keys are numbered (chunk, KV head, block), so the tiles of any run of consecutive
            keys, such as one chunk's keys of one KV head, are ``[tile_first[lo], tile_first[hi])``.
    """
    first = _key_tile_starts(csr, G, BM)
    incl = first[1:]
    E = csr.meta.T * csr.HK * csr.S
    bound = tile_bound(E, G, BM, csr.num_chunks * csr.keys_per_chunk)
    tile_key = torch.searchsorted(
        incl, torch.arange(bound, device=incl.device), right=True, out_int32=True)
    return tile_key, first.to(torch.int32)


def padded_key_rows(csr: SelectionCSR, G: int, BM: int) -> torch.Tensor:
    """int64 [num_keys + 1]: first row of each key when every key's rows (G per entry) are padded
    to a multiple of BM, then the total; a partition's rows start at its first key's value."""
    return _key_tile_starts(csr, G, BM) * BM


def multi_segment_slots(csr: SelectionCSR, G: int, R: int) -> torch.Tensor:
    """int32 [num_keys]: first buffer slot of each key split into more than one segment of R rows.

    Keys of at most R rows get no slot. The slots of a run of consecutive keys starting at key
    ``lo`` start at ``out[lo]``.
    """
    counts = (csr.key_offsets[1:] - csr.key_offsets[:-1]).to(torch.int64) * G
    nseg = (counts + R - 1) // R
    multi = torch.where(nseg > 1, nseg, torch.zeros_like(nseg))
    return (multi.cumsum(0) - multi).to(torch.int32)
