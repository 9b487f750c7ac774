"""Model patching: HF Llama / Qwen2 / Qwen3 -> msa_train models, document isolation, HF round trip."""
import os

import pytest
import torch
import torch.nn.functional as F

from msa_train import patch_model
from msa_train.config import AttentionConfig, ModelConfig
from msa_train.loss import chunked_linear_cross_entropy_sum
from msa_train.models import build_model, load_pretrained, save_pretrained

SMALL_NSA = dict(cmp_block=16, cmp_stride=8, slc_block=16, slc_topk=4, window=32)
TINY = {
    "llama": dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "qwen2": dict(vocab_size=97, hidden_size=80, intermediate_size=128, num_hidden_layers=2, num_attention_heads=5,
                  num_key_value_heads=1, tie_word_embeddings=False),
    "qwen3": dict(vocab_size=97, hidden_size=80, intermediate_size=128, num_hidden_layers=2, num_attention_heads=10,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}


def _model(model_type, attention):
    return build_model(ModelConfig(model_type=model_type, hf_config=TINY[model_type]),
                       AttentionConfig(name=attention, **SMALL_NSA))


def _packed(T=160, bounds=(0, 37, 111, 160), vocab=97):
    ids = torch.randint(0, vocab, (1, T))
    cu = torch.tensor(bounds, dtype=torch.int32)
    pos = torch.cat([torch.arange(e - s) for s, e in zip(bounds[:-1], bounds[1:])])[None]
    return ids, pos, cu


@pytest.mark.parametrize("attention", ["full", "nsa"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_packed_documents_do_not_attend_across_boundaries(model_type, attention):
    """Each packed document's hidden states equal those of the document run alone."""
    model = _model(model_type, attention).eval()
    ids, pos, cu = _packed()
    with torch.no_grad():
        packed = model.model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, max_length_q=74).last_hidden_state
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            alone = model.model(input_ids=ids[:, s:e], position_ids=pos[:, s:e]).last_hidden_state
            torch.testing.assert_close(packed[:, s:e], alone, rtol=1e-4, atol=1e-5)


def test_patch_keeps_hf_parameter_names_and_adds_nsa():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**TINY["llama"]))
    before = set(dict(model.named_parameters()))
    patch_model(model, {"name": "fmsa", **SMALL_NSA})
    after = set(dict(model.named_parameters()))
    assert before <= after
    added = sorted(after - before)
    assert "model.layers.0.self_attn.nsa.compress_k.weight" in added
    assert "model.layers.1.self_attn.nsa.gate.bias" in added
    assert all(".self_attn.nsa." in name for name in added)
    assert model.config._attn_implementation == "msa_nsa"
    assert model.config.msa_attention["name"] == "fmsa"
    gate = model.model.layers[0].self_attn.nsa.gate
    assert torch.all(gate.weight == 0) and torch.allclose(torch.sigmoid(gate.bias), torch.full_like(gate.bias, 1 / 3))


@pytest.mark.parametrize("model_type, attention", [("llama", "nsa"), ("qwen3", "fmsa"), ("llama", "full")])
def test_hf_save_reload_round_trip(tmp_path, model_type, attention):
    """save_pretrained -> load_pretrained (HF from_pretrained + patch_model) gives the same logits."""
    torch.manual_seed(1)
    model = _model(model_type, attention).eval()
    with torch.no_grad():  # move NSA params off their init so a missed load would show
        for name, p in model.named_parameters():
            if ".nsa." in name:
                p.add_(0.05 * torch.randn_like(p))
    save_pretrained(model, str(tmp_path))
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()
    reloaded = load_pretrained(str(tmp_path)).eval()
    assert reloaded.config.msa_attention["name"] == attention
    sd, sd2 = model.state_dict(), reloaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        torch.testing.assert_close(sd2[k], sd[k], rtol=0, atol=0, msg=k)
    ids, pos, cu = _packed()
    with torch.no_grad():
        kw = dict(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, max_length_q=74)
        torch.testing.assert_close(reloaded(**kw).logits, model(**kw).logits, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["fused", "recompute"])
