"""Model building and patching: HF Llama / Qwen2 / Qwen3 -> NSA (or varlen dense) models.

``patch_model(model, attention_cfg)`` is the one call. It keeps every HF parameter name (so
existing checkpoints load unchanged), adds ``self_attn.nsa`` (a ``flash_msa.NativeSparseAttention``)
to every attention layer when the attention is sparse, installs the hidden-state pre-hook the NSA
gates need, switches ``config._attn_implementation`` to one of our registered backends, and
records the attention config in ``config.msa_attention`` so ``save_pretrained`` writes it to
config.json and :func:`load_pretrained` rebuilds the same model.

NSA parameter initialisation (``NativeSparseAttention.reset_parameters``, owned by flash_msa):
the compression map phi starts as exactly mean pooling of the block (its output projection is 0),
the gate weights at 0 and the biases at -ln 2, so every gate starts at 1/3 and a pretrained dense
model keeps most of its behaviour at step 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Mapping, Optional, Union

import torch
import torch.nn as nn

from msa_train.config import AttentionConfig, ModelConfig
from msa_train.models import llama, qwen2, qwen3
from msa_train.models.attention import FULL, NSA, register_attention_backends, stash_hidden_states
from msa_train.models.family import ModelFamily

# transformers renamed from_pretrained's torch_dtype to dtype in 4.56; pass whichever it expects.
_DTYPE_KW = "dtype" if tuple(int(x) for x in __import__("transformers").__version__.split(".")[:2]) >= (4, 56) \
    else "torch_dtype"
REGISTRY: dict[str, ModelFamily] = {f.model_type: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY)}
_HOOKED = "_msa_hidden_hook"  # on each attention module patch_model patched
_MASK_HOOKED = "_msa_mask_hook"  # on the decoder


def family_of(config) -> ModelFamily:
    """The registry entry for an HF config (keyed by ``config.model_type``)."""
    if config.model_type not in REGISTRY:
        raise ValueError(f"model_type={config.model_type!r} is not supported; choose one of: {', '.join(REGISTRY)}")
    return REGISTRY[config.model_type]


def _as_attention_cfg(cfg: Union[AttentionConfig, Mapping[str, Any], None]) -> AttentionConfig:
    if cfg is None:
        return AttentionConfig()
    if isinstance(cfg, AttentionConfig):
        return cfg
    return AttentionConfig(**dict(cfg))


def _head_dims(config):
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return num_heads, getattr(config, "num_key_value_heads", None) or num_heads, head_dim


def _check_supported(config, cfg: AttentionConfig) -> None:
    """Refuse what msa_train's attention backends would otherwise silently ignore."""
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        raise ValueError(f"attention_dropout={dropout}: msa_train's attention backends apply no attention dropout; "
                         "set model.hf_config.attention_dropout=0")
    layer_types = getattr(config, "layer_types", None) or []
    if not cfg.is_sparse and ("sliding_attention" in layer_types or getattr(config, "use_sliding_window", False)):
        raise ValueError("the model config has sliding-window attention layers, which attention=full (msa_full: "
                         "causal attention over whole documents) does not implement; turn them off "
                         "(model.hf_config.use_sliding_window=false) or use an NSA attention, which replaces them")


