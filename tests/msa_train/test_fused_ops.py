"""parallel.fused_ops: the RMSNorm, RoPE and SwiGLU kernels against float64 references (HF's formulas), and
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
from tests.msa_train._util import FAST, compose, train
from tests.msa_train.test_models import SMALL_NSA, TINY

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The comparisons with HF's code are 10x looser on CUDA, where they run through rounding the CPU
# does not have (gpu_tests/runs.md#gpu_tests_fused_ops_tf32): the NSA kernels' fp32 matmuls run in TF32
# (Triton's default), so a last-bit difference in their inputs moves a rounding by up to 2^-11
# (logits 2.3e-5 apart on the H200), and the recipe trains in bf16, where the kernels round
# differently from HF's code (RoPE and SwiGLU round once; gradient norms 1.7e-4 and 2.3e-4 apart).
# The CPU bounds stay tight.
CUDA_LOOSE = 10.0 if DEV == "cuda" else 1.0


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _bound(dtype):
    """Against float64: fp32 to its rounding; bf16 to the 5e-3 standard (1.5e-2 in the interpreter)."""
    return 1e-5 if dtype == torch.float32 else (5e-3 if DEV == "cuda" else 1.5e-2)


def _within_one_ulp(a, b):
    """bf16 a and b at most one bf16 unit in the last place apart (the GPU rounds to nearest)."""
    return bool(((a.float() - b.float()).abs() <= b.float().abs() * 2.0 ** -7 + 1e-30).all())


@pytest.fixture(params=[None, 1, 2], ids=["usual programs", "one program", "two programs"])
def programs(request, monkeypatch):
    """The norm's backward with its usual number of programs (here one row tile each), with one
    program looping over every row tile, and with two taking every other tile (the weight gradient
    accumulated across tiles, then summed over programs)."""
    if request.param is not None:
        monkeypatch.setattr(fo, "_programs", lambda device: request.param)


def _hf_norm64(x, w, eps, dtype):
    """HF's RMSNorm in float64, with its rounding of the normalised rows to the input dtype."""
    x64 = x.double()
    h = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).double()
    return w.double() * h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 37, 64), (1, 9, 100), (3, 11, 5, 16), (1, 3, 1024)])
def test_rms_norm_kernel_matches_hf_forward_and_backward(shape, dtype, programs):
    """Widths that are and are not powers of two, per-head norms (Qwen3's q/k norms: [B, T, H, D]),
    several rows a tile and one; x and weight gradients. On the GPU in bf16 the forward is HF's
    module's to one unit in the last place (the normalised row rounded before the weight)."""
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
    elif DEV == "cuda":
        assert _within_one_ulp(y, LlamaRMSNorm.forward(norm, x))
    dx2, dw2 = torch.autograd.grad(fo._RMSNorm.apply(x, norm.weight, norm), (x, norm.weight), g)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)  # deterministic: no atomics


def test_rms_norm_kernel_takes_the_weight_dtype_as_hf_does():
    """bf16 rows, an fp32 weight: HF's output is fp32 (the weight times the bf16-rounded row)."""
    norm = LlamaRMSNorm(40).to(DEV)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 7, 40, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    y, ref = fo._RMSNorm.apply(x, norm.weight, norm), LlamaRMSNorm.forward(norm, x)
    assert y.dtype == ref.dtype == torch.float32 and _rel(y, ref) < _bound(torch.bfloat16)
    dx, dw = torch.autograd.grad(y.sum(), (x, norm.weight))
    rdx, rdw = torch.autograd.grad(ref.sum(), (x, norm.weight))
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert _rel(dx, rdx) < _bound(torch.bfloat16) and _rel(dw, rdw) < _bound(torch.bfloat16)


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
    """The dispatcher, called as from a patched attention module, against HF's apply_rotary_pos_emb
    in float64: q and k in HF's layout ([B, H, T, D] views of projection outputs), several rows a
    program, cos/sin per sequence or shared; the gradients. Called from anywhere else it is HF's."""
    hf = modeling_llama.apply_rotary_pos_emb
    hf = getattr(hf, "__wrapped__", hf)
    apply = fo.rope_dispatcher(hf)
    q = torch.randn(B, T, HQ, D, device=DEV, dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, HK, D, device=DEV, dtype=dtype).transpose(1, 2).requires_grad_()
    cos, sin = _cos_sin(cos_batch, T, D, dtype)
    assert torch.equal(apply(q, k, cos, sin)[0], hf(q, k, cos, sin)[0])  # outside a patched attention: HF's
    token = fo._FUSE_ROPE.set(True)
    try:
        qe, ke = apply(q, k, cos, sin)
    finally:
        fo._FUSE_ROPE.reset(token)
    assert qe.shape == q.shape and ke.shape == k.shape and qe.dtype == dtype
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    rq, rk = hf(q64, k64, cos.double(), sin.double())
    assert _rel(qe, rq) < _bound(dtype) and _rel(ke, rk) < _bound(dtype)
    gq, gk = torch.randn_like(qe), torch.randn_like(ke)
    dq, dk = torch.autograd.grad((qe, ke), (q, k), (gq, gk))
    rdq, rdk = torch.autograd.grad((rq, rk), (q64, k64), (gq.double(), gk.double()))
    assert _rel(dq, rdq) < _bound(dtype) and _rel(dk, rdk) < _bound(dtype)