def test_chunked_linear_cross_entropy_matches_full_logits(impl):
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 50, bias=False)
    hidden = torch.randn(1, 77, 32, requires_grad=True)
    labels = torch.randint(0, 50, (1, 77))
    labels[0, ::5] = -100
    labels[0, 64:] = -100  # a whole chunk without a target
    loss = chunked_linear_cross_entropy_sum(head, hidden, labels, chunk_tokens=16, impl=impl)
    (loss * 0.37).backward()
    g_h, g_w = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    ref = F.cross_entropy(head(hidden).view(-1, 50), labels.view(-1), ignore_index=-100, reduction="sum")
    (ref * 0.37).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_h, hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_w, head.weight.grad, rtol=1e-5, atol=1e-6)
    assert g_h[0, 64:].abs().max() == 0 and g_h[0, ::5].abs().max() == 0


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_fused_linear_cross_entropy_bf16_matches_recompute_and_gradient_paths(device):
    """In bf16 (on CUDA through the row and scale kernels) both forms meet the fp64 reference, with
    the incoming gradient a training step's 1 / n_tokens: the fused form multiplies its bf16
    gradients by it in fp32 and rounds once (g itself rounded to bf16 would scale the whole
    gradient by up to 0.4%). Only the hidden states' gradient, only the weight's, and no gradient
    (the recomputed form) work too."""
    torch.manual_seed(1)
    head = torch.nn.Linear(64, 300, bias=False).to(device=device, dtype=torch.bfloat16)
    hidden = torch.randn(1, 100, 64, dtype=torch.bfloat16, device=device)
    labels = torch.randint(0, 300, (1, 100), device=device)
    labels[0, :7] = -100
    scale = torch.tensor(1 / 261124, device=device)  # 0.39% off in bf16
    grads = {}
    for impl in ("fused", "recompute"):
        h = hidden.clone().requires_grad_(True)
        head.weight.grad = None
        loss = chunked_linear_cross_entropy_sum(head, h, labels, chunk_tokens=32, impl=impl)
        (loss * scale).backward()
        grads[impl] = (loss.detach(), h.grad.float(), head.weight.grad.float())
    ref = F.cross_entropy((hidden.double() @ head.weight.double().t()).view(-1, 300), labels.view(-1),
                          ignore_index=-100, reduction="sum")
    h64, w64 = hidden.double().requires_grad_(True), head.weight.detach().double().requires_grad_(True)
    (F.cross_entropy((h64 @ w64.t()).view(-1, 300), labels.view(-1), ignore_index=-100, reduction="sum")
     * scale.double()).backward()
    for impl, (loss, g_h, g_w) in grads.items():
        assert abs(loss.item() - ref.item()) / ref.item() < 2e-3, impl
        for a, b in ((g_h, h64.grad), (g_w, w64.grad)):
            assert ((a.double() - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item() < 5e-3, impl
    h = hidden.clone().requires_grad_(True)
    head.weight.grad = None
    chunked_linear_cross_entropy_sum(head, h, labels, chunk_tokens=32).backward()  # incoming gradient 1
    for a, b in zip(grads["fused"][1:], (h.grad, head.weight.grad)):  # scaled in fp32, then rounded once
        assert torch.equal(a, (b.float() * scale).to(torch.bfloat16).float())
        assert not torch.equal(a, (b * scale.to(torch.bfloat16)).float())  # not by a bf16 scale
    assert grads["fused"][0].item() == pytest.approx(grads["recompute"][0].item(), rel=1e-5)
    head.weight.requires_grad_(False)  # only dh
    h = hidden.clone().requires_grad_(True)
    (chunked_linear_cross_entropy_sum(head, h, labels, chunk_tokens=32) * scale).backward()
    torch.testing.assert_close(h.grad.float(), grads["fused"][1], rtol=0, atol=0)
    head.weight.requires_grad_(True)
    head.weight.grad = None  # only dW
    (chunked_linear_cross_entropy_sum(head, hidden, labels, chunk_tokens=32) * scale).backward()
    torch.testing.assert_close(head.weight.grad.float(), grads["fused"][2], rtol=0, atol=0)
    with torch.no_grad():
        no_grad = chunked_linear_cross_entropy_sum(head, hidden, labels, chunk_tokens=32).item()
    assert no_grad == pytest.approx(grads["fused"][0].item(), rel=1e-5)


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ce_rows_kernel_matches_pytorch(dtype):
    """The fused loss's per-row kernel (CUDA's path) against the PyTorch ops (CPU's path): loss and
    in-place gradient, over several column blocks with a ragged last one, ignored labels, and a
    label in the last column."""
    from msa_train.loss import _ce_rows_torch, _ce_rows_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(2)
    logits = (torch.randn(37, 300, device=device) * 4).to(dtype)
    y = torch.randint(0, 300, (37,), device=device)
    y[::6], y[5] = -100, 299
    ref_loss, ref_grad = _ce_rows_torch(logits.clone(), y, True)
    loss, grad = _ce_rows_triton(logits.clone(), y, True, block=64)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)  # bf16: an ulp
    torch.testing.assert_close(grad, ref_grad, **tol)
    assert grad[::6].abs().max() == 0
    only_loss, none = _ce_rows_triton(logits.clone(), y, False, block=64)
    assert none is None and torch.equal(only_loss, loss)


@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                    reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1")
def test_scale_kernel_multiplies_in_fp32():
    from msa_train.loss import _scale_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(3000, device=device).to(torch.bfloat16)
    g = torch.tensor(1 / 261124, device=device)
    out = x.clone()
    _scale_kernel[(3,)](out, 3000, g, BLOCK=1024)
    want = (x.float() * g).to(torch.bfloat16)
    if device == "cuda":
        assert torch.equal(out, want)
    else:  # the interpreter's fp32 -> bf16 cast truncates: within one bf16 step
        assert ((out.float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all()
    bf16_scale = x * g.to(torch.bfloat16)  # what a bf16 multiply gives: g itself rounded first
    assert abs((bf16_scale.double() / (x.double() * g.item())).mean().item() - 1) > 1e-3


def test_fused_linear_cross_entropy_refuses_a_second_backward_and_a_bad_impl():
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(1, 5, 8, requires_grad=True)
    labels = torch.randint(0, 11, (1, 5))
    loss = chunked_linear_cross_entropy_sum(head, hidden, labels, chunk_tokens=4)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran twice.*loss_impl=recompute"):
        loss.backward()
    with pytest.raises(ValueError, match="impl='nope'"):
        chunked_linear_cross_entropy_sum(head, hidden, labels, impl="nope")


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])  # untied, tied embeddings
@pytest.mark.parametrize("attention", ["full", "nsa"])
def test_count_parameters_counts_tied_weights_once_and_flops_without_nsa(model_type, attention):
    from msa_train.models import count_parameters

    mcfg, acfg = ModelConfig(model_type=model_type, hf_config=TINY[model_type]), AttentionConfig(name=attention, **SMALL_NSA)
    total, matmul = count_parameters(mcfg, acfg)
    model = build_model(mcfg, acfg)
    assert total == sum(p.numel() for p in model.parameters())
    nsa = sum(p.numel() for n, p in model.named_parameters() if ".nsa." in n)
    vocab_x_hidden = model.get_input_embeddings().weight.numel()
    # the LM head's matmul counts whether its weight is tied or not; the embedding lookup never
    lm_head_extra = vocab_x_hidden if TINY[model_type]["tie_word_embeddings"] else 0
    assert matmul == total - vocab_x_hidden - nsa + lm_head_extra
    assert (nsa > 0) == (attention == "nsa")


def test_msa_full_generates_like_hf_with_a_kv_cache():
    """Decoding with a KV cache: one query against the cached keys (the last position's causal row)."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY["llama"])).eval()
    hf.config._attn_implementation = "eager"
    ours = patch_model(copy.deepcopy(hf), AttentionConfig(name="full"))
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        a = hf.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
        b = ours.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
    assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_nsa_generates_with_a_kv_cache_as_without(model_type):
    """generate() decodes with the KV cache (NativeSparseAttention.decode): the same tokens as greedy
    decoding that recomputes the whole sequence each step, and the same logits, over enough new
    tokens to complete compression and selection blocks and slide the window."""
    from transformers import DynamicCache

    from msa_train.models.attention import _DECODE_STATE

    model = _model(model_type, "nsa").eval()
    torch.manual_seed(3)
    cache = DynamicCache()
    _generate_as_without_cache(model, torch.randint(0, 97, (2, 37)), 40, past_key_values=cache)
    # each layer kept its compressed keys between steps (flash_msa.decode.DecodeCache), for the 37 + 39 cached tokens
    rows = (37 + 39 - SMALL_NSA["cmp_block"]) // SMALL_NSA["cmp_stride"] + 1
    assert [getattr(layer, _DECODE_STATE).cache.rows for layer in cache.layers] == [rows, rows]


def test_nsa_beam_search_with_a_kv_cache_as_without():
    """Beam search reorders the KV cache between steps: the compressed keys kept for decoding must be
    dropped then, or the beams decode against another beam's compressed keys."""
    model = _model("llama", "nsa").eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        torch.manual_seed(5)
        ids = torch.randint(0, 97, (2, 37))
        kw = dict(max_new_tokens=30, do_sample=False, num_beams=3, attention_mask=torch.ones_like(ids))
        assert torch.equal(model.generate(ids, **kw), model.generate(ids, use_cache=False, **kw))


def _generate_as_without_cache(model, ids, steps, **generate_kwargs):
    """generate() with its KV cache gives the tokens and logits of greedy decoding that recomputes the
    whole sequence at every step."""
    with torch.no_grad():
        for p in model.parameters():  # away from the symmetric start, so that NSA's choices matter
            p.add_(0.05 * torch.randn_like(p))
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, attention_mask=torch.ones_like(ids), **generate_kwargs)
        seq = ids
        for step in range(steps):
            logits = model(input_ids=seq, use_cache=False).logits[:, -1]
            torch.testing.assert_close(out.logits[step], logits, rtol=1e-4, atol=1e-4)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out.sequences, seq)


