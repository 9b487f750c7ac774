"""Ulysses sequence parallelism: the sequence of one sample is split over the ranks of a group.

Every rank of a sequence-parallel (SP) group of P ranks holds ``T / P`` consecutive tokens of the
same packed sequence and runs the token-wise layers (embeddings, norms, projections, MLPs, the
loss) on them. Attention needs whole sequences (NSA selects blocks over all of them), so around
it an all-to-all turns the sequence-sharded ``[B, T/P, H, D]`` q/k/v (and NSA's per-head gates)
into head-sharded ``[B, T, H/P, D]``: each rank attends over the whole sequence with ``H/P`` query
heads and ``HK/P`` KV heads, and a second all-to-all brings the output back to the rank's tokens.
This is the DeepSpeed-Ulysses scheme.

Groups: ranks ``[i*P, (i+1)*P)`` form SP group i, which is data-parallel rank i of ``W / P``.
Gradients need no special handling: ZeRO averages them over all W ranks, and the trainer scales
each rank's loss by ``W / (global label tokens)`` with the label tokens counted per shard, so the
sum over the SP ranks' partial gradients is exactly that of the sample's token-mean loss.

The all-to-all is written here on ``torch.distributed.all_to_all_single`` (a few lines) rather
than taken from DeepSpeed: ``deepspeed.sequence.layer.DistributedAttention`` exchanges q, k and v
only, and NSA also needs its gates exchanged; the autograd all-to-all behind it (``_SeqAllToAll``)
is private and its signature has changed between DeepSpeed releases.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

# attribute of each patched attention module holding its SequenceParallel (None: off)
SP_ATTR = "msa_sequence_parallel"


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


@dataclass(frozen=True)
class SequenceParallel:
    """One rank's view of its SP group (``flash_msa.NativeSparseAttention`` takes it as ``sequence_parallel``)."""
    group: Optional[dist.ProcessGroup]
    rank: int          # rank inside the SP group: it holds tokens [rank*T/P, (rank+1)*T/P)
    size: int          # P

    def to_heads(self, x: torch.Tensor, seq_dim: int, head_dim: int) -> torch.Tensor:
        """Sequence-sharded -> head-sharded: ``T/P`` tokens of all heads -> all ``T`` tokens of
        heads ``[rank*H/P, (rank+1)*H/P)``. H must be a multiple of P."""
        if x.shape[head_dim] % self.size:
            raise ValueError(f"sequence parallelism: {x.shape[head_dim]} heads do not split over "
                             f"parallel.sp_degree={self.size} ranks")
        return _AllToAll.apply(x, self.group, self.size, head_dim, seq_dim)

    def to_sequence(self, x: torch.Tensor, seq_dim: int, head_dim: int) -> torch.Tensor:
        """The inverse of :meth:`to_heads`."""
        return _AllToAll.apply(x, self.group, self.size, seq_dim, head_dim)

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


def build_layout(sp_degree: int, rank: int, world_size: int) -> ParallelLayout:
    """Make the SP groups (a collective: every rank calls it, in the same order)."""
    if sp_degree < 1 or world_size % sp_degree:
        raise ValueError(f"parallel.sp_degree={sp_degree} must divide the number of processes ({world_size})")
    if sp_degree == 1:
        return ParallelLayout(rank, world_size, None)
    mine = None
    for i in range(world_size // sp_degree):  # dist.new_group is collective over all ranks
        ranks = list(range(i * sp_degree, (i + 1) * sp_degree))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    sp = SequenceParallel(group=mine, rank=rank % sp_degree, size=sp_degree)
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
