"""GRPO (Shao et al. 2024): online RL with a verifiable reward (``train.objective=grpo``; docs/trainer.md#grpo).

One optimizer step, on every rank:

1. **Rollouts.** For each of its ``train.grad_accum`` prompts, the policy samples a group of
   ``train.grpo_group`` completions with ``generate()`` (one batched call per prompt, the prompt
   repeated; both backends decode through their KV-cache path: ``msa_full``'s SDPA, NSA's
   ``flash_msa.decode``).
2. **Rewards.** Each completion is scored by ``train.grpo_reward`` (:data:`REWARDS`) against the
   prompt's answer: whether a retrieval task of the quality study was answered, say. The group's
   advantage of each completion is its reward's z-score within the group (:func:`group_advantages`).
3. **Loss.** The completions are packed into one sequence per group (each prompt + completion its
   own document); the policy's per-token log-probabilities come from the chunked loss's
   per-segment sums, one segment per token. Per completion token t of completion i:
   ``A_i * (-log pi(t)) + beta * KL_t`` with KL_t Schulman's k3 estimator
   ``exp(r) - r - 1``, r = log pi_ref(t) - log pi(t) (:func:`grpo_token_loss`), summed over the
   step's completion tokens and divided by their number over all ranks (token-level, as DAPO).
   Each rollout trains one optimizer step (GRPO's mu = 1, TRL's default), so PPO's ratio
   pi / pi_old is 1 where it is differentiated and its clipping never applies: the surrogate is
   exactly the policy-gradient term above.

The reference policy pi_ref is the run's starting model. No second model is held: the starting
values of the *trainable* parameters are kept (:class:`StartingWeights`) and swapped in, by
pointer, for one no-grad forward per group. Under LoRA that is the adapters (whose B starts at 0)
and NSA's parameters, a few hundred MB for an 8B model; under full fine-tuning it is a copy of the
weights. ``train.grpo_beta=0`` drops the KL term and keeps nothing.

Written here rather than taken from TRL's ``GRPOTrainer``: it is an HF ``Trainer`` subclass with
its own generation, padding and batching (vLLM or padded ``generate``), while ours must run
through DeepSpeed's engine, the packed varlen batches, the chunked loss and the trainer's
checkpoints; the math above is the same as TRL's ``loss_type="dapo"`` with ``num_iterations=1``.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn


def _normalise(text: str) -> str:
    return " ".join(text.split())


def reward_exact(completion: str, answer: str) -> float:
    """1 when the completion, whitespace-normalised, is the answer, else 0."""
    return float(_normalise(completion) == _normalise(answer))


def reward_prefix(completion: str, answer: str) -> float:
    """1 when the whitespace-normalised completion starts with the answer (what follows it is not
    judged: a retrieval answer followed by the rest of a sentence counts), else 0."""
    return float(_normalise(completion).startswith(_normalise(answer)))


def reward_chars(completion: str, answer: str) -> float:
    """Partial credit: the fraction of the answer's characters that the whitespace-normalised completion
    has at the same positions from its start (1 exactly when ``prefix`` gives 1)."""
    c, a = _normalise(completion), _normalise(answer)
    return sum(x == y for x, y in zip(c, a)) / max(1, len(a))


REWARDS: Dict[str, Callable[[str, str], float]] = {"exact": reward_exact, "prefix": reward_prefix,
                                                   "chars": reward_chars}


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages of one group's rewards [G]: (r - mean) / (std + eps), std with Bessel's
    correction (torch's default, as TRL); all 0 when the group's rewards are equal (no completion is
    better than another)."""
    r = rewards.double()
    return ((r - r.mean()) / (r.std() + eps)).to(rewards.dtype)


