"""Ulysses sequence parallelism: the sequence of one sample is split over the ranks of a group.

Every rank of a sequence-parallel (SP) group of P ranks holds ``T / P`` consecutive tokens of the
same packed sequence and runs the token-wise layers (embeddings, norms, projections, MLPs, the
loss) on them. Attention needs whole sequences (NSA selects blocks over all of them), so around
it an all-to-all turns the sequence-sharded ``[B, T/P, H, D]`` q/k/v (and NSA's per-head gates)
into head-sharded ``[B, T, H/P, D]``: each rank attends over the whole sequence with ``HQ/P``
query heads, and a second all-to-all brings the output back to the rank's tokens. This is the
DeepSpeed-Ulysses scheme.

Heads (:func:`head_layout`, defined with the config's validation): P must divide the query heads HQ. When it also divides the KV heads
HK, each rank gets ``HK/P`` of them. When it exceeds them (P a multiple of HK), each KV head is
replicated on the ``P/HK`` consecutive ranks whose query heads belong to its GQA group, as
DeepSpeed's Ulysses for HF does: k/v are repeated before the all-to-all, and autograd sums the
copies' gradients back (the repeat's backward); the compression parameters of a replicated KV head
are used by each of its ranks, and ZeRO's gradient reduction adds their parts.

NSA with replicated KV heads: a GQA group shares its selected blocks, scored by the compressed-
attention probabilities summed over the group's query heads. A rank holding part of a group
all-gathers, from the other ranks sharing its KV head, their queries and compressed-attention
lse (detached: selection has no gradient), so each of them selects from the whole group's scores:
the same blocks as one rank, computed by every rank holding a copy (:meth:`SequenceParallel.gather_group`).

Groups: ranks ``[i*P, (i+1)*P)`` form SP group i, which is data-parallel rank i of ``W / P``.
Gradients need no special handling: ZeRO averages them over all W ranks, and the trainer scales
each rank's loss by ``W / (global label tokens)`` with the label tokens counted per shard, so the
sum over the SP ranks' partial gradients is exactly that of the sample's token-mean loss.

The all-to-all is written here on ``torch.distributed.all_to_all_single`` (a few lines) rather
than taken from DeepSpeed: ``deepspeed.sequence.layer.DistributedAttention`` exchanges q, k and v
only, while NSA also needs its per-head gates exchanged and, with replicated KV heads, the group's
queries and lse gathered between its compressed attention and its block selection, inside the op;
the autograd all-to-all behind it (``_SeqAllToAll``) is private and its signature has changed
between DeepSpeed releases.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from msa_train.config import HeadLayout, head_layout  # the rule is config validation too
from msa_train.models.attention import SP_ATTR

__all__ = ["HeadLayout", "ParallelLayout", "SP_ATTR", "SequenceParallel", "attach", "build_layout", "head_layout"]


def _all_to_all(x: torch.Tensor, group, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    # chunk i of x along scatter_dim goes to rank i; the chunks received are joined along
    # gather_dim in rank order
    inp = torch.stack([c.contiguous() for c in x.chunk(size, dim=scatter_dim)])
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=group)
    return torch.cat(out.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the gradient takes the opposite exchange."""

    @staticmethod
    def forward(ctx, x, group, size: int, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.size, ctx.dims = group, size, (scatter_dim, gather_dim)
        return _all_to_all(x, group, size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, ctx.size, gather_dim, scatter_dim), None, None, None, None


def _gather_heads(group, size: int, *xs: torch.Tensor) -> tuple:
    """All-gather each ``[T, h, ...]`` tensor of the ranks of ``group`` along the heads, in rank
    order (no gradient: it serves NSA's block selection)."""
    out = []
    for x in xs:
        x = x.detach().contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        out.append(torch.cat(parts, dim=1))
    return tuple(out)


@dataclass(frozen=True)
class SequenceParallel:
    """One rank's view of its SP group (``flash_msa.NativeSparseAttention`` takes it as ``sequence_parallel``)."""
    group: Optional[dist.ProcessGroup]
    rank: int          # rank inside the SP group: it holds tokens [rank*T/P, (rank+1)*T/P)
    size: int          # P
    # m -> the group of the m consecutive ranks of this SP group that share a KV head replicated m times
    kv_groups: Dict[int, Optional[dist.ProcessGroup]] = field(default_factory=dict)

    def to_heads(self, x: torch.Tensor, seq_dim: int, head_dim: int) -> torch.Tensor:
        """Sequence-sharded -> head-sharded: ``T/P`` tokens of all heads -> all ``T`` tokens of
        heads ``[rank*H/P, (rank+1)*H/P)``. H must be a multiple of P."""
        if x.shape[head_dim] % self.size:
            raise ValueError(f"sequence parallelism: {x.shape[head_dim]} heads do not split over "
                             f"parallel.sp_degree={self.size} ranks")
        return _AllToAll.apply(x, self.group, self.size, head_dim, seq_dim)

    def kv_to_heads(self, x: torch.Tensor, seq_dim: int, head_dim: int) -> torch.Tensor:
        """:meth:`to_heads` for keys and values: with fewer KV heads than ranks (P a multiple of
        them) each is first repeated on the ranks of its query heads, so the rank gets one."""
        hk = x.shape[head_dim]
        if hk < self.size:
            if self.size % hk:
                raise ValueError(f"sequence parallelism: {hk} KV heads do not split over, nor replicate onto, "
                                 f"parallel.sp_degree={self.size} ranks")
            x = x.repeat_interleave(self.size // hk, dim=head_dim)  # backward: the copies' gradients summed
        return self.to_heads(x, seq_dim, head_dim)

    def to_sequence(self, x: torch.Tensor, seq_dim: int, head_dim: int) -> torch.Tensor:
        """The inverse of :meth:`to_heads`."""
        return _AllToAll.apply(x, self.group, self.size, seq_dim, head_dim)

    def kv_shard(self, p: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's KV heads of a per-KV-head tensor (e.g. NSA's compression parameters
        ``[HK, ...]``), the heads :meth:`kv_to_heads` gives it (a view)."""
        hk = p.shape[dim]
        if hk >= self.size:
            n = hk // self.size
            return p.narrow(dim, self.rank * n, n)
        return p.narrow(dim, self.rank // (self.size // hk), 1)

    def gather_group(self, num_kv_heads: int) -> Optional[Callable]:
        """For NSA's block selection with ``num_kv_heads`` KV heads: None when each rank holds whole
        GQA groups; else ``(q [T, h, D], lse [T, h]) -> (q, lse)`` of all the query heads of the
        rank's KV head, gathered from the ranks sharing it (a collective of those ranks)."""
        if num_kv_heads >= self.size:
            return None
        m = self.size // num_kv_heads
        group = self.kv_groups[m] if m < self.size else self.group

        def gather(q: torch.Tensor, lse: torch.Tensor):
            return _gather_heads(group, m, q, lse)

        return gather

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (a view)."""
        n = x.shape[dim] // self.size
        return x.narrow(dim, self.rank * n, n)


@dataclass(frozen=True)
class ParallelLayout:
    """How the W ranks split into data-parallel ranks and SP groups."""
    dp_rank: int
    dp_size: int
    sp: Optional[SequenceParallel]  # None when parallel.sp_degree == 1


def build_layout(sp_degree: int, rank: int, world_size: int,
                 timeout: Optional[datetime.timedelta] = None) -> ParallelLayout:
    """Make the SP groups, and within each the groups of ranks that can share a replicated KV head
    (a collective: every rank calls it, in the same order). ``timeout`` bounds their collectives
    (None: the default process group's)."""
    if sp_degree < 1 or world_size % sp_degree:
        raise ValueError(f"parallel.sp_degree={sp_degree} must divide the number of processes ({world_size})")
    if sp_degree == 1:
        return ParallelLayout(rank, world_size, None)
    kw = {} if timeout is None else {"timeout": timeout}

    def groups(size: int) -> Optional[dist.ProcessGroup]:
        mine = None
        for start in range(0, world_size, size):  # dist.new_group is collective over all ranks
            ranks = list(range(start, start + size))
            group = dist.new_group(ranks, **kw)
            if rank in ranks:
                mine = group
        return mine

    sp_group = groups(sp_degree)
    # replicas m of a KV head: m = P / HK for any HK dividing P (m = P is the SP group itself)
    kv_groups = {m: groups(m) for m in range(2, sp_degree) if sp_degree % m == 0}
    sp = SequenceParallel(group=sp_group, rank=rank % sp_degree, size=sp_degree, kv_groups=kv_groups)
    return ParallelLayout(rank // sp_degree, world_size // sp_degree, sp)


def attach(model: torch.nn.Module, sp: Optional[SequenceParallel]) -> int:
    """Give every attention module patched by msa_train the SP group; returns how many got it."""
    from msa_train.models import _HOOKED  # the mark patch_model leaves on the modules it patched

    n = 0
    for module in model.modules():
        if getattr(module, _HOOKED, False):
            setattr(module, SP_ATTR, sp)
            n += 1
    return n
