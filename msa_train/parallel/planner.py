"""Memory planner: the per-GPU peak a run will need, predicted from its config without a GPU.

``msa-train recipe=NAME train.plan=true [train.plan_world_size=8 parallel.sp_degree=8 train.seq_len=...]``
prints the table and writes ``<train.output_dir>/plan.json``; the trainer runs the same check before it
builds the model (:func:`check_fit`), so a recipe too large for the machine stops with what it needs
instead of an allocation error deep inside DeepSpeed.

What is counted, per GPU (bytes; ``N`` = ZeRO ranks = the world size, ``P`` = parameters):

* **Model state** (DeepSpeed's bf16 mixed precision, what its optimizers keep):
  bf16 parameters 2P, bf16 gradients 2P, fp32 master weights 4P and AdamW's two fp32 moments 8P
  (12P of optimizer state), plus, during the step, the gradients cast to fp32 for the master
  update, 4P. ZeRO-0 (DeepSpeed's FP16_Optimizer in bf16) keeps all of it on every rank; ZeRO-1
  shards the 12P + 4P; ZeRO-2 the gradients too; ZeRO-3 the parameters too (plus one layer
  gathered at a time). ``offload_optimizer`` moves the 12P + 4P shard to host memory (pinned), where
  the gradients go as they are reduced (no device gradient partition),
  ``offload_params`` the parameter shard. fp32 training (the CPU default): 4P parameters, 4P
  gradients, 8P moments, no master copy. With LoRA (``model.lora.r > 0``) gradients and optimizer
  state are those of the trainable parameters only: the adapters, and NSA's own by ``model.lora.nsa``
  (``model.nsa_phi=mean`` leaves phi's out too).
* **Activations** (per-token constants of ``parallel/memory.py``, counted with saved-tensor hooks
  on a Llama-3-8B-shape layer and written here as functions of the shape): what every layer keeps
  (its input only under activation checkpointing, on the host with ``offload_activations``) plus
  the one layer being recomputed and differentiated, with its backward's gradients (tiled: one
  tile of the MLP recomputed and differentiated at a time). With
  sequence parallelism P_sp a rank holds T/P_sp tokens outside attention and, inside it, all T
  tokens of HQ/P_sp query heads and max(1, HK/P_sp) KV heads (replicated when P_sp > HK).
* **Attention workspace**: dense: the softmax statistics (and FlashAttention's fp32 dq accumulator
  on the varlen path); NSA: the O(T·n) selected-block indices and the KV-block-centric kernel's
  partial outputs (one row per query, head and selected block), an upper bound.
* **DeepSpeed's reduce bucket** (ZeRO >= 1): the device buffer its gradients are reduced through,
  ``reduce_bucket_size`` elements in the model's dtype.
* **Loss**: one chunk of fp32 logits and their gradient (``train.loss_chunk_tokens`` x vocab), and
  the fused loss's head-weight gradient held from its forward to its backward.

The peak is the larger of the forward/backward peak and the optimizer step's (model state with
the step's fp32 gradients). The forward/backward peak is the model state without them, the kept
activations, the loss's held head gradient, and the larger of two transients alive one after the
other: the loss chunk (freed before the layers' backward starts) and one layer's recompute and
backward with the attention workspace. A margin for the allocator and the CUDA context
(``OVERHEAD_GB``) is added; ``allocated_gb`` is the peak without it, what
``torch.cuda.max_memory_allocated`` measures. The numbers are a model: ``python -m msa_train.bench
plan-check`` compares ``allocated_gb`` with measured peaks (docs/trainer.md).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from msa_train.parallel.deepspeed_config import PARTIAL_OFFLOAD_SUB_GROUP

GiB = 2 ** 30
H200_GB = 139.0  # usable device memory of one H200 (torch.cuda.mem_get_info on an idle one), GiB
NODE_GPUS = 8    # the planner plans single-node runs: the most GPUs it suggests
OVERHEAD_GB = 2.5  # CUDA context, cuBLAS/cuDNN handles and allocator fragmentation, GiB
# check_fit refuses a run only when its predicted need exceeds the memory by this factor: the
# prediction is a model (until plan-check has validated it, a run it overestimates must still start),
# and the runs it is there to stop (a 14B model at 1M tokens on one small machine) miss by far more
REFUSE_FACTOR = 1.5
TILE_TOKENS = 32768  # the ladder's parallel.tile_tokens (as in the recipes)
# Host memory of a training process besides what it offloads (torch's and CUDA's libraries, the
# tokenizer and data, DeepSpeed's staging buffers), GiB per rank, counted when the host's fit is
# checked: a 32-layer Llama-3-8B run whose offloaded optimizer state the planner puts at 119.7 GiB was
# killed by the host's OOM killer (benchmarks/results/e2e/h100.md) on an H100 machine with 124.4
# GiB available (MemAvailable, read in the same device call).
HOST_PROCESS_GB = 6.0
# DeepSpeed's reduce_bucket_size (its default; deepspeed_config.py leaves it): under ZeRO >= 1 with
# contiguous gradients (which deepspeed_config.py turns on) the gradients are reduced through a
# device buffer of this many elements in the model's dtype, ZeRO-1/2's for each backward
# (stage_1_and_2.py setup_buckets), ZeRO-3's for the whole run (stage3.py)
REDUCE_BUCKET_ELEMENTS = 500_000_000
# The host shares of the optimizer state that the ladder tries under ZeRO-3 (parallel.offload_ratio)
PARTIAL_OFFLOAD_RATIOS = tuple(round(1 - i / 20, 2) for i in range(1, 20))  # 0.95 ... 0.05


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs of the model; ``params`` counts NSA's own parameters too."""
    params: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool = False  # Qwen3: RMSNorms over every q and k head
    trainable: Optional[int] = None  # LoRA, nsa_phi=mean: the parameters that train (gradients, optimizer state); None: all
    head_trains: bool = True  # the LM head has a weight gradient (LoRA freezes it)
    # the trained parameters' sizes in the order DeepSpeed receives them (one parameter group): a
    # partial offload splits the optimizer state by sub-groups of them (host_share); () = unknown
    trained_numels: Tuple[int, ...] = ()

    @classmethod
    def from_config(cls, model_cfg, attention_cfg) -> "ModelShape":
        """From the model the run would build, on the meta device (no memory)."""
        from msa_train.models import _head_dims, meta_model

        model = meta_model(model_cfg, attention_cfg)
        config = model.config
        heads, kv_heads, head_dim = _head_dims(config)
        params = sum(p.numel() for p in model.parameters())  # tied ones once, as count_parameters
        trainable, frozen = None, set()
        if model_cfg.lora.enabled:
            from msa_train.models.lora import count_trainable

            trainable, adapters = count_trainable(model, model_cfg.lora)
            params += adapters  # new parameters beside the frozen ones
        if model_cfg.nsa_phi == "mean" and not (model_cfg.lora.enabled and model_cfg.lora.nsa == "freeze"):
            from msa_train.models import phi_parameters

            phi = list(phi_parameters(model))
            frozen = {id(p) for p in phi}
            trainable = (params if trainable is None else trainable) - sum(p.numel() for p in phi)
        # LoRA's adapters are not in the meta model: their order is unknown, so its share stays the ratio
        numels = () if model_cfg.lora.enabled else tuple(p.numel() for p in model.parameters()
                                                        if p.requires_grad and id(p) not in frozen)
        return cls(params=params, hidden=config.hidden_size, intermediate=config.intermediate_size,
                   layers=config.num_hidden_layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   vocab=config.vocab_size, qk_norm=config.model_type == "qwen3", trainable=trainable,
                   head_trains=not model_cfg.lora.enabled, trained_numels=numels)


