"""Memory options for long sequences: decoder MLPs and RMSNorms over token tiles, keeping only their
inputs (parallel.tile_tokens), and the checkpointed layers' inputs in host memory
(parallel.offload_activations)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from msa_train.parallel.engine import parallelize
from tests.msa_train._util import FAST, train

LAYERS, HIDDEN = 3, 64


def _model(layer_class=None, **parallel):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=HIDDEN, intermediate_size=176, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).float().train()
    if layer_class is not None:  # the decoder layers under another class name (the same code)
        other = type(layer_class, (type(model.model.layers[0]),), {})
        for layer in model.model.layers:
            layer.__class__ = other
    parallelize(model, zero_stage=0, **{"activation_checkpointing": False, **parallel})
    return model


def _run(model, T=200):
    """Logits and every parameter's gradient of one forward + backward on fixed random tokens."""
    ids = torch.randint(0, 97, (1, T), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()  # 0 where both are 0


@pytest.mark.parametrize("checkpointing,layer_kind", [(False, "llama"), (True, "llama"), (True, "unknown")])
def test_tiled_mlp_gives_the_plain_mlp_results_one_tile_at_a_time(checkpointing, layer_kind):
    ref_logits, ref_grads = _run(_model(activation_checkpointing=checkpointing))
    model = _model(layer_class="OtherDecoderLayer" if layer_kind == "unknown" else None,  # not known to end with its MLP
                   activation_checkpointing=checkpointing, tile_tokens=64)
    seen = []  # tokens per call of every MLP's down projection, forward and backward recompute
    for layer in model.model.layers:
        layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-2]))
    logits, grads = _run(model)
    # 200 tokens in tiles of 64: 4 calls per layer in the forward, 4 more in the backward; under
    # checkpointing a Llama layer's recompute skips the MLP (its output is never read there), the
    # unknown layer's runs it
    assert sorted(set(seen)) == [50] and len(seen) == LAYERS * 4 * (3 if layer_kind == "unknown" else 2)
    assert _rel(logits, ref_logits) < 1e-6
    for name, g in ref_grads.items():
        assert _rel(grads[name], g) < 1e-5, name


@pytest.mark.parametrize("tiles", [False, True])
def test_tiles_keep_neither_mlp_intermediates_nor_fp32_rows_for_the_backward(tiles):
    """bf16: what autograd saves (parameters aside). HF's norms keep fp32 rows and its MLP four
    T x intermediate tensors; tiled, only token rows in the model's dtype (MLP and norm inputs,
    attention's tensors) remain; the tiles' recompute in the backward is transient."""
    model = _model(**({"tile_tokens": 64} if tiles else {})).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append((tuple(t.shape), t.dtype))
        return t

    ids = torch.randint(0, 97, (1, 200))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # the forward's saves only
        logits = model(input_ids=ids, use_cache=False).logits
    logits.float().square().mean().backward()
    big = [s for s in saved if s[0] and (s[0][-1] == 176 or (s[1] == torch.float32 and s[0][-1] == HIDDEN))]
    assert bool(big) != tiles, big[:4]


def test_offloaded_checkpoints_pass_each_layer_input_through_the_host_hooks(monkeypatch):
    """What save_on_cpu packs under offload_activations is exactly the decoder layers' inputs (one
    [1, T, hidden] tensor per layer), and the gradients are those of plain checkpointing."""
    ref_logits, ref_grads = _run(_model(activation_checkpointing=True))
    packed = []

    class Recording(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self, pin_memory=False):
            super().__init__(lambda t: packed.append(tuple(t.shape)) or t.clone(), lambda t: t)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Recording)
    logits, grads = _run(_model(activation_checkpointing=True))
    assert packed == [], "plain checkpointing must not offload"
    logits, grads = _run(_model(activation_checkpointing=True, offload_activations=True))
    # (torch 2.11's checkpoint also saves an empty placeholder per layer)
    assert [shape for shape in packed if shape != (0,)] == [(1, 200, HIDDEN)] * LAYERS
    assert torch.equal(logits, ref_logits)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name