def test_rope_dispatch_leaves_other_calls_to_hf():
    """Shapes, dtypes or arguments the kernel does not cover go to HF's function, inside a patched
    attention module too."""
    calls = []

    def hf(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(unsqueeze_dim)
        return q, k

    apply = fo.rope_dispatcher(hf)
    q = torch.randn(1, 2, 5, 16, device=DEV)
    cos, sin = _cos_sin(1, 5, 16, torch.float32)
    token = fo._FUSE_ROPE.set(True)
    try:
        apply(q, q, cos, sin, unsqueeze_dim=2)  # [B, T, H, D] layout
        apply(q, q, cos[..., :8], sin[..., :8])  # partial rotary
        apply(q, q, cos.double(), sin.double())  # angles in another dtype (HF promotes)
        apply(q, q, cos.clone().requires_grad_(), sin)  # differentiable angles
        assert calls == [2, 1, 1, 1]
        apply(q, q, cos, sin)
    finally:
        fo._FUSE_ROPE.reset(token)
    assert calls == [2, 1, 1, 1]  # the last one took the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_kernel_matches_hf(dtype):
    """silu(g) * u and both gradients against float64, over more elements than one program takes
    and a ragged end; deterministic."""
    g = (2 * torch.randn(3, 29, 70, device=DEV)).to(dtype).requires_grad_()
    u = torch.randn(3, 29, 70, device=DEV, dtype=dtype).requires_grad_()
    y = fo._SwiGLU.apply(g, u)
    dy = torch.randn_like(y)
    dg, du = torch.autograd.grad(y, (g, u), dy)
    g64, u64 = (t.detach().double().requires_grad_() for t in (g, u))
    ref = F.silu(g64) * u64
    rdg, rdu = torch.autograd.grad(ref, (g64, u64), dy.double())
    assert y.dtype == dtype and _rel(y, ref) < _bound(dtype)
    assert _rel(dg, rdg) < _bound(dtype) and _rel(du, rdu) < _bound(dtype)
    assert all(torch.equal(a, b) for a, b in zip((dg, du), torch.autograd.grad(fo._SwiGLU.apply(g, u), (g, u), dy)))


@pytest.fixture
def kernel_calls(monkeypatch):
    """Calls of each kernel's autograd forward: {"norm", "rope", "mlp"} -> count."""
    calls = {"norm": 0, "rope": 0, "mlp": 0}
    for name, cls in (("norm", fo._RMSNorm), ("rope", fo._Rope), ("mlp", fo._SwiGLU)):
        def counted(ctx, *args, _forward=cls.forward, _name=name):
            calls[_name] += 1
            return _forward(ctx, *args)
        monkeypatch.setattr(cls, "forward", staticmethod(counted))
    return calls


@pytest.mark.parametrize("model_type, attention", [("llama", "full"), ("qwen3", "nsa"), ("qwen2", "full")])
def test_fused_models_match_hf_models(model_type, attention, kernel_calls):
    """The patched model with parallel.fused_ops gives HF's logits and gradients (fp32), its every norm,
    every attention's RoPE and every MLP's SwiGLU running through the kernels, also under
    checkpointing and tiles."""
    counts = kernel_calls

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
    assert counts == {"norm": 0, "rope": 0, "mlp": 0}
    if DEV == "cuda":  # a bf16 model takes the kernels too (no fallback on its dtypes)
        model = build_model(ModelConfig(model_type=model_type, hf_config=TINY[model_type]),
                            AttentionConfig(name=attention, **SMALL_NSA), dtype=torch.bfloat16).to(DEV)
        parallelize(model, zero_stage=0, activation_checkpointing=False, fused_ops=True)
        model(input_ids=torch.randint(0, 97, (1, 64), device=DEV), use_cache=False).logits.float().sum().backward()
        assert all(counts.values()), counts
        counts.update(norm=0, rope=0, mlp=0)
    layers = TINY[model_type]["num_hidden_layers"]
    norms = (4 if model_type == "qwen3" else 2) * layers + 1
    # (the 96 tokens in 3 tiles of 32: the tiled MLP runs each tile in the forward and again in the
    # backward, and skips the checkpoint's recompute)
    for opts, passes, mlp_calls in (({}, 1, 1), ({"activation_checkpointing": True, "tile_tokens": 32}, 2, 6)):
        counts.update(norm=0, rope=0, mlp=0)
        logits, grads = run(fused_ops=True, **opts)
        # every norm and both of each layer's RoPE calls; a checkpointed layer runs again in the backward
        assert counts == {"norm": norms + (passes - 1) * (norms - 1), "rope": 2 * layers * passes,
                          "mlp": mlp_calls * layers}, opts
        loose = CUDA_LOOSE if attention == "nsa" else 1.0  # (TF32 in the NSA kernels only)
        assert _rel(logits, ref_logits) < 1e-5 * loose
        scale = torch.stack([g.norm() for g in ref_grads.values()]).norm()
        for name, g in ref_grads.items():
            assert (grads[name] - g).norm() <= 1e-4 * loose * max(g.norm(), 1e-3 * scale), (opts, name)


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


def test_patched_models_pickle_and_copy_with_their_kernels():
    """The patched forwards are bound so that a pickled or deep-copied model runs its own modules.
    (Without checkpointing: HF's own gradient checkpointing adds a hook that does not pickle.)"""
    import copy
    import pickle

    torch.manual_seed(0)
    model = build_model(ModelConfig(model_type="llama", hf_config=TINY["llama"]), AttentionConfig(name="full"))
    parallelize(model, zero_stage=0, activation_checkpointing=False, fused_ops=True, tile_tokens=16)
    ids = torch.randint(0, 97, (1, 40))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
        for other in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
            norm, mlp = other.model.norm, other.model.layers[0].mlp
            assert norm.forward.args[0] is norm and mlp.forward.args[0] is mlp
            assert torch.equal(other(input_ids=ids, use_cache=False).logits, want)


def test_fuse_token_ops_refuses_a_model_it_does_not_know_and_leaves_it_alone():
    model = torch.nn.Sequential(LlamaRMSNorm(8))
    with pytest.raises(ValueError, match="parallel.fused_ops: Sequential is not laid out"):
        fo.fuse_token_ops(model, [])
    assert "forward" not in vars(model[0]) and not hasattr(model[0], fo.FUSED_NORM)


def test_norms_wider_than_the_kernel_run_hf_code_and_stay_tiled(monkeypatch):
    """A norm wider than MAX_NORM_WIDTH is left to HF's code and is not marked fused, so
    parallel.tile_tokens still tiles it."""
    monkeypatch.setattr(fo, "MAX_NORM_WIDTH", 32)  # TINY llama: hidden 64, head_dim 16
    model = build_model(ModelConfig(model_type="qwen3", hf_config=TINY["qwen3"]), AttentionConfig(name="full"))
    parallelize(model, zero_stage=0, activation_checkpointing=False, fused_ops=True, tile_tokens=16)
    wide = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and m.weight.shape[-1] > 32]
    narrow = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and m.weight.shape[-1] <= 32]
    assert wide and narrow  # the hidden-size norms, and Qwen3's per-head q/k norms
    assert all(not hasattr(m, fo.FUSED_NORM) and hasattr(m, "tile_tokens") for m in wide)
    assert all(hasattr(m, fo.FUSED_NORM) and not hasattr(m, "tile_tokens") for m in narrow)


