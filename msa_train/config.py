"""Typed configuration: one dataclass per Hydra config group, registered with ConfigStore.

Hydra merges the YAML in ``configs/`` and ``recipes/`` onto these schemas, so an unknown key or a
value of the wrong type fails at composition. Everything else (allowed values, cross-field rules)
is checked in ``__post_init__``, which runs when :func:`to_typed` turns the composed DictConfig into
these objects, before the trainer builds anything.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import MISSING

ATTENTION_NAMES = ("full", "nsa", "fmsa", "auto")
MODEL_TYPES = ("llama", "qwen2", "qwen3")
PRECISIONS = ("auto", "bf16", "fp32")
LR_SCHEDULES = ("cosine", "wsd")  # train.lr_schedule (msa_train/parallel/deepspeed_config.py)
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "nccl", "gloo")
LOGGERS = ("none", "wandb")
OPTIMIZERS = ("torch", "deepspeed")
WANDB_MODES = ("offline", "online", "disabled")
OBJECTIVES = ("lm", "dpo", "simpo", "orpo", "kto", "grpo")  # pairs: msa_train/preference.py; grpo: msa_train/grpo.py
PAIR_OBJECTIVES = ("dpo", "simpo", "orpo", "kto")
WITH_REFERENCE = ("dpo", "kto")  # pair objectives that take the reference log-probabilities at the start
# train.* settings of the pair objectives (each positive, but simpo_gamma, which may be 0)
PREFERENCE_SETTINGS = ("dpo_beta", "simpo_beta", "simpo_gamma", "orpo_lambda", "kto_beta", "kto_desirable_weight",
                       "kto_undesirable_weight")
GRPO_REWARDS = ("exact", "prefix", "chars")  # msa_train/grpo.py
GRPO_SETTINGS = ("grpo_group", "grpo_beta", "grpo_temperature", "grpo_max_new_tokens", "grpo_reward")
LOSS_IMPLS = ("fused", "recompute")  # msa_train/loss.py
NONFINITE_POLICIES = ("stop", "skip")
NSA_INITS = ("default", "distill")      # msa_train/models/distill.py
NSA_PHIS = ("mlp", "mean")              # msa_train/models/__init__.py: freeze_mean_phi
LORA_NSA = ("train", "lora", "freeze")  # msa_train/models/lora.py
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _choice(key: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def _at_least(key: str, value: Any, low: float, what: str = "") -> None:
    if value is None or not value >= low:  # "not >=": NaN fails too
        raise ValueError(f"{key}={value!r} is not allowed; expected {what or f'a value >= {low}'}")


@dataclass(frozen=True)
class HeadLayout:
    """The attention heads one rank of an SP group of ``sp_degree`` ranks attends with."""
    q_heads: int       # query heads per rank: HQ / P
    kv_heads: int      # KV heads per rank: HK / P, or 1 when they are replicated
    kv_replicas: int   # ranks holding each KV head: 1, or P / HK (they split its query heads)


def head_layout(num_heads: int, num_kv_heads: int, sp_degree: int) -> HeadLayout:
    """Per-rank query and KV heads of an attention layer with ``num_heads`` query and
    ``num_kv_heads`` KV heads under ``parallel.sp_degree=sp_degree`` (also for memory planning;
    msa_train.parallel.sequence re-exports it).

    Raises:
        ValueError: naming the numbers, when P does not divide the query heads, or when P and the
            KV heads do not divide one another.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})")
    if num_heads % sp_degree:
        raise ValueError(f"parallel.sp_degree={sp_degree} must divide the model's num_attention_heads ({num_heads}): "
                         "each rank attends with num_attention_heads / sp_degree query heads")
    if num_kv_heads % sp_degree == 0:
        return HeadLayout(num_heads // sp_degree, num_kv_heads // sp_degree, 1)
    if sp_degree % num_kv_heads == 0:
        return HeadLayout(num_heads // sp_degree, 1, sp_degree // num_kv_heads)
    raise ValueError(f"parallel.sp_degree={sp_degree} and the model's num_key_value_heads ({num_kv_heads}) must "
                     "divide one another: each rank gets num_key_value_heads / sp_degree KV heads, or each KV head "
                     "is replicated on sp_degree / num_key_value_heads ranks")


def _finite(key: str, value: Any) -> None:
    """inf and nan compare as numbers and would pass range checks, then poison the first step."""
    if not math.isfinite(value):
        raise ValueError(f"{key}={value!r} is not allowed; expected a finite number")


@dataclass
class LoraConfig:
    """LoRA through peft (msa_train/models/lora.py, docs/trainer.md): ``r`` > 0 turns it on; the
    pretrained weights are then frozen and low-rank adapters of rank ``r`` train beside them."""
    r: int = 0                           # 0: off (full fine-tuning)
    alpha: float = 16.0                  # the adapters' output is scaled by alpha / r
    dropout: float = 0.0
    # module names (the last part: q_proj, ...) that get adapters; the LM head and embeddings never do
    target_modules: List[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # NSA's own parameters (compression phi, gate projection), new to a dense checkpoint: "train" them
    # fully (default), put the gate projection under "lora" too (phi trains fully: it has no pretrained
    # value to stay near), or "freeze" them (only for a model already trained with NSA)
    nsa: str = "train"

    def __post_init__(self):
        _at_least("model.lora.r", self.r, 0, "an integer >= 0 (0 turns LoRA off)")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"model.lora.alpha={self.alpha!r} is not allowed; expected a positive number")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout={self.dropout!r} is not allowed; expected a value in [0, 1)")
        _choice("model.lora.nsa", self.nsa, LORA_NSA)
        never = [t for t in self.target_modules if t in ("lm_head", "embed_tokens")]
        if never:
            raise ValueError(f"model.lora.target_modules: {never} cannot get adapters (the LM head and the embeddings "
                             "stay frozen; the fused loss and the memory planner rely on it)")
        if self.r > 0 and not self.target_modules:
            raise ValueError("model.lora.target_modules is empty; name the linear layers that get adapters, "
                             f"for example [{', '.join(LORA_TARGETS)}]")

    @property
    def enabled(self) -> bool:
        return self.r > 0


@dataclass
class ModelConfig:
    """The HF model. Either ``path`` (a local HF checkpoint dir) or ``hf_config`` (config values)."""
    name: str = "tiny_llama"
    model_type: str = "llama"            # llama | qwen2 | qwen3: picks the HF class and the patch
    path: Optional[str] = None           # local dir with config.json + safetensors (never downloaded)
    hf_config: Dict[str, Any] = field(default_factory=dict)  # AutoConfig values when path is None
    # NSA's parameters at the start: "default" (phi = mean pooling, gates 1/3) or "distill" (then fitted
    # to the dense attention output for nsa_distill_steps AdamW steps at nsa_distill_lr; models/distill.py)
    nsa_init: str = "default"
    # NSA's block compression phi: "mlp" (the paper's learned MLP with a mean-pooling skip path) or
    # "mean" (plain mean pooling of the block's keys / values: phi's parameters zero and frozen, so NSA
    # adds only its gates' parameters; the quality study's ablation of phi's parameters)
    nsa_phi: str = "mlp"
    nsa_distill_steps: int = 50
    nsa_distill_lr: float = 1.0e-3
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        _choice("model.model_type", self.model_type, MODEL_TYPES)
        _choice("model.nsa_init", self.nsa_init, NSA_INITS)
        _choice("model.nsa_phi", self.nsa_phi, NSA_PHIS)
        if self.nsa_phi == "mean" and self.nsa_init == "distill":
            raise ValueError("model.nsa_phi=mean freezes phi at mean pooling, model.nsa_init=distill fits it: "
                             "choose one")
        _at_least("model.nsa_distill_steps", self.nsa_distill_steps, 1, "an integer >= 1")
        if not self.nsa_distill_lr > 0:
            raise ValueError(f"model.nsa_distill_lr={self.nsa_distill_lr!r} is not allowed; expected a positive float")
        if self.path is None and not self.hf_config:
            raise ValueError("model: set model.path (a local HF checkpoint dir) or model.hf_config (config values)")
        if self.nsa_init == "distill" and self.lora.enabled and self.lora.nsa != "train":
            # a LoRA checkpoint holds the trainable tensors only: frozen distilled values (all of NSA's
            # under freeze, the gate's base under lora) could not be restored on a resume or by eval.only
            raise ValueError(f"model.nsa_init=distill fits NSA's parameters, model.lora.nsa={self.lora.nsa} freezes "
                             f"{'them' if self.lora.nsa == 'freeze' else 'the gate under its adapters'}: a checkpoint "
                             "holds only what trains, so the distilled values could not be resumed; use "
                             "model.lora.nsa=train with distill")


@dataclass
class AttentionConfig:
    """Which attention the patched model runs. NSA sizes follow the NSA paper's names."""
    name: str = "full"                   # full | nsa | fmsa | auto
    cmp_block: int = 32                  # compression block l
    cmp_stride: int = 16                 # compression stride d
    slc_block: int = 64                  # selection block l'
    slc_topk: int = 16                   # selected blocks n (incl. 1 initial + 2 local)
    window: int = 512                    # sliding window w

    def __post_init__(self):
        _choice("attention.name", self.name, ATTENTION_NAMES)
        if self.name != "full":
            from flash_msa.nsa import check_nsa_sizes
            try:
                check_nsa_sizes(self.cmp_block, self.cmp_stride, self.slc_block, self.slc_topk, self.window)
            except ValueError as e:
                raise ValueError(f"attention: {e}") from None

    @property
    def is_sparse(self) -> bool:
        return self.name != "full"

    @property
    def selected_impl(self) -> str:
        """flash_msa's selected-attention impl for this name: nsa is the query-centric loop order."""
        return {"nsa": "qc"}.get(self.name, self.name)


@dataclass
class ParallelConfig:
    """DeepSpeed ZeRO, memory and kernel options; the DeepSpeed JSON is generated from this."""
    zero_stage: int = 0                  # 0 | 1 | 2 | 3
    offload_optimizer: bool = False      # ZeRO >= 1: optimizer state in host memory
    # with offload_optimizer under ZeRO-3: the fraction of the optimizer state held and stepped on the
    # host (DeepSpeed's partial offload, cpu_adam); the rest stays on the GPU, stepped there
    offload_ratio: float = 1.0
    offload_params: bool = False         # ZeRO 3 only: parameters in host memory
    activation_checkpointing: bool = False
    offload_activations: bool = False    # with activation_checkpointing: the layers' saved inputs in host memory
    tile_tokens: int = 0                 # > 0: MLPs and RMSNorms keep less for the backward, in tiles of this many tokens
    # RMSNorms, RoPE and SwiGLU as single Triton kernels (models/fused_ops.py); None: on when training on CUDA
    fused_ops: Optional[bool] = None
    sp_degree: int = 1                   # sequence parallel degree (Ulysses): ranks per sequence
    backend: str = "auto"                # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    optimizer: str = "torch"             # torch (torch.optim.AdamW) | deepspeed (FusedAdam / cpu_adam, JIT-built)
    # seconds a collective waits for the other ranks before the run fails naming the silent one
    # (a stopped or hung rank would otherwise hold its peers for torch's default of 30 minutes)
    timeout_s: float = 600.0

    def __post_init__(self):
        _finite("parallel.timeout_s", self.timeout_s)
        if not self.timeout_s > 0:
            raise ValueError(f"parallel.timeout_s={self.timeout_s!r} is not allowed; expected seconds > 0")
        _choice("parallel.zero_stage", self.zero_stage, (0, 1, 2, 3))
        _choice("parallel.backend", self.backend, BACKENDS)
        _choice("parallel.optimizer", self.optimizer, OPTIMIZERS)
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("parallel.offload_optimizer=true needs parallel.zero_stage in 1, 2, 3")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("parallel.offload_params=true needs parallel.zero_stage=3")
        _finite("parallel.offload_ratio", self.offload_ratio)
        if not 0 < self.offload_ratio <= 1:
            raise ValueError(f"parallel.offload_ratio={self.offload_ratio!r} is not allowed; expected a fraction "
                             "in (0, 1] of the optimizer state on the host (1: all of it)")
        if self.offload_ratio < 1 and not (self.offload_optimizer and self.zero_stage == 3
                                           and self.optimizer == "deepspeed"):
            raise ValueError(f"parallel.offload_ratio={self.offload_ratio} (a partial offload) needs "
                             "parallel.offload_optimizer=true, parallel.zero_stage=3 and parallel.optimizer=deepspeed "
                             "(DeepSpeed splits the optimizer state only under ZeRO-3, with its cpu_adam)")
        _at_least("parallel.sp_degree", self.sp_degree, 1, "an integer >= 1")
        _at_least("parallel.tile_tokens", self.tile_tokens, 0, "an integer >= 0 (0: no tiling)")
        if self.offload_activations and not self.activation_checkpointing:
            raise ValueError("parallel.offload_activations=true needs parallel.activation_checkpointing=true "
                             "(what is offloaded is the checkpointed layers' inputs)")


@dataclass
class TrainConfig:
    """Optimisation, schedule, run directory, checkpointing."""
    steps: int = 60
    seq_len: int = 512                   # tokens per packed sequence (one per rank per micro step)
    grad_accum: int = 1                  # micro steps per optimizer step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1            # the schedule ends at lr * min_lr_ratio
    warmup_steps: int = 5
    # after the warm-up: cosine (over every remaining step) | wsd (warmup-stable-decay: the full rate,
    # then a cosine over the last decay_fraction of the steps)
    lr_schedule: str = "cosine"
    decay_fraction: float = 0.2
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0               # 0 disables clipping
    seed: int = 0
    precision: str = "auto"              # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    device: str = "auto"                 # auto | cpu | cuda
    loss_chunk_tokens: int = 4096        # tokens per chunk of the chunked linear cross-entropy
    loss_impl: str = "fused"             # fused (gradients taken in the forward) | recompute (msa_train/loss.py)
    output_dir: str = "runs/${recipe_name}"
    log_every: int = 1
    save_every: int = 0                  # optimizer steps between checkpoints; 0 = only at the end
    save_final: bool = True              # checkpoint at the last step
    save_hf: bool = True                 # write an HF dir (config + safetensors) at the end
    keep_checkpoints: int = 2            # newest complete checkpoints kept; 0 keeps all
    resume: str = "none"                 # none | auto | path to a checkpoint dir
    on_nonfinite: str = "stop"           # stop (raise, exit non-zero) | skip (restore the last checkpoint, skip
                                         # the batches since): a NaN / inf loss, gradient norm or weight
    peak_tflops: Optional[float] = None  # per device, for MFU; None = known GPU table, CPU -> no MFU
    progress: bool = True                # rich progress bar on rank 0
    phase_times: bool = False            # records get forward_s / backward_s / step_s (3 host syncs per micro step)
    profile_step: int = 0                # > 0: torch.profiler over that optimizer step -> profile_step<N>.{json,md}
    objective: str = "lm"                # lm (next-token loss: pretraining, SFT) | dpo | simpo | orpo | kto (pairs)
    dpo_beta: float = 0.1                # DPO's beta: scale of the implicit reward
    simpo_beta: float = 2.0              # SimPO's beta: scale of the length-normalised reward
    simpo_gamma: float = 1.0             # SimPO's target reward margin
    orpo_lambda: float = 0.1             # ORPO's weight of the odds-ratio term beside the chosen response's SFT loss
    kto_beta: float = 0.1                # KTO's beta: scale of the implicit reward
    kto_desirable_weight: float = 1.0    # KTO's lambda_D (the chosen responses) and lambda_U (the rejected ones)
    kto_undesirable_weight: float = 1.0
    # GRPO (msa_train/grpo.py): per prompt a group of sampled completions, rewarded against its answer
    grpo_group: int = 8                  # completions sampled per prompt (train.grad_accum prompts per rank and step)
    grpo_beta: float = 0.04              # KL coefficient to the starting policy; 0 keeps no reference
    grpo_temperature: float = 1.0        # sampling temperature of the rollouts
    grpo_max_new_tokens: int = 32        # completion length cap (a completion also ends at EOS)
    grpo_reward: str = "prefix"          # exact | prefix | chars (msa_train/grpo.py)
    deterministic: bool = False          # NSA's compressed attention on the bitwise deterministic Triton kernels, not cuDNN
    # memory planner (msa_train/parallel/planner.py): plan=true prints the predicted per-GPU peak and exits
    plan: bool = False
    plan_world_size: int = 0             # GPUs the plan is for; 0 = parallel.sp_degree
    plan_gpu_gb: Optional[float] = None  # GiB per GPU; None = the visible GPU's, else an H200's (139)
    plan_host_gb: Optional[float] = None  # host memory of the node the plan is for, GiB; None = not checked
    plan_check: bool = True              # refuse, before building, a run the planner says cannot fit

    def __post_init__(self):
        for key in ("steps", "seq_len", "grad_accum", "log_every", "loss_chunk_tokens"):
            _at_least(f"train.{key}", getattr(self, key), 1, "an integer >= 1")
        for key in ("warmup_steps", "save_every", "keep_checkpoints", "profile_step", "plan_world_size"):
            _at_least(f"train.{key}", getattr(self, key), 0, "an integer >= 0")
        for key in ("lr", "min_lr_ratio", "weight_decay", "grad_clip", *PREFERENCE_SETTINGS):
            _finite(f"train.{key}", getattr(self, key))
        for i, b in enumerate(self.betas):
            _finite(f"train.betas[{i}]", b)
        if not self.lr > 0:
            raise ValueError(f"train.lr={self.lr!r} is not allowed; expected a positive float")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio!r} is not allowed; expected a float in [0, 1]")
        _choice("train.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _finite("train.decay_fraction", self.decay_fraction)
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"train.decay_fraction={self.decay_fraction!r} is not allowed; expected a float in (0, 1] "
                             "(the fraction of train.steps over which train.lr_schedule=wsd decays)")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"train.betas={list(self.betas)!r} is not allowed; expected two floats in [0, 1)")
        _at_least("train.grad_clip", self.grad_clip, 0.0, "a float >= 0 (0 disables clipping)")
        _at_least("train.weight_decay", self.weight_decay, 0.0, "a float >= 0 (0: no weight decay)")
        _choice("train.precision", self.precision, PRECISIONS)
        _choice("train.objective", self.objective, OBJECTIVES)
        _choice("train.grpo_reward", self.grpo_reward, GRPO_REWARDS)
        _at_least("train.grpo_group", self.grpo_group, 2, "an integer >= 2 (GRPO compares completions within a group)")
        _at_least("train.grpo_max_new_tokens", self.grpo_max_new_tokens, 1, "an integer >= 1")
        _at_least("train.grpo_beta", self.grpo_beta, 0.0, "a float >= 0 (0: no KL term)")
        _finite("train.grpo_beta", self.grpo_beta)
        if not (self.grpo_temperature > 0 and math.isfinite(self.grpo_temperature)):
            raise ValueError(f"train.grpo_temperature={self.grpo_temperature!r} is not allowed; expected a positive float")
        _choice("train.loss_impl", self.loss_impl, LOSS_IMPLS)
        _choice("train.on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
        for key in ("plan_gpu_gb", "plan_host_gb"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ValueError(f"train.{key}={getattr(self, key)!r} is not allowed; expected a positive number of GiB")
        for key in (k for k in PREFERENCE_SETTINGS if k != "simpo_gamma"):
            if not getattr(self, key) > 0:
                raise ValueError(f"train.{key}={getattr(self, key)!r} is not allowed; expected a positive float")
        _at_least("train.simpo_gamma", self.simpo_gamma, 0.0, "a float >= 0")
        _choice("train.device", self.device, DEVICES)
        if self.resume not in ("none", "auto") and not self.resume:
            raise ValueError("train.resume must be none, auto or a checkpoint directory")


@dataclass
class LoggerConfig:
    """Where metrics go besides metrics.jsonl: none or wandb (offline unless configured)."""
    name: str = "none"                   # none | wandb
    project: str = "msa-train"
    run_name: Optional[str] = None
    mode: Optional[str] = None           # offline | online | disabled; None = $WANDB_MODE or offline

    def __post_init__(self):
        _choice("logger.name", self.name, LOGGERS)
        if self.mode is not None:
            _choice("logger.mode", self.mode, WANDB_MODES)


@dataclass
class EvalConfig:
    """Held-out evaluation: next-token loss (overall and by position in the document) on
    ``data.eval_path`` / ``data.eval_fraction``, and synthetic pass-key retrieval (msa_train/evaluation.py).
    With DPO: the DPO loss and reward accuracy on held-out pairs."""
    every: int = 0                       # optimizer steps between evaluations; 0 = none during training
    at_start: bool = False               # also evaluate before the first step (the starting model)
    at_end: bool = True                  # evaluate after the last step (when there is evaluation data)
    only: bool = False                   # evaluate once and exit, no training: the model of model.path, or the
                                         # checkpoint train.resume names; writes <train.output_dir>/eval.json
    max_sequences: int = 0               # packed sequences (or pairs) per evaluation; 0 = all
    # tokens per packed held-out sequence (0: train.seq_len): evaluate at another length than the
    # training one, e.g. a model trained at 16K on 64K-token sequences (its loss by position shows
    # whether it uses the longer context), or a phase trained at 4K where its start model was measured
    seq_len: int = 0
    position_buckets: int = 6            # loss by position: [0, T/2^(n-1)), ..., [T/4, T/2), [T/2, T)
    passkey: int = 0                     # pass-key retrieval probes per evaluation (0 = none), train.seq_len long
    # RULER-style retrieval over the held-out documents (msa_train/quality/tasks.py): tasks, a grid of
    # probe lengths (empty: train.seq_len) x depths, probes per cell, exact match; retrieval_generate
    # probes are also decoded with generate() through the KV cache, to check the teacher-forced score
    retrieval: List[str] = field(default_factory=list)
    retrieval_lengths: List[int] = field(default_factory=list)
    retrieval_depths: int = 10
    retrieval_probes: int = 4
    retrieval_generate: int = 0

    def __post_init__(self):
        for key in ("every", "max_sequences", "passkey", "retrieval_generate"):
            _at_least(f"eval.{key}", getattr(self, key), 0, "an integer >= 0")
        if not isinstance(self.seq_len, int) or self.seq_len < 0 or self.seq_len == 1:
            raise ValueError(f"eval.seq_len={self.seq_len!r}: expected 0 (train.seq_len) or a number of tokens >= 2")
        _at_least("eval.position_buckets", self.position_buckets, 1, "an integer >= 1")
        for key in ("retrieval_depths", "retrieval_probes"):
            _at_least(f"eval.{key}", getattr(self, key), 1, "an integer >= 1")
        if any(not isinstance(n, int) or n < 64 for n in self.retrieval_lengths):
            raise ValueError(f"eval.retrieval_lengths={list(self.retrieval_lengths)!r}: expected integers >= 64")
        if self.retrieval:
            from msa_train.quality.tasks import check_tasks
            check_tasks(self.retrieval)


def _data_config_cls():
    from msa_train.data import DataConfig
    return DataConfig


@dataclass
class RootConfig:
    """The whole run. ``recipe_name`` is set by the chosen recipe."""
    # MISSING (not default instances): Hydra types each node from the annotation, and the group
    # YAML fills it; __post_init__ of every part runs once, in to_typed().
    model: ModelConfig = MISSING
    attention: AttentionConfig = MISSING
    parallel: ParallelConfig = MISSING
    data: Any = MISSING                  # msa_train.data.DataConfig (typed at registration)
    train: TrainConfig = MISSING
    logger: LoggerConfig = MISSING
    eval: EvalConfig = MISSING
    recipe_name: str = "custom"

    @property
    def eval_seq_len(self) -> int:
        """Tokens per packed held-out sequence: eval.seq_len, or train.seq_len where it is 0."""
        return self.eval.seq_len or self.train.seq_len

    def __post_init__(self):
        if not self.train.plan:  # a plan reads no data
            self.data.require_path()
        lengths = {"train.seq_len": self.train.seq_len}  # the packed lengths: training's, and evaluation's if its own
        if self.eval.seq_len:
            lengths["eval.seq_len"] = self.eval.seq_len
        for key, n in lengths.items():
            if n % self.parallel.sp_degree != 0:
                raise ValueError(f"{key}={n} must be divisible by parallel.sp_degree={self.parallel.sp_degree}")
        heads = self.model.hf_config.get("num_attention_heads") if self.model.path is None else None
        if self.parallel.sp_degree > 1 and heads is not None:  # a model.path's heads: checked by the trainer
            head_layout(heads, self.model.hf_config.get("num_key_value_heads") or heads, self.parallel.sp_degree)
        fmt = getattr(self.data, "format", None)
        on_pairs, pairs = self.train.objective in PAIR_OBJECTIVES, fmt in ("preference", "kto")
        if on_pairs != pairs:
            raise ValueError(f"train.objective={'|'.join(PAIR_OBJECTIVES)} and data.format=preference go together: "
                             "they train on preference pairs, and pairs train with one of them (got train.objective="
                             f"{self.train.objective!r}, data.format={fmt!r})")
        if fmt == "kto" and self.train.objective != "kto":
            raise ValueError(f"data.format=kto holds unpaired examples (a completion and a good/bad label), which only "
                             f"train.objective=kto trains on (got train.objective={self.train.objective!r}); "
                             "the other pair objectives need data.format=preference")
        grpo, prompts = self.train.objective == "grpo", fmt in ("prompts", "retrieval")
        if grpo != prompts:
            raise ValueError("train.objective=grpo and data.format=prompts|retrieval go together: GRPO samples "
                             "completions of prompts and rewards them against their answers (got train.objective="
                             f"{self.train.objective!r}, data.format={fmt!r})")
        if grpo and (self.parallel.sp_degree > 1 or self.parallel.zero_stage == 3):
            raise ValueError("train.objective=grpo samples with generate() on each rank's whole model: it needs "
                             f"parallel.sp_degree=1 and parallel.zero_stage < 3 (got {self.parallel.sp_degree} and "
                             f"{self.parallel.zero_stage}); for a model too big for one GPU, train LoRA adapters "
                             "(model.lora.r) under ZeRO-2")
        if grpo and (self.eval.retrieval or self.model.nsa_init == "distill" or self.eval.seq_len):
            what = "eval.retrieval (its haystack is held-out documents)" if self.eval.retrieval else \
                "eval.seq_len (it packs held-out documents)" if self.eval.seq_len else \
                "model.nsa_init=distill (it fits NSA on training documents)"
            raise ValueError(f"train.objective=grpo trains on prompts, not documents: {what} is not available; "
                             "GRPO's own evaluation is eval_reward on held-out prompts (data.eval_fraction)")
        ev, has_data = self.eval, self.data.has_eval or self.eval.passkey > 0
        if ev.retrieval and not self.data.has_eval:
            raise ValueError("eval.retrieval needs held-out documents for its haystack: set data.eval_path (files) "
                             "or data.eval_fraction")
        if (ev.every or ev.at_start or ev.only) and not has_data:
            what = "eval.only=true" if ev.only else f"eval.every={ev.every}" if ev.every else "eval.at_start=true"
            raise ValueError(f"{what} needs evaluation data: set data.eval_path (files) or data.eval_fraction (held-out "
                             "documents), or eval.passkey (synthetic probes)")
        for key, n in lengths.items():
            if self.attention.is_sparse and n < self.attention.slc_block:
                raise ValueError(f"{key}={n} must be >= attention.slc_block={self.attention.slc_block}")
        if 2 ** (ev.position_buckets - 1) > self.eval_seq_len:
            what = f"eval.seq_len={ev.seq_len}" if ev.seq_len else f"train.seq_len={self.train.seq_len}"
            raise ValueError(f"eval.position_buckets={ev.position_buckets}: the first of them would be shorter than one "
                             f"token at {what}")
        if self.model.nsa_init == "distill" and (not self.attention.is_sparse or self.parallel.zero_stage == 3
                                                 or self.parallel.sp_degree > 1):
            raise ValueError("model.nsa_init=distill fits NSA's parameters on one process's whole model: it needs a "
                             "sparse attention (nsa, fmsa, auto), parallel.zero_stage < 3 and parallel.sp_degree=1")
        if self.model.nsa_phi == "mean" and (not self.attention.is_sparse or self.parallel.zero_stage == 3):
            raise ValueError("model.nsa_phi=mean sets NSA's compression to mean pooling: it needs a sparse attention "
                             f"(nsa, fmsa, auto; got attention={self.attention.name}) and parallel.zero_stage < 3 "
                             f"(got {self.parallel.zero_stage}: phi's parameters are zeroed whole, not as ZeRO-3 "
                             "partitions)")


def register_configs() -> None:
    """Register the schemas with Hydra's ConfigStore (the primary config extends ``schema``)."""
    import dataclasses

    from hydra.core.config_store import ConfigStore

    data_cls = _data_config_cls()
    # Re-declare the root with the data field typed, so Hydra validates data keys too.
    typed_root = dataclasses.make_dataclass(
        "Config", [("data", data_cls, MISSING)], bases=(RootConfig,))
    cs = ConfigStore.instance()
    cs.store(name="schema", node=typed_root)


def schema_keys() -> List[str]:
    """Every settable key (``train.lr``, ...) and config group (``recipe``, ``attention``, ...) of the schema."""
    import dataclasses

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            sub = {"data": _data_config_cls()}.get(f.name) if cls is RootConfig else None
            sub = sub or (f.type if isinstance(f.type, type) else _FIELD_TYPES.get(f.type))
            yield prefix + f.name
            if sub is not None and dataclasses.is_dataclass(sub):
                yield from walk(sub, f"{prefix}{f.name}.")
    return ["recipe", *walk(RootConfig, "")]


def did_you_mean(key: str) -> str:
    """`` (did you mean train.lr?)`` for a misspelt ``key``, or "" when nothing is close."""
    close = difflib.get_close_matches(key, schema_keys(), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


# the annotations of RootConfig as strings (``from __future__ import annotations``)
_FIELD_TYPES = {"ModelConfig": ModelConfig, "LoraConfig": LoraConfig, "AttentionConfig": AttentionConfig,
                "ParallelConfig": ParallelConfig, "TrainConfig": TrainConfig, "LoggerConfig": LoggerConfig, "EvalConfig": EvalConfig}


def _unknown_keys(node, prefix: str = "") -> List[str]:
    """Keys of a composed config that its schema does not declare. Hydra's ``+key=value`` adds them
    without a check, and they would be dropped unread; free-form dict fields (``model.hf_config``)
    take any key."""
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return []
    declared = {f.name for f in dataclasses.fields(schema)}
    def leaves(value, key):  # +trian.lr=1 adds {"trian": {"lr": 1}}: the leaf is what was typed
        return [k for sub, v in value.items() for k in leaves(v, f"{key}.{sub}")] if isinstance(value, dict) else [key]

    out = []
    for key in node.keys():
        child = node._get_node(key)
        is_dict = isinstance(child, DictConfig) and not child._is_missing() and not child._is_none()
        if key not in declared:
            out += leaves(OmegaConf.to_container(child), f"{prefix}{key}") if is_dict else [f"{prefix}{key}"]
        elif is_dict:
            out += _unknown_keys(child, f"{prefix}{key}.")
    return out


def to_typed(cfg) -> RootConfig:
    """DictConfig -> validated dataclasses (runs every ``__post_init__``).

    Raises:
        ValueError: a key the schema does not know (added with ``+key=value``), or any value check.
    """
    from omegaconf import OmegaConf

    unknown = _unknown_keys(cfg)
    if unknown:
        shown = "; ".join(f"+{k}{did_you_mean(k)}" for k in unknown)
        raise ValueError(f"unknown setting: {shown}. Only free-form settings such as model.hf_config take new keys "
                         "(+model.hf_config.rope_theta=1e6); `msa-train --cfg job` prints every setting")
    obj = OmegaConf.to_object(cfg)
    return obj
