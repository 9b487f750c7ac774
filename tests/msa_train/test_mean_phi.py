"""model.nsa_phi=mean (msa_train/models/__init__.py: freeze_mean_phi): NSA's compression as plain
mean pooling, its parameters zero and frozen, through training, resume and the memory planner."""
import pytest
import torch

from tests.msa_train._util import FAST, compose, train


def test_mean_phi_compresses_by_mean_pooling_and_freezes_phi():
    from flash_msa.reference import compress_kv
    from msa_train.models import build_model, freeze_mean_phi, phi_parameters

    cfg = compose(["attention=nsa"])
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.attention)
    phi = list(phi_parameters(model))
    layers = cfg.model.hf_config["num_hidden_layers"]
    assert len(phi) == 6 * layers and any(p.abs().sum() > 0 for p in phi)  # weight, pos, proj for k and v
    assert freeze_mean_phi(model) == sum(p.numel() for p in phi)
    assert all(not p.requires_grad and not p.any() for p in phi)
    nsa = model.model.layers[0].self_attn.nsa
    x = torch.randn(100, nsa.num_kv_heads, nsa.head_dim)
    cu = torch.tensor([0, 37, 100], dtype=torch.int32)
    block, stride = nsa.sizes["cmp_block"], nsa.sizes["cmp_stride"]
    c = nsa.compress_k
    out, _ = compress_kv(x, c.weight, c.pos, cu, block, stride, proj=c.proj)
    # the mean of each block's keys: blocks of `block` tokens every `stride` tokens within a sequence
    want = [x[s + i * stride: s + i * stride + block].mean(0) for s, e in ((0, 37), (37, 100))
            for i in range((e - s - block) // stride + 1)]
    assert len(want) > 2 and torch.allclose(out[:len(want)], torch.stack(want), atol=1e-6)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad and ".nsa." in n}
    assert trainable and all(".nsa.gate." in n for n in trainable)  # the gates are NSA's only trained parameters


def test_mean_phi_training_keeps_phi_zero_and_resumes(tmp_path):

    run = tmp_path / "run"
    common = [*FAST, "attention=nsa", "model.nsa_phi=mean", "train.steps=4", "train.save_every=2",
              f"train.output_dir={run}"]
    summary, records = train(common, stop_after=2)
    from msa_train.trainer import Trainer

    resumed = Trainer(compose([*common, "train.resume=auto"]))
    assert resumed.step == 2
    phi = [p for n, p in resumed.model.named_parameters() if ".nsa.compress_" in n]
    gates = [p for n, p in resumed.model.named_parameters() if ".nsa.gate." in n]
    assert phi and all(not p.requires_grad and not p.any() for p in phi)
    assert any(p.requires_grad and p.abs().sum() > 0 for p in gates if p.dim() == 2)  # the gate weights left 0
    resumed.train()
    assert all(not p.any() for p in phi)


def test_mean_phi_config_and_planner():
    from msa_train.parallel.planner import ModelShape

    with pytest.raises(ValueError, match="model.nsa_phi=mean sets NSA's compression to mean pooling: it needs a sparse"):
        compose(["attention=full", "model.nsa_phi=mean"])
    with pytest.raises(ValueError, match="choose one"):
        compose(["attention=nsa", "model.nsa_phi=mean", "model.nsa_init=distill"])
    with pytest.raises(ValueError, match="model.nsa_phi='mpl'"):
        compose(["model.nsa_phi=mpl"])
    cfg = compose(["recipe=llama3_8b_64k", "data=generated", "model.nsa_phi=mean"])
    shape, base = ModelShape.from_config(cfg.model, cfg.attention), ModelShape.from_config(
        compose(["recipe=llama3_8b_64k", "data=generated"]).model, cfg.attention)
    phi = 32 * 2 * 8 * (32 * 128 * 128 + 32 * 128 + 128 * 128)  # layers x (k, v) x KV heads x (W, pos, proj)
    assert base.trainable is None and shape.params == base.params and shape.trainable == base.params - phi
    assert shape.head_trains and not ModelShape.from_config(
        compose(["recipe=llama3_8b_64k", "data=generated", "model.lora.r=16"]).model, cfg.attention).head_trains
