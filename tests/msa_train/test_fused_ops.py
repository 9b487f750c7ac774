"""parallel.fused_ops: the RMSNorm and RoPE kernels against float64 references (HF's formulas), and
the patched models and training against HF's own code. On CPU the kernels run in Triton's
interpreter, whose casts to bf16 truncate (the GPU's round to nearest): bf16 gets a wider bound there."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from msa_train.config import AttentionConfig, ModelConfig
from msa_train.models import build_model
from msa_train.models import fused_ops as fo
from msa_train.parallel.engine import parallelize
from tests.msa_train._util import FAST, train
from tests.msa_train.test_models import SMALL_NSA, TINY

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _bound(dtype):
    return 5e-3 if dtype == torch.float32 or DEV == "cuda" else 1.5e-2


def _hf_norm64(x, w, eps, dtype):
    """HF's RMSNorm in float64, with its rounding of the normalised rows to the input dtype."""
    x64 = x.double()
    h = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).double()
    return w.double() * h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 37, 64), (1, 9, 100), (3, 11, 5, 16), (1, 3, 1024)])
def test_rms_norm_kernel_matches_hf_forward_and_backward(shape, dtype):
    """Widths that are and are not powers of two, per-head norms (Qwen3's q/k norms: [B, T, H, D]),
    several rows a tile and one; x and weight gradients."""
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(DEV, dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
    x = torch.randn(shape, device=DEV, dtype=dtype, requires_grad=True)
    y = fo._RMSNorm.apply(x, norm.weight, norm)
    assert y.shape == x.shape and y.dtype == dtype
    g = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, norm.weight), g)
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    ref = _hf_norm64(x64, w64, 1e-5, dtype)
    rdx, rdw = torch.autograd.grad(ref, (x64, w64), g.double())
    assert _rel(y, ref) < _bound(dtype)
    assert _rel(dx, rdx) < _bound(dtype) and _rel(dw, rdw) < _bound(dtype)
    if dtype == torch.float32:  # HF's own fp32 module, to rounding
        assert _rel(y, LlamaRMSNorm.forward(norm, x)) < 1e-6
    dx2, dw2 = torch.autograd.grad(fo._RMSNorm.apply(x, norm.weight, norm), (x, norm.weight), g)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)  # deterministic: no atomics


def test_rms_norm_kernel_gives_only_the_gradients_asked_for():
    norm = LlamaRMSNorm(48).to(DEV)
    x = torch.randn(2, 30, 48, device=DEV)
    norm.weight.requires_grad_(True)
    (dw,) = torch.autograd.grad(fo._RMSNorm.apply(x, norm.weight, norm).square().sum(), norm.weight)
    ref = torch.autograd.grad(LlamaRMSNorm.forward(norm, x).square().sum(), norm.weight)[0]
    assert _rel(dw, ref) < 1e-5
    x.requires_grad_(True)
    norm.weight.requires_grad_(False)
    y = fo._RMSNorm.apply(x, norm.weight, norm)
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert _rel(dx, torch.autograd.grad(LlamaRMSNorm.forward(norm, x).sum(), x)[0]) < 1e-5