@pytest.mark.parametrize("stage", [0, 3])
def test_training_with_fused_ops_follows_plain_training(tmp_path, stage, kernel_calls):
    """The tiny NSA recipe (fp32 on CPU), three steps, ZeRO-0 and ZeRO-3 (whose module hooks hand on
    detached copies of module outputs): the kernels run for every norm, RoPE and MLP call, and the
    losses and gradient norms are those of HF's code."""
    calls = kernel_calls
    steps = 3
    common = [f"train.steps={steps}", "train.seq_len=256", f"parallel.zero_stage={stage}", *FAST]
    layers = compose(common).model.hf_config["num_hidden_layers"]
    _, plain = train([*common, "parallel.fused_ops=false", f"train.output_dir={tmp_path / 'a'}"])
    assert calls == {"norm": 0, "rope": 0, "mlp": 0}
    _, fused = train([*common, "parallel.fused_ops=true", f"train.output_dir={tmp_path / 'b'}"])
    assert calls == {"norm": steps * (2 * layers + 1), "rope": steps * 2 * layers, "mlp": steps * layers}
    for a, b in zip(plain, fused, strict=True):  # (bf16 on CUDA: CUDA_LOOSE)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5 * CUDA_LOOSE)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4 * CUDA_LOOSE)


def test_fused_ops_default_is_on_for_cuda_only(tmp_path, kernel_calls):
    """parallel.fused_ops left unset (null) takes the kernels when training on CUDA; on a CPU, where
    Triton would only interpret them, it runs HF's code."""
    from msa_train.trainer import Trainer

    cfg = compose([*FAST, "train.steps=1", "train.seq_len=128", f"train.output_dir={tmp_path}"])
    assert cfg.parallel.fused_ops is None
    trainer = Trainer(cfg)
    assert trainer.fused_ops is (DEV == "cuda")
    summary = trainer.train()
    assert (kernel_calls["norm"] > 0) is (DEV == "cuda") and summary["fused_ops"] is (DEV == "cuda")