@dataclass(frozen=True)
class Options:
    """The memory options of a run (``parallel.*`` and a few ``train.*``), unvalidated so the
    ladder can try combinations; :meth:`overrides` spells them as command-line overrides."""
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_ratio: float = 1.0     # parallel.offload_ratio (< 1: ZeRO-3's partial offload; the host's real share: host_share)
    offload_params: bool = False
    activation_checkpointing: bool = False
    offload_activations: bool = False
    tile_tokens: int = 0
    fused_ops: bool = True
    sp_degree: int = 1
    optimizer: str = "torch"       # parallel.optimizer: a partial offload needs DeepSpeed's (cpu_adam)

    @classmethod
    def from_config(cls, cfg, on_cuda: bool = True) -> "Options":
        p = cfg.parallel
        return cls(zero_stage=p.zero_stage, offload_optimizer=p.offload_optimizer, offload_ratio=p.offload_ratio,
                   offload_params=p.offload_params, activation_checkpointing=p.activation_checkpointing,
                   offload_activations=p.offload_activations, tile_tokens=p.tile_tokens,
                   fused_ops=on_cuda if p.fused_ops is None else p.fused_ops, sp_degree=p.sp_degree,
                   optimizer=p.optimizer)

    @property
    def slim_norms(self) -> bool:
        """Whether the RMSNorms save only their input (fused, or tiled), not HF's fp32 copy and rows."""
        return self.fused_ops or self.tile_tokens > 0

    def overrides(self, base: "Options") -> List[str]:
        """The ``parallel.key=value`` overrides that turn ``base`` into these options."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != getattr(base, f.name):
                out.append(f"parallel.{f.name}={str(value).lower() if isinstance(value, bool) else value}")
        return out


@dataclass(frozen=True)
class Workload:
    """What the run computes: attention, sequence length, world size, precision, loss chunking."""
    seq_len: int
    attention: str = "full"        # full | nsa | fmsa | auto
    world_size: int = 1
    bf16: bool = True
    loss_chunk_tokens: int = 4096
    loss_impl: str = "fused"
    cmp_stride: int = 16
    slc_topk: int = 16
    packed: bool = True            # several documents per row: the varlen dense kernel
    reference_weights: bool = False  # GRPO with a KL term: the trainable parameters' starting values, kept


@dataclass
class Plan:
    """A prediction, in GiB per GPU unless named otherwise."""
    parts: Dict[str, float]        # device GiB by part (model state, activations, ...)
    peak_gb: float                 # the larger of the backward's and the optimizer step's peak, + overhead
    host_gb: float                 # host memory per rank: offloaded optimizer state, parameters, activations
    gpu_gb: float
    host_limit_gb: Optional[float]
    options: Options
    workload: Workload
    notes: List[str] = field(default_factory=list)
    fix: Optional[List[str]] = None  # overrides that make it fit (the ladder), when it does not
    fit_world: Optional[int] = None  # when it does not: the fewest GPUs of one node (up to 8) it fits as it is

    @property
    def allocated_gb(self) -> float:
        """The peak without the overhead: what ``torch.cuda.max_memory_allocated`` would say."""
        return self.peak_gb - OVERHEAD_GB

    @property
    def host_need_gb(self) -> float:
        """Host memory the run needs on its host: every rank's offloaded state and its process."""
        return (self.host_gb + HOST_PROCESS_GB) * self.ranks_per_host

    @property
    def fits(self) -> bool:
        host_ok = self.host_limit_gb is None or self.host_need_gb <= self.host_limit_gb
        return self.peak_gb <= self.gpu_gb and host_ok

    @property
    def ranks_per_host(self) -> int:
        return self.workload.world_size  # one host: the planner plans single-node runs

    def to_dict(self) -> Dict:
        return {"fits": self.fits, "peak_gb": round(self.peak_gb, 2), "allocated_gb": round(self.allocated_gb, 2),
                "gpu_gb": self.gpu_gb,
                "host_gb_per_rank": round(self.host_gb, 2), "host_gb_all_ranks": round(self.host_gb * self.ranks_per_host, 2),
                "host_need_gb": round(self.host_need_gb, 2), "host_limit_gb": self.host_limit_gb, "parts_gb": {k: round(v, 3) for k, v in self.parts.items()},
                "options": dataclasses.asdict(self.options), "workload": dataclasses.asdict(self.workload),
                "fix": self.fix, "fit_world": self.fit_world, "notes": self.notes}


