"""Preference objectives on pairs (``train.objective``; docs/trainer.md#preference-tuning).

Each takes, per pair, the summed log-probabilities of the chosen and rejected responses under the
policy (``logps`` [..., 2]) and their response token counts (``tokens`` [..., 2]); DPO also the
reference model's (``ref``). Each returns (loss, margin) per pair, where ``margin > 0`` means the
objective's implicit reward prefers the chosen response (the reported reward accuracy):

- ``dpo`` (Rafailov et al. 2023): margin = beta ((pi_c - ref_c) - (pi_r - ref_r)), loss
  -log sigmoid(margin). Needs the reference log-probabilities (taken once at the run's start).
- ``simpo`` (Meng et al. 2024), reference-free: the length-normalised reward
  beta * logp / |y|; margin = beta (pi_c / |y_c| - pi_r / |y_r|), loss -log sigmoid(margin - gamma)
  with a target reward margin gamma.
- ``orpo`` (Hong et al. 2024), reference-free: the SFT loss on the chosen response (mean token NLL)
  plus lambda times -log sigmoid of the log odds ratio, odds(y) = p / (1 - p) with p the mean
  token probability exp(pi / |y|); margin = the log odds ratio.
- ``kto`` (Ethayarajh et al. 2024) on the two responses of a pair taken as one desirable and one
  undesirable example: with r = pi - ref and the reference point z0 (the trainer's estimate: the
  mean r of the previous optimizer step's examples, clamped at 0; msa_train/trainer.py _pair_step),
  the mean of lambda_D (1 - sigmoid(beta (r_c - z0))) and lambda_U (1 - sigmoid(beta (z0 - r_r)));
  margin = beta (r_c - r_r), as DPO's. Needs the reference log-probabilities. On unpaired examples
  (``desirable`` given, data.format=kto) the first column holds each example and the second its
  padding: loss lambda_D (1 - sigmoid(beta (r - z0))) for a desirable example, lambda_U (1 -
  sigmoid(beta (z0 - r))) for an undesirable one; margin beta (r - z0), negated for an undesirable
  one, so that margin > 0 when the implicit reward sides with the label.

Written here rather than taken from TRL: TRL's trainers compute these inside their own
``Trainer`` subclasses from full-vocabulary logits of padded batches, while ours come from the
chunked loss's per-segment sums of packed pairs (and are summed over the SP group first).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from msa_train.config import PAIR_OBJECTIVES, WITH_REFERENCE


def _log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of p = exp(mean_logp) <= 1, stably: log(1 - p) = log(-expm1(mean_logp))."""
    x = mean_logp.clamp(max=-1e-6)  # p = 1 exactly would make the odds infinite
    return x - torch.log(-torch.expm1(x))


def pair_loss(objective: str, logps: torch.Tensor, tokens: torch.Tensor, ref: Optional[torch.Tensor] = None, *,
              beta: float = 0.1, simpo_gamma: float = 1.0, orpo_lambda: float = 0.1, kto_z0=None,
              kto_weights: Tuple[float, float] = (1.0, 1.0), desirable: Optional[torch.Tensor] = None
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(loss, margin) per pair for ``objective`` (see the module doc); ``logps``, ``tokens`` and ``ref``
    have the pair (chosen, rejected) in the last dimension. ``beta`` is DPO's, SimPO's or KTO's;
    ``kto_z0`` KTO's reference point and ``kto_weights`` its (lambda_D, lambda_U); ``desirable``
    (bool, KTO only) the labels of unpaired examples."""
    chosen, rejected = logps[..., 0], logps[..., 1]
    if objective in WITH_REFERENCE and ref is None:
        raise ValueError(f"pair_loss: {objective} needs the reference log-probabilities")
    if desirable is not None:
        if objective != "kto":
            raise ValueError(f"pair_loss: unpaired examples (desirable=...) train with kto, not {objective}")
        z = beta * (chosen - ref[..., 0] - (0.0 if kto_z0 is None else kto_z0))
        loss = torch.where(desirable, kto_weights[0] * (1 - torch.sigmoid(z)), kto_weights[1] * torch.sigmoid(z))
        return loss, torch.where(desirable, z, -z)
    if objective == "dpo":
        margin = beta * ((chosen - ref[..., 0]) - (rejected - ref[..., 1]))
        return -F.logsigmoid(margin), margin
    if objective == "kto":
        r_c, r_r = chosen - ref[..., 0], rejected - ref[..., 1]
        z0 = 0.0 if kto_z0 is None else kto_z0
        loss = 0.5 * (kto_weights[0] * (1 - torch.sigmoid(beta * (r_c - z0)))
                      + kto_weights[1] * (1 - torch.sigmoid(beta * (z0 - r_r))))
        return loss, beta * (r_c - r_r)
    n = tokens.to(logps.dtype).clamp(min=1)
    mean_c, mean_r = chosen / n[..., 0], rejected / n[..., 1]
    if objective == "simpo":
        margin = beta * (mean_c - mean_r)
        return -F.logsigmoid(margin - simpo_gamma), margin
    if objective == "orpo":
        margin = _log_odds(mean_c) - _log_odds(mean_r)
        return -mean_c - orpo_lambda * F.logsigmoid(margin), margin
    raise ValueError(f"pair_loss: objective={objective!r}; expected one of {PAIR_OBJECTIVES}")