def _refuse_padding_mask(module, args, kwargs):
    """Decoder pre-hook: the backends register no mask function, so HF hands them no attention
    mask; a padding mask would be dropped. Packed sequences (cu_seqlens) need none."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool and mask.dim() == 2:
        mask = mask != 0
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):
        raise NotImplementedError("msa_train's attention backends take packed sequences (cu_seqlens), not padding "
                                  "masks: pack the batch, or run padded batches on the model without patch_model")


def _set_attn_implementation(model: nn.Module, name: str) -> None:
    # transformers 5 validates names through set_attn_implementation; 4.5x reads the config field.
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(name)
            return
        except (ValueError, ImportError, TypeError):
            pass
    model.config._attn_implementation = name


def patch_model(model: nn.Module, attention_cfg: Union[AttentionConfig, Mapping[str, Any], None] = None, *,
                deterministic: bool = False) -> nn.Module:
    """Turn an HF Llama / Qwen2 / Qwen3 causal LM into an msa_train model, in place.

    Args:
        model: a ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` (any device,
            including meta).
        attention_cfg: :class:`AttentionConfig` (or a dict of its fields); ``name="full"`` routes
            to varlen dense attention, ``nsa`` / ``fmsa`` / ``auto`` add NSA modules.
        deterministic: the NSA modules' compressed attention stays on flash_msa's bitwise
            deterministic Triton kernels (``train.deterministic``), never cuDNN.

    Returns:
        The same model. Patching twice with the same config is a no-op.
    """
    from flash_msa.nsa import NativeSparseAttention

    cfg = _as_attention_cfg(attention_cfg)
    family = family_of(model.config)
    _check_supported(model.config, cfg)
    register_attention_backends()
    hidden = model.config.hidden_size
    num_heads, num_kv_heads, head_dim = _head_dims(model.config)
    sizes = dict(cmp_block=cfg.cmp_block, cmp_stride=cfg.cmp_stride, slc_block=cfg.slc_block,
                 slc_topk=cfg.slc_topk, window=cfg.window)
    for attn in family.attention_modules(model):
        if cfg.is_sparse and hasattr(attn, "nsa") and attn.nsa.sizes != sizes:
            raise ValueError(f"patch_model: the model is already patched with NSA sizes {attn.nsa.sizes}, not "
                             f"{sizes}: its NSA parameters have those shapes; patch a fresh model instead")
        if cfg.is_sparse and not hasattr(attn, "nsa"):
            ref = attn.q_proj.weight
            attn.nsa = NativeSparseAttention(hidden, num_heads, num_kv_heads, head_dim, impl=cfg.selected_impl,
                                             device=ref.device, dtype=ref.dtype, **sizes)
        if cfg.is_sparse:
            attn.nsa.requested_impl = cfg.selected_impl
            attn.nsa.deterministic = deterministic
        if not getattr(attn, _HOOKED, False):
            attn.register_forward_pre_hook(stash_hidden_states, with_kwargs=True)
            setattr(attn, _HOOKED, True)
    decoder = getattr(model, "model", None)
    if decoder is not None and not getattr(decoder, _MASK_HOOKED, False):
        decoder.register_forward_pre_hook(_refuse_padding_mask, with_kwargs=True)
        setattr(decoder, _MASK_HOOKED, True)
    _set_attn_implementation(model, NSA if cfg.is_sparse else FULL)
    model.config.msa_attention = dataclasses.asdict(cfg)
    return model


def build_model(model_cfg: ModelConfig, attention_cfg: AttentionConfig, dtype: torch.dtype = torch.float32,
                init_context=None, deterministic: bool = False) -> nn.Module:
    """Build (from ``hf_config`` values) or load (from the local ``path``) and patch the model.

    Never downloads: ``path`` must be a local directory. ``init_context`` (e.g. ZeRO-3's
    ``deepspeed.zero.Init``) wraps the construction of the HF model only: the NSA modules are
    added after it, whole, because their initialisation reads their own parameter shapes; the
    DeepSpeed engine partitions them when it is built.
    """

    from transformers import AutoConfig

    with init_context or contextlib.nullcontext():
        if model_cfg.path is not None:
            model = load_pretrained(model_cfg.path, None, dtype=dtype, patch=False)
        else:
            values = dict(model_cfg.hf_config)
            values.pop("model_type", None)
            config = AutoConfig.for_model(model_cfg.model_type, **values)
            model = family_of(config).causal_lm_cls._from_config(config, **{_DTYPE_KW: dtype})
    patch_model(model, attention_cfg, deterministic=deterministic)
    if model_cfg.path is not None:
        _maybe_load_nsa_weights(model, model_cfg.path, attention_cfg)
    return model


class _AllOnMeta(torch.overrides.TorchFunctionMode):
    """Every tensor constructor makes a meta tensor, also one given a device. ``torch.device("meta")``
    only fills in a missing device and sits below every other mode, so state a process set up before
    can win over it: in CI a pytest worker built the planner's 14B-parameter model on the host inside
    ``torch.device("meta")`` after earlier in-process tests (OOM-killed; under ``ulimit -v`` the
    MemoryError showed a CPU DeviceContext filling in the device). A dry run must not depend on what
    ran before it, and fails at the first tensor that is not meta rather than after a whole model."""

    def __init__(self):
        super().__init__()
        from torch.utils._device import _device_constructors

        self.constructors = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in self.constructors:
            return func(*args, **kwargs)
        kwargs["device"] = "meta"
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and not out.is_meta:
            raise RuntimeError(f"the meta-device dry run got a {out.device} tensor from {func.__name__}: something "
                               "in this process moves construction off the meta device (an unexited DeepSpeed "
                               "zero.Init, a patched torch function?)")
        return out


@contextlib.contextmanager
def _outside_zero_init():
    """Lift DeepSpeed's ``zero.Init`` patches for the block when they are in force: they partition
    (and so allocate, on the host or the device) every parameter a module creates, whatever device
    context is active. DeepSpeed's own engine build lifts them the same way (``shutdown_init_context``)."""
    import sys

    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    active = pp is not None and getattr(pp, "top_level_context", None) is not None
    if active:
        pp.shutdown_init_context()
    try:
        yield
    finally:
        if active:
            pp.restore_init_context()


def meta_model(model_cfg: ModelConfig, attention_cfg: AttentionConfig) -> nn.Module:
    """The patched model on the meta device (no memory): the dry run of :func:`count_parameters`."""
    from transformers import AutoConfig

    if model_cfg.path is not None:
        config = AutoConfig.from_pretrained(model_cfg.path)
    else:
        values = {k: v for k, v in model_cfg.hf_config.items() if k != "model_type"}
        config = AutoConfig.for_model(model_cfg.model_type, **values)
    with _outside_zero_init(), _AllOnMeta():
        model = family_of(config).causal_lm_cls(config)
        patch_model(model, attention_cfg)
    assert all(p.is_meta for p in model.parameters()), "the dry run allocated parameters"
    return model


def count_parameters(model_cfg: ModelConfig, attention_cfg: AttentionConfig) -> tuple[int, int]:
    """Build the patched model on the meta device: validates the config and the patch and counts
    parameters without allocating any memory. (A mode of our own, :class:`_AllOnMeta`, not accelerate's
    ``init_empty_weights``, which re-creates each parameter and so unties tied embeddings.)

    Returns:
        (total parameters including NSA, tied ones once; the matmul parameters of the
        dense-equivalent model: every weight a token's forward multiplies by, the LM head
        included (tied or not), the input-embedding lookup and NSA's own parameters left out)
    """
    model = meta_model(model_cfg, attention_cfg)
    embedding = model.get_input_embeddings().weight
    matmul = sum(p.numel() for name, p in model.named_parameters(remove_duplicate=False)
                 if not (p is embedding and "lm_head" not in name) and ".nsa." not in name)
    return sum(p.numel() for p in model.parameters()), matmul


def load_pretrained(path: str, attention_cfg: Union[AttentionConfig, Mapping[str, Any], None] = None,
                    dtype: torch.dtype = torch.float32, patch: bool = True) -> nn.Module:
    """Load an HF checkpoint dir (ours, with NSA weights, or a plain HF one) and patch it.

    The attention config is ``attention_cfg`` when given, else the ``msa_attention`` recorded in
    config.json, else full attention. NSA weights present in the dir are loaded exactly; NSA
    weights absent from it (a plain HF checkpoint) keep their documented initialisation.
    """
    import os

    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise ValueError(f"model.path={path!r} is not a local directory (msa-train never downloads models)")
    config = AutoConfig.from_pretrained(path)
    family = family_of(config)
    recorded = getattr(config, "msa_attention", None) or {}
    if attention_cfg is None and patch:
        attention_cfg = recorded or None
    cls = family.causal_lm_cls
    # The HF class has no NSA modules: told that an NSA checkpoint's *.nsa.* tensors are expected
    # extras, transformers leaves them out of its load report (which would list every one of them
    # as UNEXPECTED) and _maybe_load_nsa_weights copies them in strictly once the model is patched.
    # The subclass lives for the load only: the model comes back as an instance of the HF class.
    loader = _nsa_tolerant(cls) if recorded.get("name", "full") != "full" else cls
    model, info = loader.from_pretrained(path, output_loading_info=True, **{_DTYPE_KW: dtype})
    model.__class__ = cls
    _check_loading_info(path, cls, info)
    if patch:
        patch_model(model, attention_cfg)
        _maybe_load_nsa_weights(model, path, attention_cfg)
    return model


def _nsa_tolerant(cls: type) -> type:
    """``cls`` whose from_pretrained expects the ``*.nsa.*`` tensors of an msa_train checkpoint
    besides its own (``_keys_to_ignore_on_load_unexpected``, transformers' own mechanism)."""
    ignored = [*(cls._keys_to_ignore_on_load_unexpected or []), r"\.nsa\."]
    return type(cls.__name__, (cls,), {"_keys_to_ignore_on_load_unexpected": ignored, "__module__": cls.__module__})


def _check_loading_info(path: str, cls: type, info: Mapping[str, Any]) -> None:
    """transformers only warns about tensors the checkpoint lacks (initialised at random) or has
    in excess (dropped); either means the directory does not hold this model, so refuse it."""
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    if missing or unexpected:
        parts = [f"{len(keys)} {what} (e.g. {keys[0]})" for what, keys in
                 (("tensors missing", missing), ("unexpected tensors", unexpected)) if keys]
        raise ValueError(f"model.path={path!r}: the checkpoint does not match the {cls.__name__} its config.json "
                         f"describes: {', '.join(parts)}")


def _maybe_load_nsa_weights(model: nn.Module, path: str, attention_cfg) -> None:
    """Load the NSA tensors of an msa_train checkpoint dir (none in a plain HF one)."""
    from transformers import AutoConfig

    recorded = getattr(AutoConfig.from_pretrained(path), "msa_attention", None) or {}
    if recorded.get("name", "full") != "full" and _as_attention_cfg(
            attention_cfg if attention_cfg is not None else recorded).is_sparse:
        _load_extra_weights(model, path)


def _load_extra_weights(model: nn.Module, path: str) -> None:
    """Copy the ``*.nsa.*`` tensors of the safetensors files into the patched model."""
    import glob
    import os

    from safetensors import safe_open

    params = dict(model.named_parameters())
    found = set()
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if ".nsa." in key and key in params:
                    with torch.no_grad():
                        params[key].copy_(f.get_tensor(key))
                    found.add(key)
    missing = [k for k in params if ".nsa." in k and k not in found]
    if missing:
        raise ValueError(f"{path}: config.json records NSA attention but {len(missing)} NSA tensors are missing, "
                         f"e.g. {missing[0]}")


def phi_parameters(model: nn.Module):
    """NSA's block-compression parameters (``self_attn.nsa.compress_k`` / ``compress_v``: weight, pos, proj)."""
    from flash_msa import NativeSparseAttention

    for module in model.modules():
        if isinstance(module, NativeSparseAttention):
            for compression in (module.compress_k, module.compress_v):
                yield from compression.parameters()


def freeze_mean_phi(model: nn.Module) -> int:
    """``model.nsa_phi=mean``: every NSA layer's phi made plain mean pooling of the block and frozen.

    With phi's weight, position encoding and output projection all 0, the compressed key (value) of a
    block is exactly the mean of its keys (values) (flash_msa/compression/naive.py has the formula),
    and nothing of phi trains, so NSA adds only its gates' parameters to the dense model: the
    ablation that separates phi's parameters from the sparse attention. The zeros are in the model's
    weights, so checkpoints, resume and the HF export keep them (a model exported so and trained on
    with ``nsa_phi=mlp`` keeps a dead phi: with W and P zero neither gets a gradient). Returns the
    number of parameters frozen."""
    frozen = 0
    with torch.no_grad():
        for p in phi_parameters(model):
            p.zero_()
            p.requires_grad_(False)
            frozen += int(getattr(p, "ds_numel", p.numel()))
    return frozen


def save_pretrained(model: nn.Module, path: str, state_dict: Optional[dict] = None) -> None:
    """Write an HF dir (config.json with ``msa_attention`` + safetensors) that :func:`load_pretrained` reloads."""
    model.save_pretrained(path, state_dict=state_dict, safe_serialization=True)


__all__ = ["REGISTRY", "build_model", "count_parameters", "family_of", "freeze_mean_phi", "load_pretrained", "patch_model",
           "phi_parameters", "save_pretrained"]