@pytest.mark.parametrize("attention", ["full", "nsa"])
def test_a_static_kv_cache_is_refused(attention):
    """A static cache hands the backends its whole zero-padded buffer and no mask: refused, not wrong tokens."""
    model = _model("llama", attention).eval()
    ids = torch.randint(0, 97, (1, 11))
    with torch.no_grad(), pytest.raises(NotImplementedError, match="keeps all keys.*got StaticLayer"):
        model.generate(ids, max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(ids),
                       cache_implementation="static")


def test_nsa_on_a_sliding_window_config_decodes_with_every_key():
    """NSA replaces a config's sliding-window layers, so generate()'s cache keeps every key there: the
    same tokens and logits as recomputing the whole sequence, past the 8-token window."""
    from transformers import DynamicCache

    cfg = dict(TINY["qwen2"], use_sliding_window=True, sliding_window=8, max_window_layers=0)
    model = build_model(ModelConfig(model_type="qwen2", hf_config=cfg), AttentionConfig(name="nsa", **SMALL_NSA)).eval()
    assert set(model.config.layer_types) == {"sliding_attention"}
    cache = DynamicCache(config=model.config)  # what generate() builds, kept here to look at
    torch.manual_seed(4)
    _generate_as_without_cache(model, torch.randint(0, 97, (1, 29)), 20, past_key_values=cache)
    assert {type(layer).__name__ for layer in cache.layers} == {"DynamicLayer"}
    assert cache.get_seq_length() == 29 + 19


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decodes with the Triton kernels on a GPU")
def test_nsa_generate_on_the_gpu_decodes_with_the_triton_kernels():
    """On CUDA generate() decodes with flash_msa/decode/kernel.py (bf16): each step's logits are those of
    the whole sequence run again without a cache on the Triton training kernels, to bf16 rounding."""
    from transformers import DynamicCache

    from msa_train.models.attention import _DECODE_STATE

    model = _model("llama", "fmsa").to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.manual_seed(6)
    ids = torch.randint(0, 97, (2, 101), device="cuda")
    cache = DynamicCache()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             attention_mask=torch.ones_like(ids), past_key_values=cache)
        for step in range(40):
            want = model(input_ids=out.sequences[:, :101 + step], use_cache=False).logits[:, -1].float()
            got = out.logits[step].float()
            assert ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt() < 2e-2, step
    rows = (101 + 39 - SMALL_NSA["cmp_block"]) // SMALL_NSA["cmp_stride"] + 1
    assert [getattr(layer, _DECODE_STATE).cache.rows for layer in cache.layers] == [rows, rows]