@pytest.mark.parametrize("model_type, attention", [("llama", "full"), ("qwen3", "full"), ("qwen3", "nsa")])
def test_patched_models_with_both_options_match_plain_checkpointing(model_type, attention):
    """msa_train's patched models, two sequences a batch (tiles of B x T / 4 tokens): NSA's hidden-state
    hook runs again in the recompute, Qwen3's per-head q/k norms are tiled too, the logits and
    gradients of plain checkpointing, and of checkpointing with both options, are those of the model
    without checkpointing, and no attention module keeps its input after the step."""
    import torch.nn.functional as F

    from msa_train.config import AttentionConfig, ModelConfig
    from msa_train.models import build_model
    from tests.msa_train.test_models import SMALL_NSA, TINY

    def run(activation_checkpointing=True, **opts):
        torch.manual_seed(0)
        model = build_model(ModelConfig(model_type=model_type, hf_config=TINY[model_type]),
                            AttentionConfig(name=attention, **SMALL_NSA)).train()
        parallelize(model, activation_checkpointing=activation_checkpointing, zero_stage=0, **opts)
        tiled = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and hasattr(m, "tile_tokens")]
        ids = torch.randint(0, 97, (2, 96), generator=torch.Generator().manual_seed(1))
        logits = model(input_ids=ids, use_cache=False).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        kept = [m for m in model.modules() if getattr(m, "_msa_hidden_states", None) is not None]
        return logits.detach(), {n: p.grad for n, p in model.named_parameters()}, len(tiled), kept

    ref_logits, ref_grads, none, kept = run(activation_checkpointing=False)
    assert none == 0 and kept == []
    scale = torch.stack([g.norm() for g in ref_grads.values()]).norm()
    layers = TINY[model_type]["num_hidden_layers"]
    for opts, tiled_norms in (({}, 0), ({"tile_tokens": 48, "offload_activations": True},
                                        (4 if model_type == "qwen3" else 2) * layers + 1)):
        logits, grads, norms, kept = run(**opts)
        assert norms == tiled_norms and kept == []
        assert _rel(logits, ref_logits) < 1e-5
        for name, g in ref_grads.items():  # (some NSA gradients, such as phi's position terms, are ~0: rounding)
            assert (grads[name] - g).norm() <= 1e-4 * max(g.norm(), 1e-3 * scale), (opts, name)


def test_training_with_tiles_and_offload_follows_plain_training(tmp_path):
    """Under ZeRO-2 (TiledMLP holds each MLP weight's gradient back from its reduction until the last
    tile) two steps give the plain run's losses and gradient norms. ZeRO-3 with both options: the
    sequence-parallel test's sp2-zero3-nsa-memory case."""
    common = ["parallel=zero2", "parallel.activation_checkpointing=true", "train.steps=2",
              "train.seq_len=256", *FAST]
    _, plain = train([*common, f"train.output_dir={tmp_path / 'a'}"])
    _, tiled = train([*common, "parallel.tile_tokens=100", "parallel.offload_activations=true",
                      f"train.output_dir={tmp_path / 'b'}"])
    for a, b in zip(plain, tiled):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_and_tiles_lower_cuda_memory():
    """On the GPU: after the forward, the offloaded run holds the layers' inputs in host memory (their
    bytes are off the device), and the tiled MLPs lower the backward's peak."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384)
    T = 16384
    ids = torch.randint(0, 512, (1, T), device="cuda")
    stats = {}
    for name, opts in {"plain": {}, "offload": {"offload_activations": True}, "tiles": {"tile_tokens": 2048}}.items():
        model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).train()
        parallelize(model, activation_checkpointing=True, zero_stage=0, **opts)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        after_forward = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        hidden.float().square().mean().backward()
        stats[name] = (after_forward, torch.cuda.max_memory_allocated() - base)
        del model, hidden
        torch.cuda.empty_cache()
    layer_inputs = cfg.num_hidden_layers * T * cfg.hidden_size * 2
    assert stats["plain"][0] - stats["offload"][0] >= 0.9 * layer_inputs, stats
    mlp_acts = 3 * T * cfg.intermediate_size * 2  # gate, up and their product of one layer, at least
    assert stats["plain"][1] - stats["tiles"][1] >= 0.8 * mlp_acts, stats


def test_out_of_memory_names_the_options_the_run_does_not_use(monkeypatch):
    """The CLI re-raises a CUDA OOM with the memory options this run has not turned on."""
    from msa_train import cli
    from msa_train.trainer import Trainer

    def oom(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB.")

    monkeypatch.setattr(Trainer, "__init__", lambda self, cfg: None)
    monkeypatch.setattr(Trainer, "run", oom)
    for overrides, named, not_named in [
        (["train.seq_len=4096"], ["activation_checkpointing=true", "tile_tokens=32768",
                                  "offload_activations=true", "parallel=zero2 parallel.offload_optimizer=true parallel.optimizer=deepspeed",
                                  "sp_degree", "now 4096"], []),
        (["parallel=zero3", "parallel.tile_tokens=8192", "parallel.offload_activations=true"],
         ["parallel.offload_optimizer=true", "parallel.offload_params=true", "train.loss_impl=recompute", "sp_degree"],
         ["activation_checkpointing", "tile_tokens=", "offload_activations"]),
        (["train.loss_impl=recompute"], ["activation_checkpointing=true"], ["loss_impl"]),
    ]:
        cfg = cli.compose(overrides, typed=False)
        with pytest.raises(torch.OutOfMemoryError) as err:
            cli.run(cfg)
        text = str(err.value)
        assert text.startswith("CUDA out of memory. Tried to allocate 14.00 GiB.")
        assert all(s in text for s in named) and not any(s in text for s in not_named), text