def _cos_sin(batch, T, D, dtype, theta=10000.0):
    pos = torch.randint(0, 4 * T, (batch, T), device=DEV).sort(-1).values  # packed documents restart
    inv = 1.0 / theta ** (torch.arange(0, D, 2, device=DEV).double() / D)
    emb = torch.cat([pos[..., None].double() * inv] * 2, -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,HQ,HK,T,D,cos_batch", [(2, 4, 2, 13, 16, 2), (1, 20, 5, 9, 64, 1), (2, 6, 6, 7, 128, 1)])
def test_rope_dispatch_matches_hf(B, HQ, HK, T, D, cos_batch, dtype):
    """The dispatcher on tagged cos/sin against HF's apply_rotary_pos_emb in float64: q and k
    in HF's layout ([B, H, T, D] views of projection outputs), more heads than one program takes
    (20 > 16), cos/sin per sequence or shared; the gradients; untagged cos/sin get HF's function."""
    hf = modeling_llama.apply_rotary_pos_emb
    hf = getattr(hf, "__wrapped__", hf)
    apply = fo.rope_dispatcher(hf)
    q = torch.randn(B, T, HQ, D, device=DEV, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, HK, D, device=DEV, dtype=dtype).transpose(1, 2).requires_grad_()
    cos, sin = _cos_sin(cos_batch, T, D, dtype)
    assert torch.equal(apply(q, k, cos, sin)[0], hf(q, k, cos, sin)[0])  # untagged: HF's
    for t in (cos, sin):
        setattr(t, fo._TAG, True)
    qe, ke = apply(q, k, cos, sin)
    assert qe.shape == q.shape and ke.shape == k.shape and qe.dtype == dtype
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    rq, rk = hf(q64, k64, cos.double(), sin.double())
    assert _rel(qe, rq) < _bound(dtype) and _rel(ke, rk) < _bound(dtype)
    gq, gk = torch.randn_like(qe), torch.randn_like(ke)
    dq, dk = torch.autograd.grad((qe, ke), (q, k), (gq, gk))
    rdq, rdk = torch.autograd.grad((rq, rk), (q64, k64), (gq.double(), gk.double()))
    assert _rel(dq, rdq) < _bound(dtype) and _rel(dk, rdk) < _bound(dtype)


def test_rope_dispatch_leaves_other_calls_to_hf():
    """Shapes or arguments the kernel does not cover go to HF's function, tagged or not."""
    calls = []

    def hf(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(unsqueeze_dim)
        return q, k

    apply = fo.rope_dispatcher(hf)
    q = torch.randn(1, 2, 5, 16, device=DEV)
    cos, sin = _cos_sin(1, 5, 16, torch.float32)
    for t in (cos, sin):
        setattr(t, fo._TAG, True)
    apply(q, q, cos, sin, unsqueeze_dim=2)  # [B, T, H, D] layout
    apply(q, q, cos[..., :8], sin[..., :8])  # partial rotary
    apply(q, q, cos.requires_grad_(), sin)  # differentiable angles
    assert calls == [2, 1, 1]


@pytest.mark.parametrize("model_type, attention", [("llama", "full"), ("qwen3", "nsa"), ("qwen2", "full")])
def test_fused_models_match_hf_models(model_type, attention, monkeypatch):
    """The patched model with parallel.fused_ops gives HF's logits and gradients (fp32), its every norm
    and every attention's RoPE running through the kernels, also under checkpointing and tiles."""
    counts = {"norm": 0, "rope": 0}
    for name, cls in (("norm", fo._RMSNorm), ("rope", fo._Rope)):
        def counted(ctx, *args, _forward=cls.forward, _name=name):
            counts[_name] += 1
            return _forward(ctx, *args)
        monkeypatch.setattr(cls, "forward", staticmethod(counted))

    def run(**opts):
        torch.manual_seed(0)
        model = build_model(ModelConfig(model_type=model_type, hf_config=TINY[model_type]),
                            AttentionConfig(name=attention, **SMALL_NSA)).to(DEV).train()
        parallelize(model, zero_stage=0, **{"activation_checkpointing": False, **opts})
        ids = torch.randint(0, 97, (2, 48), generator=torch.Generator().manual_seed(1)).to(DEV)
        logits = model(input_ids=ids, use_cache=False).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters()}

    ref_logits, ref_grads = run()
    assert counts == {"norm": 0, "rope": 0}
    layers = TINY[model_type]["num_hidden_layers"]
    norms = (4 if model_type == "qwen3" else 2) * layers + 1
    for opts, passes in (({}, 1), ({"activation_checkpointing": True, "tile_tokens": 32}, 2)):
        counts.update(norm=0, rope=0)
        logits, grads = run(fused_ops=True, **opts)
        # every norm and both of each layer's RoPE calls; a checkpointed layer runs again in the backward
        assert counts == {"norm": norms + (passes - 1) * (norms - 1), "rope": 2 * layers * passes}, opts
        assert _rel(logits, ref_logits) < 1e-5
        scale = torch.stack([g.norm() for g in ref_grads.values()]).norm()
        for name, g in ref_grads.items():
            assert (grads[name] - g).norm() <= 1e-4 * max(g.norm(), 1e-3 * scale), (opts, name)


def test_fused_ops_fall_back_to_hf_where_triton_does_not_run(monkeypatch):
    """A CPU tensor without the interpreter: the patched norm and RoPE run HF's code, bit for bit."""
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", hf_config=TINY["llama"])
    ref = build_model(cfg, AttentionConfig(name="full")).eval()
    model = build_model(cfg, AttentionConfig(name="full")).eval()
    model.load_state_dict(ref.state_dict())
    parallelize(model, zero_stage=0, activation_checkpointing=False, fused_ops=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ids = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, ref(input_ids=ids, use_cache=False).logits)


def test_fuse_token_ops_refuses_a_model_it_does_not_know():
    model = torch.nn.Sequential(LlamaRMSNorm(8))
    with pytest.raises(ValueError, match="parallel.fused_ops: Sequential is not laid out"):
        fo.fuse_token_ops(model, [])


def test_training_with_fused_ops_follows_plain_training(tmp_path):
    """The tiny NSA recipe (fp32 on CPU), three steps: the losses and gradient norms of HF's norms and RoPE."""
    common = ["train.steps=3", "train.seq_len=256", *FAST]
    _, plain = train([*common, f"train.output_dir={tmp_path / 'a'}"])
    _, fused = train([*common, "parallel.fused_ops=true", f"train.output_dir={tmp_path / 'b'}"])
    for a, b in zip(plain, fused, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