def test_patch_refuses_what_the_backends_would_ignore():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    with pytest.raises(ValueError, match="attention_dropout=0.5"):
        patch_model(LlamaForCausalLM(LlamaConfig(**TINY["llama"], attention_dropout=0.5)), AttentionConfig(name="full"))
    swa = Qwen2Config(**TINY["qwen2"], use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window attention layers"):
        patch_model(Qwen2ForCausalLM(swa), AttentionConfig(name="full"))
    model = _model("llama", "nsa")
    with pytest.raises(ValueError, match="already patched with NSA sizes"):
        patch_model(model, AttentionConfig(name="nsa", **{**SMALL_NSA, "cmp_block": 32}))
    ids = torch.randint(0, 97, (2, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with pytest.raises(NotImplementedError, match="not padding masks"):
        model(input_ids=ids, attention_mask=mask)


def test_loading_an_nsa_checkpoint_reports_no_false_unexpected_tensors(tmp_path, caplog, capfd):
    """An msa_train hf/ dir loads without transformers' LOAD REPORT listing its *.nsa.* tensors as
    UNEXPECTED (they are loaded, right after); a tensor that really is extra, or one that is
    missing, is an error naming the directory and the tensor."""
    from safetensors.torch import load_file, save_file

    save_pretrained(_model("llama", "nsa"), str(tmp_path))
    capfd.readouterr()
    with caplog.at_level("WARNING"):
        load_pretrained(str(tmp_path))
    out = capfd.readouterr()
    for text in (caplog.text, out.out, out.err):
        assert "UNEXPECTED" not in text and "LOAD REPORT" not in text

    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))
    save_file({**state, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.path=.*1 unexpected tensors \(e\.g\. model\.layers\.0\.mlp\.extra"):
        load_pretrained(str(tmp_path))
    save_file({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}, str(weights),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 tensors missing \(e\.g\. model\.layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(str(tmp_path))