def rank_heads(heads: int, kv_heads: int, sp_degree: int) -> Tuple[int, int]:
    """(query heads, KV heads) a rank attends with under sequence parallelism: HQ/P query heads and
    HK/P KV heads, at least one (replicated) when P exceeds the KV heads."""
    return max(1, heads // sp_degree), max(1, kv_heads // sp_degree)


# ----------------------------------------------------------------------- model state
def host_share(numels: Sequence[int], ratio: float, world_size: int = 1,
               sub_group: int = PARTIAL_OFFLOAD_SUB_GROUP) -> float:
    """The fraction of the optimizer state's elements that DeepSpeed's ZeRO-3 partial offload puts
    on the host for ``parallel.offload_ratio`` = ``ratio``. DeepSpeed splits by sub-groups, not
    elements (stage3.py, DeepSpeed 0.19): it cuts each rank's partitions, in order, into sub-groups
    that close once they reach ``sub_group`` elements, gives the first ``int((1 - ratio) * n)`` of
    the n sub-groups to the GPU and the rest to the host. Llama-3-8B's embedding (525M elements)
    is a sub-group of its own, the first, so at ``ratio`` 0.8 on one GPU the host holds 0.773 of
    the state (on 8 ranks each rank's sub-groups are fewer: 0.895, and at 0.9 all of it).
    ``ratio`` itself where ``numels`` is empty (the sizes unknown)."""
    parts = [-(-n // max(1, world_size)) for n in numels]
    if not parts or ratio >= 1:
        return ratio
    groups, cur = [], 0
    for n in parts:
        cur += n
        if cur >= sub_group:
            groups.append(cur)
            cur = 0
    if cur:
        groups.append(cur)
    first_host = int((1 - ratio) * len(groups))
    return sum(groups[first_host:]) / sum(groups)


def model_state_bytes(params: int, opt: Options, world_size: int, bf16: bool = True,
                      trainable: Optional[int] = None, trained_numels: Sequence[int] = ()) -> Dict[str, float]:
    """Bytes per rank of parameters, gradients, optimizer state and the step's fp32 gradients, and
    of what is offloaded to the host (``host_*``). ``trainable`` (LoRA, nsa_phi=mean): the parameters that have
    gradients and optimizer state; None: all ``params``. ``trained_numels``: their sizes in order,
    for a partial offload's real split (:func:`host_share`)."""
    n = max(1, world_size)
    t = params if trainable is None else trainable
    if not bf16:  # fp32 weights, torch AdamW moments, no master copy
        p_b, g_b, opt_b, step_b = 4, 4, 8, 0
    else:
        p_b, g_b, opt_b, step_b = 2, 2, 12, 4
    z = opt.zero_stage
    out = {"parameters": p_b * params / (n if z == 3 else 1),
           "gradients": g_b * t / (n if z >= 2 else 1),
           "optimizer_state": opt_b * t / (n if z >= 1 else 1),
           "step_fp32_gradients": step_b * t / (n if z >= 1 else 1),
           "host_parameters": 0.0, "host_optimizer": 0.0}
    if opt.offload_optimizer and z >= 1:
        # DeepSpeed's CPU offload copies each reduced gradient partition straight into the host's fp32
        # buffer (the step's fp32 gradients): the device keeps no gradient partition (plan-check: the
        # 16-layer 64K point measured 31.2 GiB, 8.4 GiB of bf16 gradients below the plan that kept them)
        r = host_share(trained_numels, opt.offload_ratio, n) if z == 3 else 1.0
        state = out["optimizer_state"] + out["step_fp32_gradients"]
        out["host_optimizer"] = r * state
        if z == 3:
            # ZeRO-3 accumulates every gradient partition in a host buffer of the model's dtype
            # (stage3.py's grad_partitions_flat_buffer) before copying it to its sub-group's fp32
            # gradient; under a partial offload the GPU's sub-groups keep their fp32 master weights,
            # moments and gradients on the GPU from the start, so all of it is resident there
            out["host_optimizer"] += out["gradients"]
        out["optimizer_state"], out["step_fp32_gradients"], out["gradients"] = (1 - r) * state, 0.0, 0.0
    if opt.offload_params and z == 3:
        out["host_parameters"] = out["parameters"]
        out["parameters"] = 0.0
    return out


# ----------------------------------------------------------------------- activations
def layer_saved_bytes_per_token(shape: ModelShape, opt: Options, a: int = 2) -> Dict[str, float]:
    """Bytes per token one decoder layer saves for its backward, by part, at ``a`` bytes an element,
    on one rank without sequence parallelism (the caller scales by its tokens and heads).

    Hand-derived from what each op saves (``parallel/memory.py``): HF's RMSNorm its fp32 input and
    its normalised rows (6H at bf16), fused or tiled only its input; the SwiGLU MLP its input and
    four T x I tensors (8I), the fused SwiGLU three (6I), tiled only its input; attention q, k, v,
    its output, o_proj's input and the softmax statistics. For a Llama-3-8B layer this gives
    24 + 24 + 120 + 28 = 196 KiB (memory.py's hooks: 197), tiled 8 + 8 + 8 + 28 = 52 (53)."""
    H, I = shape.hidden, shape.intermediate
    HQ, HK, D = shape.heads, shape.kv_heads, shape.head_dim
    norm = a * H if opt.slim_norms else (2 * a + a) * H  # fp32 input (2a) + normalised rows (a)
    if opt.tile_tokens > 0:
        mlp = a * H
    else:
        mlp = a * H + (3 if opt.fused_ops else 4) * a * I
    attn = a * (3 * HQ * D + 2 * HK * D) + 4 * HQ  # q, o, o_proj input; k, v; fp32 lse
    if shape.qk_norm:
        attn += (a if opt.slim_norms else 3 * a) * (HQ + HK) * D
    return {"norms": 2 * norm, "mlp": mlp, "attention": attn}


def nsa_extra_bytes_per_token(shape: ModelShape, work: Workload, a: int = 2) -> float:
    """What NSA's branches save beyond dense attention's tensors, per token and layer."""
    HQ, HK, D = shape.heads, shape.kv_heads, shape.head_dim
    return (a * 3 * HQ * D          # compressed, selected and window outputs
            + a * 3 * HQ            # sigmoid gates
            + 4 * 2 * HQ            # two more branches' lse (fp32)
            + 4 * HK * work.slc_topk  # block indices (int32)
            + a * 2 * HK * D / work.cmp_stride)  # compressed keys and values (one per stride)


def attention_workspace_bytes(shape: ModelShape, work: Workload, q_heads: int, kv_heads: int, a: int = 2) -> float:
    """Transient bytes of one attention call's backward on a rank (all T tokens of its heads)."""
    T, D = work.seq_len, shape.head_dim
    if work.attention == "full":
        dq_acc = 4 * T * q_heads * D if work.packed else 0.0  # FlashAttention varlen's fp32 dq accumulator
        return dq_acc + 4 * T * q_heads * 2  # lse and the backward's delta
    # the selected-attention kernel's buffers: the KV-block-centric one's partial outputs (a row of D
    # and an fp32 lse per query, head and selected block), bounded by its partitions (the kernel's own
    # default_partition), and its fp32 dk/dv accumulators; the query-centric kernel keeps none
    blocks = 4 * T * q_heads * 2 + 4 * T * kv_heads * work.slc_topk  # lse, delta; block indices
    if work.attention == "nsa":
        return blocks
    from flash_msa.selection.fmsa import default_partition

    chunk, heads = default_partition(T, q_heads, kv_heads, work.slc_topk, D, element_size=a)
    partials = chunk * heads * (q_heads // kv_heads) * work.slc_topk * (a * D + 4)
    return blocks + partials + 2 * 4 * T * kv_heads * D


def activation_bytes(shape: ModelShape, opt: Options, work: Workload) -> Dict[str, float]:
    """Device and host bytes per rank of activations, attention workspace and loss."""
    a = 2 if work.bf16 else 4
    sp = max(1, opt.sp_degree)
    t_local = work.seq_len / sp
    q_heads, kv_heads = rank_heads(shape.heads, shape.kv_heads, sp)
    sparse = work.attention != "full"
    per = layer_saved_bytes_per_token(shape, opt, a)
    # attention's tensors: all T tokens of the rank's heads (head-sharded after the all-to-all)
    head_scale = (q_heads * sp) / shape.heads if sp > 1 else 1.0
    kv_scale = (kv_heads * sp) / shape.kv_heads if sp > 1 else 1.0
    attn_tok = per["attention"] * (head_scale + kv_scale) / 2  # q-side and kv-side about alike
    if sparse:
        attn_tok += nsa_extra_bytes_per_token(shape, work, a) * head_scale
    layer = (per["norms"] + per["mlp"] + attn_tok) * t_local
    H, a_hq = shape.hidden, a * (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    inputs = a * H * t_local  # one layer's input, what checkpointing keeps
    # A layer's backward peaks in one of two places. In its MLP's backward everything it saved is
    # alive, with the incoming hidden gradient and the MLP's T x I gradients (one tile when tiled);
    # in its attention's, the MLP's tensors and the second norm's are freed, and the q/k/v
    # gradients and both hidden gradients are alive.
    mlp_grad_tokens = min(t_local, opt.tile_tokens) if opt.tile_tokens else t_local
    in_mlp = layer + a * H * t_local + 2 * a * shape.intermediate * mlp_grad_tokens
    if opt.tile_tokens:
        # TiledMLP's backward recomputes one tile's forward with autograd before differentiating it:
        # that tile's saved T x I tensors (the SwiGLU's, 3 fused or 4) are alive beside its gradients.
        # Without them the planner was 3-4 GiB (12-23%) under every tiled point of the e2e report. (A
        # sequence of one tile runs the plain MLP, which saved the same tensors in its forward.)
        in_mlp += (3 if opt.fused_ops else 4) * a * shape.intermediate * mlp_grad_tokens
    in_attention = (per["norms"] / 2 + attn_tok) * t_local + (2 * a * H + a_hq) * t_local
    working = max(in_mlp, in_attention)
    out = {"host_activations": 0.0}
    L = shape.layers
    if opt.activation_checkpointing:
        kept = L * inputs
        if opt.offload_activations:
            # on the host; on the device only the input of the layer being recomputed, copied back
            # before its recompute and freed after its backward. A fused or tiled first norm saves
            # that same tensor, so the layer's working set above already counts it: counting two
            # inputs here put the planner 6% over at 256K and 14.5% over at 1M (4 layers, fmsa).
            # (Without offload the L kept inputs hold that one too, but leaving it out there put the
            # planner further from plan-check's measured peaks: mean error 2.5% against 2.1%, the
            # worst 6.9% under against 4.9% over; why is not known, so it stays counted.)
            out["host_activations"] = kept
            kept = 0.0 if opt.slim_norms else inputs
        out["activations_kept"] = kept
    else:
        out["activations_kept"] = (L - 1) * layer
    out["layer_working"] = working
    out["attention_workspace"] = attention_workspace_bytes(shape, work, q_heads, kv_heads, a)
    chunk = min(work.loss_chunk_tokens, t_local)
    # one chunk of fp32 logits (its softmax turned into its gradient in place) and the hidden states'
    # gradient, kept in the model's dtype from the forward to the backward. The chunk is freed before
    # the layers' backward starts, so it counts against the layers' working memory, not on top of it
    # (predict); what the loss holds into the layers' backward is ``loss_held``.
    out["loss"] = 4 * chunk * shape.vocab + a * H * t_local
    held = 0.0
    if work.loss_impl == "fused" and shape.head_trains:  # (LoRA freezes the head: no weight gradient)
        held = a * shape.vocab * H  # the head's weight gradient, held from the forward to the backward
    out["loss_held"] = held
    return out


# ----------------------------------------------------------------------- the plan
def predict(shape: ModelShape, opt: Options, work: Workload, gpu_gb: float = H200_GB,
            host_limit_gb: Optional[float] = None) -> Plan:
    """The per-GPU peak of one configuration (no ladder; see :func:`plan`)."""
    state = model_state_bytes(shape.params, opt, work.world_size, work.bf16, shape.trainable, shape.trained_numels)
    act = activation_bytes(shape, opt, work)
    gathered = 0.0
    if opt.zero_stage == 3:  # one layer's parameters gathered whole (bf16) while it runs, and its gradients
        gathered = 2 * 2 * (shape.params / max(1, shape.layers))
    # (without it the planner was 0.4-1.7 GiB, 2-8.5%, under every ZeRO-2 point of the e2e report)
    bucket = REDUCE_BUCKET_ELEMENTS * (2 if work.bf16 else 4) if opt.zero_stage >= 1 else 0.0
    # GRPO's reference policy: the starting values of the trainable parameters, on every rank, in the
    # model's dtype (msa_train/grpo.py StartingWeights)
    reference = (shape.params if shape.trainable is None else shape.trainable) * (2 if work.bf16 else 4) \
        if work.reference_weights else 0.0
    parts = {"parameters": state["parameters"], "reference_weights": reference, "gradients": state["gradients"],
             "optimizer_state": state["optimizer_state"], "zero3_gathered_layer": gathered,
             "reduce_bucket": bucket,
             "activations_kept": act["activations_kept"], "layer_working": act["layer_working"],
             "attention_workspace": act["attention_workspace"], "loss": act["loss"], "loss_held": act["loss_held"],
             "step_fp32_gradients": state["step_fp32_gradients"]}
    resident = parts["parameters"] + reference + parts["gradients"] + parts["optimizer_state"]
    # the loss's chunk of logits and the layers' recompute-and-backward are alive one after the other
    transient = max(act["loss"], act["layer_working"] + act["attention_workspace"])
    backward_peak = resident + gathered + bucket + act["activations_kept"] + act["loss_held"] + transient
    step_peak = resident + state["step_fp32_gradients"] + (bucket if opt.zero_stage == 3 else 0.0)
    peak = max(backward_peak, step_peak) / GiB + OVERHEAD_GB
    host = (state["host_parameters"] + state["host_optimizer"] + act["host_activations"]) / GiB
    parts_gb = {k: v / GiB for k, v in parts.items()}
    parts_gb |= {"host_parameters": state["host_parameters"] / GiB, "host_optimizer": state["host_optimizer"] / GiB,
                 "host_activations": act["host_activations"] / GiB}
    notes = [f"peak = max(backward {backward_peak / GiB:.1f}, optimizer step {step_peak / GiB:.1f}) GiB "
             f"+ {OVERHEAD_GB} GiB context and fragmentation; the backward counts the larger of the loss chunk "
             f"({act['loss'] / GiB:.1f}) and the layer's working memory with the attention workspace "
             f"({(act['layer_working'] + act['attention_workspace']) / GiB:.1f}), which are alive one after the other"]
    if opt.sp_degree > shape.kv_heads:
        notes.append(f"sp_degree {opt.sp_degree} > {shape.kv_heads} KV heads: each rank holds one KV head (replicated)")
    return Plan(parts=parts_gb, peak_gb=peak, host_gb=host, gpu_gb=gpu_gb, host_limit_gb=host_limit_gb,
                options=opt, workload=work, notes=notes)


def ladder(opt: Options, work: Workload) -> List[Options]:
    """The fixed order in which memory options are turned on, each step keeping the ones before:
    activation checkpointing, tiled MLPs and norms, the layers' inputs on the host, optimizer state on
    the host (ZeRO-2 when ZeRO was off), ZeRO-3 (or, for a host too small for the optimizer state,
    ZeRO-3 with a part of it on the GPU), parameters on the host, then doubling the SP degree
    (while it divides the world size and the sequence length)."""
    steps, cur = [], opt

    def step(**kw):
        nonlocal cur
        new = dataclasses.replace(cur, **kw)
        if new != cur:
            steps.append(new)
        cur = new

    step(activation_checkpointing=True)
    step(tile_tokens=cur.tile_tokens or TILE_TOKENS)
    step(offload_activations=True)
    step(offload_optimizer=True, zero_stage=max(cur.zero_stage, 2))
    step(zero_stage=3)
    # for a host too small for the whole optimizer state: a part of it on the GPU, the largest host
    # share that fits first (each an alternative to the step before, not kept by the next), first
    # with the layers' inputs where the run had them (offloading them takes host memory too)
    for act in dict.fromkeys((opt.offload_activations, cur.offload_activations)):
        steps.extend(dataclasses.replace(cur, offload_activations=act, offload_ratio=r, optimizer="deepspeed")
                     for r in PARTIAL_OFFLOAD_RATIOS)
    step(offload_params=True)
    while (cur.sp_degree * 2 <= work.world_size and work.world_size % (cur.sp_degree * 2) == 0
           and work.seq_len % (cur.sp_degree * 2) == 0):
        step(sp_degree=cur.sp_degree * 2)
    return steps


def plan(shape: ModelShape, opt: Options, work: Workload, gpu_gb: float = H200_GB,
         host_limit_gb: Optional[float] = None) -> Plan:
    """:func:`predict`, and when it does not fit, the first step of :func:`ladder` that does
    (``Plan.fix``: the overrides; ``[]`` when none does) and the fewest GPUs of one node on which
    the same options fit (``Plan.fit_world``: a power of two times the world size, up to NODE_GPUS)."""
    result = predict(shape, opt, work, gpu_gb, host_limit_gb)
    if not result.fits:
        result.fix = []
        for candidate in ladder(opt, work):
            if predict(shape, candidate, work, gpu_gb, host_limit_gb).fits:
                result.fix = candidate.overrides(opt)
                break
        world = work.world_size * 2  # the same options on more GPUs of the node: ZeRO shards the model state
        while world <= NODE_GPUS and result.fit_world is None:
            if predict(shape, opt, dataclasses.replace(work, world_size=world), gpu_gb, host_limit_gb).fits:
                result.fit_world = world
            world *= 2
    return result


def host_memory_gb() -> float:
    """Physical memory of this host, GiB."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB


def host_available_gb() -> float:
    """Memory this host can give a new process now (``MemAvailable``), GiB; the physical memory where
    /proc/meminfo is missing. What a run must fit in (with ``HOST_PROCESS_GB`` a rank)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return host_memory_gb()


def plan_of_config(cfg, world_size: Optional[int] = None, gpu_gb: Optional[float] = None,
                   host_limit_gb: Optional[float] = None, on_cuda: bool = True) -> Plan:
    """The plan of a typed ``RootConfig`` (``train.plan_world_size``, ``train.plan_gpu_gb`` unless
    given): its model shape from the HF config on the meta device, no weights built."""
    t = cfg.train
    world = world_size or t.plan_world_size or cfg.parallel.sp_degree
    if world % cfg.parallel.sp_degree:
        raise ValueError(f"train.plan_world_size={world} must be a multiple of parallel.sp_degree="
                         f"{cfg.parallel.sp_degree}")
    bf16 = t.precision == "bf16" or (t.precision == "auto" and on_cuda)
    seq_len, loss_impl = t.seq_len, t.loss_impl
    if t.objective == "grpo":
        # GRPO trains a prompt's group of completions as one packed row of grpo_group x (prompt +
        # completion) tokens, with per-token losses (the recompute form). Its generation holds a KV
        # cache of those tokens, 2 x kv_heads x head_dim / hidden of the layer inputs that activation
        # checkpointing keeps for them (0.5 for Llama-3-8B): the loss pass is the peak.
        seq_len, loss_impl = t.grpo_group * (t.seq_len + t.grpo_max_new_tokens), "recompute"
    work = Workload(seq_len=seq_len, attention=cfg.attention.name, world_size=world, bf16=bf16,
                    loss_chunk_tokens=t.loss_chunk_tokens, loss_impl=loss_impl,
                    reference_weights=t.objective == "grpo" and t.grpo_beta > 0,
                    cmp_stride=cfg.attention.cmp_stride, slc_topk=cfg.attention.slc_topk)
    shape = ModelShape.from_config(cfg.model, cfg.attention)
    return plan(shape, Options.from_config(cfg, on_cuda), work, gpu_gb or t.plan_gpu_gb or visible_gpu_gb(),
                host_limit_gb)


def visible_gpu_gb() -> float:
    """Memory of the first visible GPU, GiB, or an H200's when there is none (plans for a GPU machine
    are often made on a laptop)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GiB
    return H200_GB


def print_plan(cfg) -> Plan:
    """``train.plan=true``: print the plan of the config and write ``<train.output_dir>/plan.json``."""
    # a plan is for GPUs (bf16 and the fused kernels by default), wherever it is made
    result = plan_of_config(cfg, host_limit_gb=cfg.train.plan_host_gb, on_cuda=cfg.train.precision != "fp32")
    print(render(result, f"memory plan of recipe {cfg.recipe_name}"))
    path = write_plan(result, Path(cfg.train.output_dir))
    print(f"written: {path}")
    return result


PART_LABELS = {
    "parameters": "parameters", "reference_weights": "GRPO reference policy (starting weights)",
    "gradients": "gradients", "optimizer_state": "optimizer state (fp32 master + AdamW; a partial offload's fp32 gradients)",
    "zero3_gathered_layer": "ZeRO-3: one layer gathered", "reduce_bucket": "ZeRO: gradient reduce bucket",
    "activations_kept": "activations kept by every layer",
    "layer_working": "one layer recomputed + its backward", "attention_workspace": "attention workspace",
    "loss": "logits / loss chunk (before the layers' backward)",
    "loss_held": "head weight gradient (fused loss)", "step_fp32_gradients": "optimizer step: fp32 gradients",
    "host_parameters": "host: parameters", "host_optimizer": "host: optimizer state",
    "host_activations": "host: layer inputs",
}


def render(result: Plan, title: str) -> str:
    """The plan as a rich table (plain text when rich is missing), with the verdict and the fix."""
    rows = [(PART_LABELS.get(k, k), f"{v:,.2f}") for k, v in result.parts.items() if v]
    o, w = result.options, result.workload
    head = (f"{title}: attention={w.attention} seq_len={w.seq_len:,} world={w.world_size} sp={o.sp_degree} "
            f"ZeRO-{o.zero_stage} ckpt={o.activation_checkpointing} tile={o.tile_tokens} "
            f"offload(act/opt/params)={o.offload_activations}/{o.offload_optimizer}/{o.offload_params}"
            + (f" offload_ratio={o.offload_ratio}" if o.offload_optimizer and o.offload_ratio < 1 else ""))
    verdict = (f"predicted peak {result.peak_gb:,.1f} GiB per GPU of {result.gpu_gb:,.0f}; host "
               f"{result.host_gb * result.ranks_per_host:,.1f} GiB offloaded for {result.ranks_per_host} rank(s)"
               + (f", {result.host_need_gb:,.1f} with the processes, of {result.host_limit_gb:,.0f}"
                  if result.host_limit_gb else "")
               + (": fits" if result.fits else ": does NOT fit"))
    if result.fix:
        verdict += "\nwould fit with: " + " ".join(result.fix)
    elif result.fix == []:
        verdict += "\nno option of the ladder makes it fit: more GPUs (train.plan_world_size) or a shorter train.seq_len"
    if result.fit_world:
        verdict += (f"\n{'or, ' if result.fix else ''}as it is, on {result.fit_world} GPUs of one node "
                    f"(train.plan_world_size={result.fit_world})")
    try:
        import io

        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return "\n".join([head, *(f"  {a:<42}{b:>10}" for a, b in rows), verdict, *result.notes])
    table = Table(title=head, title_justify="left")
    table.add_column("part")
    table.add_column("GiB", justify="right")
    for a, b in rows:
        table.add_row(a, b)
    table.add_row("[bold]peak per GPU[/bold]", f"[bold]{result.peak_gb:,.2f}[/bold]")
    buf = io.StringIO()
    Console(file=buf, width=110, force_terminal=False).print(table)
    return buf.getvalue() + verdict + "\n" + "\n".join(result.notes)


def write_plan(result: Plan, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "plan.json"
    path.write_text(json.dumps(result.to_dict(), indent=2))
    return path


def check_fit(cfg, world_size: int, device) -> Optional[str]:
    """Before the model is built: the reason the run cannot fit this machine, or None. On CUDA
    against the device's memory (and the host's for what is offloaded), on CPU, where everything
    lives in host memory, the whole per-rank need against the host's memory."""
    import torch

    host = host_memory_gb()
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        result = plan_of_config(cfg, world_size, gpu_gb=total / GiB, host_limit_gb=host, on_cuda=True)
        host_need = result.host_need_gb
        if result.peak_gb <= REFUSE_FACTOR * result.gpu_gb and host_need <= REFUSE_FACTOR * host:
            return None
        need = f"{result.peak_gb:,.1f} GiB per GPU (this one has {total / GiB:,.1f})"
        if result.peak_gb <= REFUSE_FACTOR * result.gpu_gb:
            need = f"{host_need:,.1f} GiB of host memory (this host has {host:,.1f})"
    else:
        result = plan_of_config(cfg, world_size, gpu_gb=float("inf"), on_cuda=False)
        total_gb = result.peak_gb + result.host_gb
        if total_gb * world_size <= REFUSE_FACTOR * host:
            return None
        need = f"{total_gb * world_size:,.1f} GiB of host memory for {world_size} rank(s) (this host has {host:,.1f})"
        result.fix = result.fit_world = None
    fix = f"; would fit with: {' '.join(result.fix)}" if result.fix else ""
    if result.fit_world:
        fix += f"{'; or' if fix else ';'} as it is on {result.fit_world} GPUs"
    return (f"the planner predicts this run needs {need} at train.seq_len={cfg.train.seq_len}, "
            f"attention={cfg.attention.name}{fix}. `msa-train ... train.plan=true` prints the breakdown "
            "(docs/trainer.md, 'Memory planner').")
