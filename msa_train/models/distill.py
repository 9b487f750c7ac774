"""``model.nsa_init=distill``: fit NSA's own parameters to the dense attention of the model before training.

A dense-pretrained model patched with NSA starts with phi as mean pooling and every gate at 1/3
(``NativeSparseAttention.reset_parameters``): its attention output is no longer the one its
later layers were trained on, and the loss jumps. Distillation first trains only the NSA
parameters (compression phi of keys and values, gates) so that, layer by layer, the NSA output
matches the dense attention output on the same q, k, v:

- every attention layer runs the ``msa_distill`` backend for these steps: it computes dense
  causal attention (no gradient, the target) and NSA on detached q / k / v, keeps the relative
  squared error ``|o_nsa - o_dense|^2 / |o_dense|^2`` on the module, and returns the dense output,
  so every layer sees the hidden states of the dense model it is distilled from;
- the loss is the mean of the layers' errors; AdamW on the NSA parameters only, the rest frozen.

Cost: one forward of the decoder (no LM head) and one backward through the NSA branches per step,
about a third of a training step. The trainer then trains the whole model as usual.
"""
from __future__ import annotations

import time
from typing import Dict, List

import torch

from msa_train.models.attention import DISTILL, _HIDDEN, _full_attention, select_impl

_LOSS = "_msa_distill_loss"


def distill_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout: float = 0.0,
                              cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """Dense output (returned) and the NSA output's relative error to it (kept on the module).

    Args:
        query: [B, HQ, T, D]; key, value: [B, HK, T, D] (HF layout); cu_seq_lens_q: int32 [N+1] or None.

    Returns:
        ([B, T, HQ, D] dense attention, None)
    """
    hidden = getattr(module, _HIDDEN, None)
    setattr(module, _HIDDEN, None)
    with torch.no_grad():
        target = _full_attention(query, key, value, scaling, cu_seq_lens_q, max_length_q)
    nsa = module.nsa
    select_impl(nsa, query)
    q, k, v = (x.detach().transpose(1, 2) for x in (query, key, value))
    out = nsa(hidden.detach(), q, k, v, cu_seqlens=cu_seq_lens_q, scale=scaling)
    t = target.float()
    setattr(module, _LOSS, (out.float() - t).pow(2).mean() / t.pow(2).mean().clamp_min(1e-12))
    return target, None


def distill_nsa(model: torch.nn.Module, batches: List[Dict[str, torch.Tensor]], steps: int, lr: float) -> Dict:
    """Train the NSA parameters of a patched model against its dense attention (module doc).

    Args:
        model: a model patched by ``patch_model`` with a sparse attention.
        batches: packed micro-batches on the model's device (``input_ids``, ``position_ids`` [1, T],
            ``cu_seqlens`` int32 [N+1], ``max_seqlen`` int), cycled through.
        steps: optimizer steps; lr: AdamW's learning rate.

    Returns:
        ``{"steps", "lr", "losses" (per step), "time_s"}``.
    """
    from transformers import AttentionInterface

    from msa_train.models import family_of

    if steps < 1 or not batches:
        raise ValueError("distill_nsa: needs steps >= 1 and at least one batch")
    modules = [m for m in family_of(model.config).attention_modules(model) if hasattr(m, "nsa")]
    if not modules:
        raise ValueError("model.nsa_init=distill: the model has no NSA modules (attention=full?)")
    AttentionInterface.register(DISTILL, distill_attention_forward)
    params = [p for m in modules for p in m.nsa.parameters()]
    frozen = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    previous = model.config._attn_implementation
    model.config._attn_implementation = DISTILL
    was_training = model.training
    model.train()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses: List[float] = []
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            b = batches[step % len(batches)]
            cu = b["cu_seqlens"]
            model.model(input_ids=b["input_ids"], position_ids=b["position_ids"], use_cache=False,
                        cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=b["max_seqlen"], max_length_k=b["max_seqlen"])
            loss = torch.stack([getattr(m, _LOSS) for m in modules]).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())  # host sync per step: a setup phase of a few dozen steps
            for m in modules:
                setattr(m, _LOSS, None)
    finally:
        model.config._attn_implementation = previous
        for p, flag in frozen.items():
            p.requires_grad_(flag)
        model.train(was_training)
    return {"steps": steps, "lr": lr, "losses": losses, "time_s": time.perf_counter() - t0}
