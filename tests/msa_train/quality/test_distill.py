"""model.nsa_init=distill (msa_train/models/distill.py): the NSA output approaches the dense output."""
import pytest
import torch

from tests.msa_train._util import compose


def test_distill_lowers_the_attention_error_and_touches_only_nsa():
    from msa_train.models import build_model
    from msa_train.models.distill import distill_nsa

    cfg = compose(["attention=nsa", "model.hf_config.num_hidden_layers=1"])
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.attention)
    with torch.no_grad():  # a model whose attention is not near-uniform, so phi has something to fit
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(8.0)
    batch = {"input_ids": torch.randint(0, 259, (1, 160)), "position_ids": torch.arange(160)[None],
             "cu_seqlens": torch.tensor([0, 60, 160], dtype=torch.int32), "max_seqlen": 100}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = distill_nsa(model, [batch], steps=6, lr=1e-2)
    losses = report["losses"]
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0], losses
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (".nsa." in n), n  # NSA parameters moved, nothing else did
        assert p.requires_grad
    assert model.config._attn_implementation == "msa_nsa"


def test_distill_config_errors():
    with pytest.raises(ValueError, match="model.nsa_init=distill fits NSA"):
        compose(["attention=full", "model.nsa_init=distill"])
    with pytest.raises(ValueError, match="model.nsa_init='warm'"):
        compose(["model.nsa_init=warm"])