def grpo_token_loss(nll: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, ref_nll: Optional[torch.Tensor],
                    beta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token GRPO loss summed over the completion tokens (see the module doc).

    Args:
        nll: [T] the policy's -log pi of every position's next token (differentiable).
        advantages: [T] the advantage of the completion each position's next token belongs to.
        mask: [T] bool, the positions whose next token is a completion token.
        ref_nll: [T] the reference policy's -log pi_ref, or None (``beta`` must then be 0).
        beta: the KL coefficient.

    Returns:
        (loss summed over the masked positions, KL summed over them, detached)
    """
    pg = advantages * nll
    if ref_nll is None or beta == 0:
        zero = nll.new_zeros(())
        return (pg * mask).sum(), zero
    r = (nll - ref_nll).clamp(max=20.0)  # log pi_ref - log pi; clamped: exp of a rare huge gap stays finite
    kl = torch.exp(r) - r - 1
    return ((pg + beta * kl) * mask).sum(), (kl * mask).sum().detach()


def pack_group(prompt: torch.Tensor, completions: Sequence[torch.Tensor], advantages: torch.Tensor) -> Dict:
    """One group's rollouts as a packed row: every (prompt + completion) its own document.

    Args:
        prompt: int64 [P] the prompt's tokens.
        completions: G int64 tensors, each completion's tokens (up to and with its EOS).
        advantages: [G] their advantages.

    Returns:
        ``input_ids`` / ``labels`` / ``position_ids`` (int64 [T]; labels only on completion tokens,
        aligned with input_ids as in packing.py), ``cu_seqlens`` (int32 [G+1]), ``max_seqlen``,
        ``num_tokens``, ``advantages`` (float32 [T]: every position its document's advantage, so
        also that of the next-token target the position predicts).
    """
    from msa_train.data.packing import pack_segments

    ignore = torch.full((len(prompt),), -100, dtype=torch.int64)
    segments = [(torch.cat([prompt, c]), torch.cat([ignore, c])) for c in completions]
    lengths = torch.tensor([len(ids) for ids, _ in segments])
    packed = pack_segments(segments, int(lengths.sum()), pad_id=0)  # exactly full: no padding
    return {**packed, "advantages": advantages.float().repeat_interleave(lengths)}


def completion_of(tokens: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """A sampled row's completion: its tokens up to and with the first EOS (generate() pads after it)."""
    if eos_ids:
        hit = torch.isin(tokens, torch.tensor(list(eos_ids), dtype=tokens.dtype)).nonzero()
        if len(hit):
            return tokens[: int(hit[0]) + 1]
    return tokens


class StartingWeights:
    """The starting values of a model's trainable parameters (the reference policy), on the device,
    and :meth:`swapped_in` to run the model with them for a moment: each parameter's ``.data`` is
    pointed at its starting tensor and back, no copy. For ZeRO 0-2, where every rank holds whole
    parameters (ZeRO-3 holds shards; the trainer refuses GRPO with a KL term there)."""

    def __init__(self, model: nn.Module, state: Optional[Dict[str, torch.Tensor]] = None):
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if state is None:
            state = {n: p.detach().clone() for n, p in params.items()}
        missing = sorted(set(params) - set(state))
        if missing:
            raise ValueError(f"GRPO reference: no starting value for {len(missing)} trainable parameters "
                             f"(first: {missing[0]}); was the run's trainable set changed (model.lora.*)?")
        self.params = params
        self.state = {n: state[n].to(device=p.device, dtype=p.dtype) for n, p in params.items()}

    @contextlib.contextmanager
    def swapped_in(self):
        saved = {}
        for n, p in self.params.items():
            saved[n], p.data = p.data, self.state[n]
        try:
            yield
        finally:
            for n, p in self.params.items():
                p.data = saved[n]

    def numel(self) -> int:
        return sum(t.numel() for t in self.state.values())


def _generate(model: nn.Module, ids: torch.Tensor, max_new_tokens: int, pad_id: int, eos_ids: List[int],
              temperature: Optional[float] = None) -> torch.Tensor:
    """generate() under a generation config of its own, not the model's: a checkpoint's
    generation_config.json (Qwen2.5's top_k 20 and repetition penalty 1.05, Llama 3 Instruct's top_p
    0.9) would reshape the distribution the rollouts are sampled from, and the policy gradient needs
    the policy's own. transformers fills what a passed config leaves unset from the model's, so the
    model's is swapped for the defaults (no penalty, no filter, no forced length) for the call."""
    from transformers import GenerationConfig

    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else \
        dict(do_sample=False)
    config = GenerationConfig(max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_ids or None,
                              **sampling)
    own, model.generation_config = model.generation_config, GenerationConfig()
    try:
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        model.generation_config = own


def sample_group(model: nn.Module, prompt: torch.Tensor, group: int, max_new_tokens: int, temperature: float,
                 pad_id: int, eos_ids: List[int]) -> List[torch.Tensor]:
    """``group`` sampled completions of one prompt (int64 [P] on the model's device): one generate()
    call with the prompt repeated, on the KV-cache path; each completion cut after its first EOS, on
    the host."""
    out = _generate(model, prompt[None].expand(group, -1), max_new_tokens, pad_id, eos_ids, temperature)
    new = out[:, prompt.shape[0]:].cpu()
    return [completion_of(row, eos_ids) for row in new]


def greedy_completion(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, pad_id: int,
                      eos_ids: List[int]) -> torch.Tensor:
    """The greedy completion of one prompt (int64 [P] on the model's device), cut after its first EOS."""
    out = _generate(model, prompt[None], max_new_tokens, pad_id, eos_ids)
    return completion_of(out[0, prompt.shape[0]:].cpu(), eos_ids)
