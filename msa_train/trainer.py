"""The Trainer: builds its parts in order, then runs ``train_step`` until ``train.steps``.

Data per rank per micro step: one packed sequence (B = 1) of ``train.seq_len`` tokens with
per-document ``position_ids`` and ``cu_seqlens``. One optimizer step = ``grad_accum`` micro steps on
every rank. The loss is token-weighted across micro steps and ranks: every label token of the
global batch has the same weight, however the documents fall into sequences.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from msa_train.checkpoint import CheckpointManager, find_latest, safe_load, swap_in
from msa_train.config import GRPO_SETTINGS, PAIR_OBJECTIVES, PREFERENCE_SETTINGS, WITH_REFERENCE, RootConfig
from msa_train.loss import IGNORE_INDEX
from msa_train.metrics import (MetricsLogger, PhaseTimer, log_on_rank_zero_only, model_flops_per_token,
                               peak_memory_gb, peak_tflops)
from msa_train.parallel.distributed import bound_collectives
from msa_train.parallel.engine import sync_gpu_share

log = logging.getLogger(__name__)


def next_token_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """HF-style labels (aligned with input_ids) -> per-position next-token targets.

    Args:
        labels: int64 [T], -100 where a token must not be predicted.
        cu_seqlens: int32 [N+1] document offsets (CPU).

    Returns:
        int64 [T]: ``targets[t] = labels[t + 1]``, and -100 at the last token of every document
        (its next token belongs to another document).
    """
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:-1] = labels[1:]
    targets[(cu_seqlens[1:].long() - 1).clamp_min(0)] = IGNORE_INDEX
    return targets


class NonFiniteError(FloatingPointError):
    """The loss, the gradient norm or the weights stopped being finite (``train.on_nonfinite``)."""


def nonfinite_values(record: Dict[str, Any]) -> List[str]:
    """``name=value`` of a logged record's loss and gradient norm that are not finite (host floats)."""
    return [f"{k}={record[k]}" for k in ("loss", "grad_norm")
            if isinstance(record.get(k), float) and not math.isfinite(record[k])]


def _grad_norm(module: torch.nn.Module) -> torch.Tensor:
    """Global L2 norm of the gradients (device scalar, no sync)."""
    norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


# train.* settings that change the loss curve; the others (steps, output, logging, checkpoint
# cadence) may change between a run and its resume.
RESUME_TRAIN_KEYS = ("seq_len", "grad_accum", "lr", "betas", "min_lr_ratio", "warmup_steps", "lr_schedule",
                     "decay_fraction", "weight_decay",
                     "grad_clip", "seed", "precision", "loss_chunk_tokens", "loss_impl", "objective",
                     *PREFERENCE_SETTINGS, *GRPO_SETTINGS)


def _later_settings() -> Dict[str, Any]:
    """Settings added after checkpoints were first written, with the value those runs had."""
    from msa_train.config import LoraConfig, TrainConfig
    from msa_train.data import DataConfig

    lora = json.loads(json.dumps(dataclasses.asdict(LoraConfig())))
    train, data = TrainConfig(), DataConfig()
    return {**{f"model.lora.{k}": v for k, v in lora.items()},
            **{f"train.{k}": getattr(train, k) for k in (*PREFERENCE_SETTINGS, *GRPO_SETTINGS, "lr_schedule",
                                                         "decay_fraction") if k != "dpo_beta"},
            **{f"data.{k}": getattr(data, k) for k in ("answer_field", "completion_field", "label_field", "tasks",
                                                        "num_prompts")}}


_LATER_SETTINGS = _later_settings()


def check_resume_config(saved: Dict[str, Any], current: Dict[str, Any], path) -> None:
    """Refuse to resume a checkpoint whose run was configured differently, or trained on data files
    that have changed since: it would not continue exactly."""
    saved, current = dict(saved), dict(current)
    saved_files, files = saved.pop("data_files", None), current.pop("data_files", None)
    allow_changed = current.get("data", {}).get("allow_changed", False)
    for rc in (saved, current):  # a setting of the resume itself, not of the run
        rc["data"] = {k: v for k, v in rc.get("data", {}).items() if k != "allow_changed"}
    if saved_files is not None and files is not None and saved_files != files and not allow_changed:
        before = {f["path"]: f for f in saved_files}
        now = {f["path"]: f for f in files}
        diff = [f"{p} {'is new' if p not in before else 'is gone' if p not in now else 'changed'}"
                for p in sorted(before.keys() | now.keys()) if before.get(p) != now.get(p)]
        raise ValueError(f"train.resume: the data changed since checkpoint {path} was written ({'; '.join(diff[:5])}"
                         f"{'; ...' if len(diff) > 5 else ''}): the run would not continue on the same sequences. "
                         "Restore the files, or resume anyway with data.allow_changed=true")

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out
    a, b = flat(saved), flat(current)
    if saved and "train.loss_impl" not in a and "train.loss_impl" in b:
        a["train.loss_impl"] = "recompute"  # checkpoints from before the setting: the only form then
    if saved and "data.long_prompt" not in a and a.get("data.format") != "sft":
        a["data.long_prompt"] = b.get("data.long_prompt")  # SFT only: no effect on the other formats' data
    if saved:  # checkpoints from before LoRA and the reference-free objectives: they ran with the defaults
        for k, default in _LATER_SETTINGS.items():
            if k not in a and b.get(k) == default:
                a[k] = default
    if a.get("train.lr_schedule") == b.get("train.lr_schedule") == "cosine":  # decay_fraction is wsd's alone
        a.pop("train.decay_fraction", None), b.pop("train.decay_fraction", None)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    if saved and changed:
        shown = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed[:6])
        raise ValueError(f"train.resume: checkpoint {path} was written by a run configured differently ({shown}); "
                         "resume with the same settings, or start fresh with train.resume=none and a new train.output_dir")


def check_eval_config(saved: Dict[str, Any], current: Dict[str, Any], path) -> None:
    """``eval.only`` on a checkpoint: the weights must fit this run's model and ZeRO layout; the
    sparse attention variant, the sequence length, the data and the training settings may differ."""
    def fits(rc):
        attention = {k: v for k, v in rc.get("attention", {}).items() if k != "name"}
        attention["sparse"] = rc.get("attention", {}).get("name") != "full"  # NSA's parameters or none
        # ZeRO-3 partitions the weights by rank; DPO's and KTO's reference is stored per rank
        per_rank = rc.get("zero_stage") == 3 or rc.get("train", {}).get("objective") in WITH_REFERENCE
        model = rc.get("model")
        if isinstance(model, dict) and "lora" not in model:  # written before LoRA: without it
            model = {**model, "lora": {k[len("model.lora."):]: v for k, v in _LATER_SETTINGS.items()
                                       if k.startswith("model.lora.")}}
        # a LoRA checkpoint holds the trainable tensors only: the frozen base comes from model.path, or
        # without one from the seed, which then has to be the training run's
        seeded = isinstance(model, dict) and not model.get("path") and (model.get("lora") or {}).get("r", 0) > 0
        return {"model": model, "attention": attention, "zero_stage": rc.get("zero_stage"),
                "world_size": rc.get("world_size") if per_rank else None,
                "train.seed": rc.get("train", {}).get("seed") if seeded else None}
    a, b = fits(saved), fits(current)
    changed = [k for k in a if a[k] != b[k]]
    if saved and changed:
        shown = ", ".join(f"{k}: {a[k]!r} -> {b[k]!r}" for k in changed)
        raise ValueError(f"eval.only: checkpoint {path} does not fit this run ({shown}); evaluate its run's hf/ "
                         "export with model.path=<run>/hf instead, under any settings")


def format_count(n: int) -> str:
    """A parameter count for people: 15.1B, 124M, 3.2K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def check_run_dir(run_dir: Path) -> None:
    """Create ``train.output_dir`` and make sure it and its ``checkpoints/`` take files, at startup
    rather than at the first save. A file is written and removed: permission bits do not stop root,
    a read-only mount or a path that is a file do."""
    import tempfile

    for path in (run_dir, run_dir / "checkpoints"):
        if path.exists() and not path.is_dir():
            raise ValueError(f"train.output_dir: {path} exists and is not a directory; choose another "
                             "train.output_dir or move the file")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        for path in (run_dir, run_dir / "checkpoints"):
            if path.is_dir():
                with tempfile.TemporaryFile(dir=path):
                    pass
    except OSError as e:
        raise ValueError(f"train.output_dir={str(run_dir)!r}: cannot write there ({e.strerror or e}: "
                         f"{e.filename or path}); choose a writable train.output_dir") from None


class Trainer:
    """torchtitan-style trainer: ``__init__`` is the ordered list of ``_build_*`` steps."""

    def __init__(self, cfg: RootConfig):
        self.cfg = cfg
        self.pairs = cfg.train.objective in PAIR_OBJECTIVES
        self.with_reference = cfg.train.objective in WITH_REFERENCE  # taken once at the start (DPO, KTO)
        self.grpo = cfg.train.objective == "grpo"  # rollouts and rewards (msa_train/grpo.py)
        # seconds each build step took (summary.json's "startup_s"): on a GPU a benchmark point's
        # startup can take longer than its steps, and this says which step to look at
        self.startup_s: Dict[str, float] = {}
        steps = ["distributed", "data", "model", "parallelize", "optimizer", "checkpoint",
                 *(["reference"] if self.with_reference else []), *(["grpo"] if self.grpo else []), "logger"]
        for name in steps:
            t0 = time.perf_counter()
            getattr(self, f"_build_{name}")()
            self.startup_s[name] = round(time.perf_counter() - t0, 3)
        bound_collectives(self.dist.timeout)  # the groups DeepSpeed made too (parallel.timeout_s)
        if self.dist.is_main:
            log.info("startup: %s", ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_s.items()))

    # ------------------------------------------------------------------ build
    def _build_distributed(self) -> None:
        from msa_train.parallel import build_deepspeed_config, init_distributed
        from msa_train.parallel.sequence import build_layout
        from msa_train.preemption import control_group

        cfg = self.cfg
        self.dist = init_distributed(cfg.train.device, cfg.parallel.backend, cfg.parallel.timeout_s)
        log_on_rank_zero_only(self.dist.rank)
        self.device = self.dist.device
        precision = cfg.train.precision
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "fp32"
        self.bf16 = precision == "bf16"
        self.ds_config = build_deepspeed_config(
            cfg.parallel, cfg.train, world_size=self.dist.world_size, bf16=self.bf16)
        # data-parallel ranks and sequence-parallel groups (msa_train/parallel/sequence.py)
        self.layout = build_layout(cfg.parallel.sp_degree, self.dist.rank, self.dist.world_size,
                                   timeout=self.dist.timeout)
        self.sp = self.layout.sp
        # for the stop-signal agreement
        self._control = control_group(self.dist.backend, self.dist.world_size, self.dist.timeout)
        self.run_dir = Path(cfg.train.output_dir).resolve()
        if self.dist.is_main:
            check_run_dir(self.run_dir)
        torch.manual_seed(cfg.train.seed)  # identical model init on every rank

    def _build_data(self) -> None:
        from msa_train import data

        from msa_train.data.sources import data_fingerprint

        cfg = self.cfg
        self.data_fingerprint = data_fingerprint(cfg.data)  # checked on resume (check_resume_config)
        self.tokenizer = data.build_tokenizer(cfg.data, cfg.model.path)
        # eval.only tokenises the evaluation documents alone
        self.dataset, self.eval_dataset = data.build_packed_datasets(cfg.data, self.tokenizer, cfg.train.seq_len,
                                                                     train=not cfg.eval.only,
                                                                     eval_seq_len=cfg.eval_seq_len)
        self.passkey_probes = []
        if cfg.eval.passkey:
            from msa_train.evaluation import passkey_probes

            self.passkey_probes = passkey_probes(self.tokenizer, cfg.train.seq_len, cfg.eval.passkey, cfg.data.seed,
                                                 cfg.data.add_bos)
        self.retrieval_probes = self._retrieval_probes() if cfg.eval.retrieval else []
        self._check_training_documents()
        if cfg.eval.only:
            self.sampler = self._sampler_iter = None
            return
        # the ranks of a sequence-parallel group draw the same sequence (each keeps its shard of it)
        self.sampler = data.ResumableSampler(len(self.dataset), seed=cfg.data.seed, rank=self.layout.dp_rank,
                                             world_size=self.layout.dp_size)
        self._sampler_iter = iter(self.sampler)

    def _retrieval_probes(self) -> List[Dict[str, Any]]:
        """The eval.retrieval grid over a haystack of the held-out documents (msa_train/quality/tasks.py)."""
        from msa_train.evaluation import retrieval_haystack
        from msa_train.quality.tasks import depth_grid, probe_grid

        ev, cfg = self.cfg.eval, self.cfg
        if ev.retrieval_generate and (self.dist.world_size > 1 or cfg.parallel.zero_stage == 3):
            raise ValueError("eval.retrieval_generate runs generate() on one process with the whole model: use one "
                             "process and parallel.zero_stage < 3, or eval.retrieval_generate=0")
        lengths = list(ev.retrieval_lengths) or [cfg.train.seq_len]
        bos = self.tokenizer.bos_token_id if cfg.data.add_bos else None
        haystack = retrieval_haystack(self.eval_dataset, self.tokenizer, max(8 * max(lengths), 1 << 20))
        return probe_grid(ev.retrieval, self.tokenizer, haystack, lengths, depth_grid(ev.retrieval_depths),
                          ev.retrieval_probes, seed="eval", bos_id=bos)  # fixed: the same probes under any data.seed

    def _check_training_documents(self) -> None:
        """The hold-out record: a training run writes the fingerprints of the documents it trains on
        (with those its starting model recorded) to <run>/training_documents.npy, and its hf/ export
        carries them; evaluation refuses held-out documents that the model was trained on."""
        from msa_train import evaluation as E

        cfg = self.cfg
        inherited = E.read_training_documents(Path(cfg.model.path) / E.TRAINING_DOCUMENTS) if cfg.model.path else None
        if not cfg.eval.only:
            trained = E.document_fingerprints(self.dataset)
            if trained is None:  # pairs, examples, prompts: no documents of their own, the starting model's kept
                if inherited is not None and self.dist.is_main:
                    E.write_training_documents(self.run_dir / E.TRAINING_DOCUMENTS, np.zeros(0, np.uint64), inherited)
                return
            if self.dist.is_main:
                E.write_training_documents(self.run_dir / E.TRAINING_DOCUMENTS, trained, inherited)
            held = E.document_fingerprints(self.eval_dataset) if self.eval_dataset is not None else None
            if held is not None and self.dist.is_main:
                n = E.trained_on(held, trained if inherited is None else np.union1d(trained, inherited))
                if n:
                    log.warning("evaluation data: %d of its %d documents are also training documents (of data.path, "
                                "or of the starting model's record): its loss is not a held-out loss", n, len(held))
            return
        held = E.document_fingerprints(self.eval_dataset) if self.eval_dataset is not None else None
        if held is None:
            return
        sources = []
        if cfg.train.resume != "none":
            run = self.run_dir if cfg.train.resume == "auto" else Path(cfg.train.resume).resolve().parent.parent
            sources.append(run / E.TRAINING_DOCUMENTS)
        if cfg.model.path:
            sources.append(Path(cfg.model.path) / E.TRAINING_DOCUMENTS)
        records = [(p, E.read_training_documents(p)) for p in sources]
        records = [(p, r) for p, r in records if r is not None]
        if not records:
            if sources and self.dist.is_main:
                log.warning("eval.only: no record of the documents the model was trained on (%s): cannot check that "
                            "the evaluation documents are held out", ", ".join(map(str, sources)))
            return
        for path, record in records:
            n = E.trained_on(held, record)
            if n:
                raise ValueError(
                    f"eval.only: {n} of the {len(held)} evaluation documents were trained on (record {path}): its "
                    "loss would not be a held-out loss. Evaluate on documents the model did not see: the hold-out "
                    "its run used (the data.eval_fraction / data.seed in its config.json), or data.eval_path files")

    def _build_model(self) -> None:
        from msa_train.models import build_model, count_parameters
        from msa_train.parallel import model_init_context

        cfg = self.cfg
        # Meta-device dry run first: a bad model config fails here, before any memory is allocated.
        self.n_params, self.n_matmul = count_parameters(cfg.model, cfg.attention)
        if self.dist.is_main:
            log.info("model: %s (%s), %s parameters, attention=%s, ZeRO-%d, %s on %s x%d",
                     cfg.model.name, cfg.model.model_type, format_count(self.n_params), cfg.attention.name,
                     cfg.parallel.zero_stage, "bf16" if self.bf16 else "fp32", self.device.type, self.dist.world_size)
        if cfg.train.plan_check:  # before zero.Init allocates: a run that cannot fit stops saying what it needs
            from msa_train.parallel.planner import check_fit

            reason = check_fit(cfg, self.dist.world_size, self.device)
            if reason:
                raise ValueError(f"{reason} (train.plan_check=false skips this check)")
        self._init_context = model_init_context(cfg.parallel.zero_stage, self.ds_config)  # kept alive: see its doc
        # Built directly in the training dtype: DeepSpeed's bf16 optimizer keeps its own fp32 master copy.
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        # seeded right here: what ran since the seed above (tokenising, the meta-device count, the
        # first import of a library) may have drawn from the generator, and the weights must not
        # depend on it (the same init on every rank and in every process)
        torch.manual_seed(cfg.train.seed)
        # Under ZeRO 0-2 on CUDA the model is built on its device (the engine would move it there
        # whole): no host-side initialisation of every weight (nn.Linear's own and then HF's, with
        # one host thread drawing each normal_) and no host-to-device copy. ZeRO-3 partitions the
        # weights as they are constructed (self._init_context).
        on_device = self.device.type == "cuda" and cfg.parallel.zero_stage != 3
        with torch.device(self.device) if on_device else contextlib.nullcontext():
            self.model = build_model(cfg.model, cfg.attention, dtype=dtype, init_context=self._init_context,
                                     deterministic=cfg.train.deterministic)
        if self.sp is not None:
            from msa_train.models import _head_dims
            from msa_train.parallel.sequence import attach, head_layout

            num_heads, num_kv_heads, _ = _head_dims(self.model.config)
            head_layout(num_heads, num_kv_heads, self.sp.size)  # raises, naming the numbers, for a bad degree
            attach(self.model, self.sp)
        if cfg.model.nsa_init == "distill" and not cfg.eval.only:
            self._distill_nsa()
        if cfg.model.lora.enabled:  # after the distillation, which fits NSA's parameters of the base model
            from msa_train.models.lora import apply_lora

            self.n_trainable, total = apply_lora(self.model, cfg.model.lora, dtype)
            if self.dist.is_main:
                lc = cfg.model.lora
                log.info("LoRA r=%d alpha=%g on %s (NSA's parameters: %s): %s of %s parameters train", lc.r, lc.alpha,
                         ",".join(lc.target_modules), lc.nsa, format_count(self.n_trainable), format_count(total))
        if cfg.model.nsa_phi == "mean":  # after LoRA, which sets which of NSA's parameters train
            from msa_train.models import freeze_mean_phi

            frozen = freeze_mean_phi(self.model)
            if cfg.model.lora.enabled and cfg.model.lora.nsa != "freeze":
                self.n_trainable -= frozen
            if self.dist.is_main:
                log.info("nsa_phi=mean: NSA's compression is mean pooling, %s of phi's parameters frozen at 0",
                         format_count(frozen))
        if len(self.tokenizer) > self.model.config.vocab_size:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is "
                             f"{self.model.config.vocab_size}: set model.hf_config.vocab_size >= {len(self.tokenizer)}")

    def _distill_nsa(self) -> None:
        """model.nsa_init=distill (msa_train/models/distill.py): NSA fitted to the dense attention on
        training sequences drawn by their own seed, before the engine exists; skipped on a resume,
        whose checkpoint holds the trained parameters. The losses go to <run>/nsa_distill.json."""
        from msa_train.models.distill import distill_nsa

        cfg = self.cfg
        if CheckpointManager(self.run_dir / "checkpoints", self.dist.rank, 0).resolve(cfg.train.resume) is not None:
            return
        steps = cfg.model.nsa_distill_steps
        picks = np.random.default_rng([cfg.data.seed, 2]).permutation(len(self.dataset))[:steps].tolist()
        batches = []
        for i in picks:
            m = self._make_batch(self.dataset[i])
            batches.append({k: self._to_device(v) if torch.is_tensor(v) else v for k, v in m.items()})
        report = distill_nsa(self.model, batches, steps, cfg.model.nsa_distill_lr)
        if self.dist.is_main:
            (self.run_dir / "nsa_distill.json").write_text(json.dumps(report, indent=2))
            log.info("nsa_init=distill: %d steps in %.1f s, attention error %.4f -> %.4f", steps, report["time_s"],
                     report["losses"][0], report["losses"][-1])

    def _build_parallelize(self) -> None:
        from msa_train.models.causal_lm import CausalLMWithLoss
        from msa_train.parallel import parallelize

        cfg = self.cfg
        # the fused kernels by default on CUDA (a 256K step of 4 Llama-3-8B layers 13% faster,
        # docs/trainer.md); on a CPU Triton would only interpret them
        fused = cfg.parallel.fused_ops
        self.fused_ops = self.device.type == "cuda" if fused is None else fused
        parallelize(self.model, activation_checkpointing=cfg.parallel.activation_checkpointing,
                    zero_stage=cfg.parallel.zero_stage, offload_activations=cfg.parallel.offload_activations,
                    tile_tokens=cfg.parallel.tile_tokens, fused_ops=self.fused_ops)
        self.module = CausalLMWithLoss(self.model, cfg.train.loss_chunk_tokens, cfg.train.loss_impl)

    def _build_optimizer(self) -> None:
        from msa_train.parallel import build_engine

        p = self.cfg.parallel
        if p.offload_optimizer and p.optimizer == "torch" and self.device.type == "cuda" and self.dist.is_main:
            log.warning("parallel.offload_optimizer=true with parallel.optimizer=torch: torch's AdamW steps the "
                        "host-held state slowly (for 2B parameters on 16 cores a step took about 3 s longer than "
                        "with DeepSpeed's cpu_adam, whose own step took 0.83 s: "
                        "benchmarks/results/phases/breakdown.md); "
                        "parallel.optimizer=deepspeed selects cpu_adam (JIT-built on first use, needs a compiler)")
        self.engine, self.optimizer, self.lr_scheduler = build_engine(self.module, self.ds_config)
        # DeepSpeed's WarmupCosineLR starts at iteration -1, i.e. lr = 0 for the first step; start
        # it at iteration 0 so every step trains (the engine steps it after each optimizer step).
        if self.lr_scheduler.last_batch_iteration < 0:
            self.lr_scheduler.step(0)

    def _build_checkpoint(self) -> None:
        cfg = self.cfg
        self.step = 0
        self.tokens_seen = 0
        # KTO's reference point z0: the mean policy/reference log-ratio of the previous step's examples
        # (0 before the first), in the checkpoint for an exact resume (see _pair_step)
        self._kto_z0 = torch.zeros((), device=self.device)
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", self.dist.rank, cfg.train.keep_checkpoints,
                                      local_rank=self.dist.local_rank, group=self._control,
                                      trainable_only=cfg.model.lora.enabled)
        self._restored_for_nonfinite: Optional[Path] = None  # train.on_nonfinite=skip's last restore
        path = self.ckpt.resolve(cfg.train.resume)
        self.resumed_from = None
        if path is not None:
            # the settings first: a differently configured run is refused by name, before DeepSpeed
            # tries to read a checkpoint of another layout
            saved_config = self.ckpt.read_trainer_state(path).get("run_config", {})
            if cfg.eval.only:  # the weights alone
                check_eval_config(saved_config, self._run_config(), path)
                self.step = self.ckpt.load(self.engine, path, weights_only=True)[0]["step"]
                self.resumed_from = str(path)
                return
            check_resume_config(saved_config, self._run_config(), path)
            trainer_state, rank_state = self.ckpt.load(self.engine, path)
            self._restore_counters(trainer_state)
            self.sampler.load_state_dict(rank_state["sampler"])
            self.lr_scheduler.step(self.lr_scheduler.last_batch_iteration)  # re-apply the restored rate
            self._sampler_iter = iter(self.sampler)
            self.resumed_from = str(path)
            if self.dist.is_main:
                log.info("resumed from step %d (%s), %d tokens seen", self.step, path, self.tokens_seen)
            saved_steps = trainer_state.get("train_steps")  # the length of the saved run's LR schedule
            if saved_steps is not None and saved_steps != cfg.train.steps and self.dist.is_main:
                log.warning("train.steps %d differs from the resumed run's %d: the learning-rate schedule "
                            "is rebuilt for %d steps, so from step %d on the rate follows the new schedule "
                            "(resume with train.steps=%d to continue the old one exactly)",
                            cfg.train.steps, saved_steps, cfg.train.steps, self.step + 1, saved_steps)
        if cfg.eval.only:
            return  # evaluates the model as built and writes no checkpoint
        self.ckpt.check_no_newer(self.step, path)
        if path is not None and self.step >= cfg.train.steps and self.dist.is_main:
            log.warning("the resumed checkpoint is at step %d, train.steps=%d: nothing to train (raise train.steps "
                        "to continue)", self.step, cfg.train.steps)

    def _restore_counters(self, trainer_state: Dict[str, Any]) -> None:
        """The trainer's own state of a loaded checkpoint (the engine's, the RNG and the sampler's come apart)."""
        self.step, self.tokens_seen = trainer_state["step"], trainer_state["tokens_seen"]
        self._kto_z0.fill_(trainer_state.get("kto_z0", 0.0))

    def _build_logger(self) -> None:
        cfg = self.cfg
        cfg_dict = dataclasses.asdict(cfg)
        self.peak_tflops = peak_tflops(self.device, cfg.train.peak_tflops)
        self._phases = PhaseTimer(self.device, cfg.train.phase_times)
        self._profiled_since_log = False  # train.profile_step ran since the last record
        if cfg.eval.only:  # leaves the run directory's config and metrics alone: eval.json only
            self.logger = None
            return
        if self.dist.is_main:
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(cfg_dict)))
            (self.run_dir / "config.json").write_text(json.dumps(cfg_dict, indent=2, default=str))
            (self.run_dir / "deepspeed_config.json").write_text(json.dumps(self.ds_config, indent=2))
        self.logger = MetricsLogger(self.run_dir, cfg.logger, cfg.train.steps, self.step, self.dist.is_main,
                                    cfg.train.progress, cfg_dict)
        hf = self.model.config
        self._num_layers = hf.num_hidden_layers
        self._attn_dim = hf.num_attention_heads * (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)

    # ------------------------------------------------------------------ data
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device without a host sync: a copy from pageable memory would wait for the
        stream, so stage through pinned memory and copy asynchronously."""
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _next_batch(self) -> Dict[str, Any]:
        return self._batch_of(next(self._sampler_iter))  # the sampler is infinite: epochs reshuffle

    def _batch_of(self, index: int, dataset=None) -> Dict[str, Any]:
        """Micro-batch of item ``index`` of ``dataset`` (the training data by default) on the host."""
        item = (self.dataset if dataset is None else dataset)[index]
        if self.grpo:  # a prompt and its answer: the rollouts are made in the step
            return {**item, "index": index}
        if not self.pairs:
            return self._make_batch(item)
        # segment 0 is prompt + chosen, 1 prompt + rejected, 2 the padding (packing.py)
        cu = item["cu_seqlens"]
        seg = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long()).clamp_max(2)
        # the responses' label tokens (SimPO and ORPO normalise by them), of the whole pair before any SP split
        labelled = next_token_targets(item["labels"], cu) != -100
        tokens = torch.stack([(labelled & (seg == s)).sum() for s in (0, 1)]).float()
        extra = {"desirable": torch.tensor(item["desirable"])} if "desirable" in item else {}  # unpaired KTO
        return {**self._make_batch(item, seg, 3), "index": index, "response_tokens": tokens, **extra}

    def _make_batch(self, item: Dict[str, Any], segments: Optional[torch.Tensor] = None,
                    num_segments: int = 0) -> Dict[str, Any]:
        """A packed item as the engine's micro-batch, on the host: validated once here so the model runs
        with trusted inputs. ``segments`` (int64 [T]) makes the loss come back per segment."""
        from flash_msa.utils.validation import check_cu_seqlens

        input_ids, cu = item["input_ids"], item["cu_seqlens"]
        check_cu_seqlens(cu, 1, input_ids.shape[0], torch.device("cpu"))
        lengths = (cu[1:] - cu[:-1]).double()
        batch = {"input_ids": input_ids[None], "position_ids": item["position_ids"][None],
                 "targets": next_token_targets(item["labels"], cu)[None]}
        if segments is not None:
            batch.update(segments=segments[None], num_segments=num_segments)
        if self.sp is not None:  # this rank's tokens; cu_seqlens keeps describing the whole sequence
            batch = {k: self.sp.shard(v, 1) if torch.is_tensor(v) else v for k, v in batch.items()}
        return {
            **batch,
            "cu_seqlens": cu,
            "max_seqlen": int(item["max_seqlen"]),
            # mean causal context per token, for the MFU's attention FLOPs (host math, no sync)
            "mean_context": float((lengths * (lengths + 1) / 2).sum() / input_ids.shape[0]),
            "num_tokens": int(item["num_tokens"]),  # document tokens of the whole sequence (padding left out)
        }

    # micro-batch entries that stay on the host: for the step's bookkeeping, not the model
    _HOST_ONLY = ("mean_context", "num_tokens", "index", "response_tokens", "desirable", "advantages")

    def _model_inputs(self, m: Dict[str, Any]) -> Dict[str, Any]:
        """Micro-batch m's inputs of CausalLMWithLoss, on the device."""
        return {k: (self._to_device(v) if torch.is_tensor(v) else v) for k, v in m.items() if k not in self._HOST_ONLY}

    def _forward(self, m: Dict[str, Any], **kwargs) -> torch.Tensor:
        """The engine's forward on micro-batch m (its host-only entries left out): the summed token
        loss, or with DPO's segments the loss per segment."""
        return self.engine(**self._model_inputs(m), **kwargs)

    def _pair_logps(self, m: Dict[str, Any]) -> torch.Tensor:
        """Log-probabilities [2] of a pair's chosen and rejected sequences (segments 0 and 1 of micro-batch
        m). Under sequence parallelism each rank holds a shard of the pair's tokens, so its per-segment
        sums are added over the SP group by an all-reduce that autograd differentiates (its backward
        all-reduces the gradient): every rank of the group computes the same DPO loss, and the gradient
        of its shard comes out P times that of the loss, which DeepSpeed's average over all W ranks
        turns into the mean over the W/P data-parallel ranks' pairs."""
        logps = -self._forward(m)[:2]
        if self.sp is None:
            return logps
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(logps, group=self.sp.group)

    # ------------------------------------------------------------------ evaluation
    def _eval_shard(self, n: int) -> List[tuple]:
        """This rank's share of n evaluation items, as (item, counts): every data-parallel rank runs
        the same number of forwards (ZeRO-3 gathers parameters collectively), the ranks short of
        items repeat item 0 without counting it; the ranks of a sequence-parallel group share items."""
        dp, r = self.layout.dp_size, self.layout.dp_rank
        return [(i, True) if i < n else (0, False) for i in range(r, -(-n // dp) * dp, dp)]

    def evaluate(self) -> Dict[str, Any]:
        """Evaluates the model as it is now on every rank (a collective): the held-out data (the LM loss,
        by position too; with DPO the DPO loss and reward accuracy) and the pass-key probes. Returns the
        record (host floats) that is logged to metrics.jsonl; see msa_train/evaluation.py."""
        from flash_msa import trusted_inputs

        t0 = time.perf_counter()
        record: Dict[str, Any] = {"step": self.step}
        was_training = self.module.training
        self.module.eval()
        with torch.no_grad(), trusted_inputs():
            if self.eval_dataset is not None:
                record.update(self._eval_pairs() if self.pairs else self._eval_grpo() if self.grpo else self._eval_lm())
            if self.passkey_probes:
                record.update(self._eval_passkey())
            if self.retrieval_probes:
                record.update(self._eval_retrieval())
        self.module.train(was_training)
        record["eval_time_s"] = time.perf_counter() - t0
        return record

    def _eval_count(self) -> int:
        n = len(self.eval_dataset)
        return min(n, self.cfg.eval.max_sequences) if self.cfg.eval.max_sequences else n

    def _eval_lm(self) -> Dict[str, Any]:
        from msa_train.evaluation import lm_metrics, position_buckets, position_edges

        edges = position_edges(self.cfg.eval_seq_len, self.cfg.eval.position_buckets)
        nb = len(edges) - 1
        sums = torch.zeros(2, nb, device=self.device)  # loss, argmax-correct tokens per position bucket
        counts = torch.zeros(nb, dtype=torch.float64)   # label tokens per bucket, counted on the host
        for index, counted in self._eval_shard(self._eval_count()):
            item = self.eval_dataset[index]
            m = self._make_batch(item, position_buckets(item["position_ids"], edges), nb)
            out = self._forward(m, with_correct=True)
            if counted:
                sums += out
                valid = m["targets"] != IGNORE_INDEX
                counts += torch.bincount(m["segments"][valid], minlength=nb).double()
        counts = self._to_device(counts)  # float64: exact token counts past 2^24
        for t in (sums, counts):
            dist.all_reduce(t)
        return lm_metrics(sums, counts, edges)

    def _eval_passkey(self) -> Dict[str, Any]:
        from msa_train.evaluation import passkey_metrics

        probes = self.passkey_probes
        per_probe = torch.zeros(len(probes), 2, device=self.device)  # answer loss, argmax-correct answer tokens
        for index, counted in self._eval_shard(len(probes)):
            item = probes[index]
            out = self._forward(self._make_batch(item, torch.zeros(item["input_ids"].shape[0], dtype=torch.int64), 1),
                                with_correct=True)
            if counted:  # with sequence parallelism each rank adds its shard's part: summed below
                per_probe[index] += out[:, 0]
        dist.all_reduce(per_probe)
        return passkey_metrics(per_probe, [p["answer_tokens"] for p in probes])

    def _eval_retrieval(self) -> Dict[str, Any]:
        """The eval.retrieval grid: probes packed into sequences as long as the longest probe (one
        document each), scored teacher-forced like the pass key; with eval.retrieval_generate, some
        probes decoded greedily with generate() too (KV cache), and the two exact matches compared.
        Each probe's first answer token is scored as a segment of its own as well: teacher-forced,
        the answer's later tokens can be copied on from the needle once the earlier ones are given
        (an induction head), while the first must be found from the question's key alone."""
        from msa_train.evaluation import retrieval_metrics
        from msa_train.data.tokenizer import pad_token_id
        from msa_train.quality.tasks import pack_probes

        probes = self.retrieval_probes
        longest = max(len(p["input_ids"]) for p in probes)
        pack_len = -(-longest // self.cfg.parallel.sp_degree) * self.cfg.parallel.sp_degree
        order = sorted(range(len(probes)), key=lambda i: -len(probes[i]["input_ids"]))  # longest first: fuller packs
        packs = pack_probes([probes[i] for i in order], pack_len, pad_token_id(self.tokenizer))
        # answer loss, argmax-correct answer tokens, the first answer token's loss, whether it is argmax-correct
        per_probe = torch.zeros(len(probes), 4, device=self.device)
        for index, counted in self._eval_shard(len(packs)):
            pack = packs[index]
            n = len(pack["probe_ids"])  # segments 0..n-1 the probes, n the padding, n+1+j probe j's first answer token
            segments = pack["segments"].clone()
            segments[pack["answer_at"] - 1] = torch.arange(n + 1, 2 * n + 1)  # its prediction: at the token before
            out = self._forward(self._make_batch(pack, segments, 2 * n + 1), with_correct=True)
            if counted:
                rows = self._to_device(torch.tensor([order[j] for j in pack["probe_ids"]]))
                first = out[:, n + 1:]
                per_probe.index_add_(0, rows, torch.cat([out[:, :n] + first, first]).t())
        dist.all_reduce(per_probe)
        record = retrieval_metrics(probes, per_probe)
        if self.cfg.eval.retrieval_generate:
            record.update(self._retrieval_generate(per_probe))
        return record

    def _retrieval_generate(self, per_probe: torch.Tensor) -> Dict[str, Any]:
        """Greedy generate() of the answer of ``eval.retrieval_generate`` probes spread over the grid,
        through the backends' KV-cache path: how often its exact match equals the teacher-forced one."""
        probes, n = self.retrieval_probes, self.cfg.eval.retrieval_generate
        picks = sorted({round(i * (len(probes) - 1) / max(1, n - 1)) for i in range(min(n, len(probes)))})
        agree = hits = 0
        for i in picks:
            p = probes[i]
            k = p["answer_tokens"]
            prompt = self._to_device(p["input_ids"][None, :-k])
            out = self.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=k,
                                      min_new_tokens=k, do_sample=False, pad_token_id=self.tokenizer.pad_token_id
                                      if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id)
            generated = bool(torch.equal(out[0, -k:].cpu(), p["input_ids"][-k:]))
            forced = bool(per_probe[i, 1].item() == k)  # host syncs: a check run, not the grid
            hits += generated
            agree += generated == forced
        return {"eval_retrieval_generate_probes": len(picks), "eval_retrieval_generate_accuracy": hits / len(picks),
                "eval_retrieval_generate_agreement": agree / len(picks)}

    def _pair_loss(self, logps: torch.Tensor, tokens: torch.Tensor, ref: Optional[torch.Tensor],
                   desirable: Optional[torch.Tensor] = None):
        """The pair objective's (loss, margin); ``desirable`` the labels of unpaired KTO examples.
        KTO's reference point is the trainer's current estimate (:meth:`_pair_step`), in training and
        in evaluation alike."""
        from msa_train.preference import pair_loss

        t = self.cfg.train
        beta = {"dpo": t.dpo_beta, "kto": t.kto_beta}.get(t.objective, t.simpo_beta)
        return pair_loss(t.objective, logps, tokens, ref, beta=beta, simpo_gamma=t.simpo_gamma,
                         orpo_lambda=t.orpo_lambda, kto_z0=self._kto_z0 if t.objective == "kto" else None,
                         desirable=desirable, kto_weights=(t.kto_desirable_weight, t.kto_undesirable_weight))

    def _eval_pairs(self) -> Dict[str, Any]:
        """The preference objective on held-out pairs; DPO's against the reference log-probabilities
        taken at the run's start."""
        n = self._eval_count()
        shard = self._eval_shard(n)
        reference = self._reference.get("eval", {}) if self.with_reference else {}
        if self.with_reference:
            missing = torch.tensor(float(sum(counted and index not in reference for index, counted in shard)),
                                   device=self.device)
            dist.all_reduce(missing)  # every rank raises, or none
            if missing.item():
                raise ValueError(f"{self.cfg.train.objective.upper()} evaluation: {int(missing.item())} held-out "
                                 "pairs have no reference log-probabilities: the reference is taken when a run "
                                 "starts, for the evaluation data, eval.max_sequences and number of processes it "
                                 "started with")
        logps = torch.zeros(n, 2, device=self.device)
        ref = torch.zeros(n, 2)
        tokens = torch.zeros(n, 2)
        desirable = torch.zeros(n)  # unpaired KTO's labels (1: desirable)
        first_of_group = self.sp is None or self.sp.rank == 0  # an SP group's ranks hold the same sums
        for index, counted in shard:
            m = self._batch_of(index, self.eval_dataset)
            out = self._pair_logps(m)
            if counted and first_of_group:
                logps[index] = out
                tokens[index] = m["response_tokens"]
                desirable[index] = float(m.get("desirable", False))
                if self.with_reference:
                    ref[index] = torch.tensor(reference[index])
        ref, tokens = (self._to_device(ref) if self.with_reference else None), self._to_device(tokens)
        desirable = self._to_device(desirable)
        for t in (logps, tokens, desirable, *([ref] if self.with_reference else [])):
            dist.all_reduce(t)
        unpaired = self.cfg.data.format == "kto"
        loss, margin = self._pair_loss(logps, tokens, ref, desirable > 0.5 if unpaired else None)
        return {"eval_loss": loss.mean().item(), "eval_reward_accuracy": (margin > 0).float().mean().item(),
                "eval_reward_margin": margin.mean().item(), "eval_pairs": n}

    # ------------------------------------------------------------------ step
    def train_step(self) -> Dict[str, Any]:
        """One optimizer step. Returns device tensors and host floats; nothing here syncs the host."""
        gas, world = self.cfg.train.grad_accum, self.dist.world_size
        lr = self.lr_scheduler.get_last_lr()[0]  # the rate this step's update uses
        # 1. batch: all micro-batches of this step, on the host.
        micro = [self._next_batch() for _ in range(gas)]
        if self.pairs:
            return self._pair_step(micro, lr)
        if self.grpo:
            return self._grpo_step(micro, lr)
        # Token-weighted loss: divide by the label tokens of the whole global batch. Counted on the
        # host, summed across ranks on the device (a collective, not a host sync).
        n_local = sum(int((m["targets"] != IGNORE_INDEX).sum()) for m in micro)
        n_global = self._to_device(torch.tensor(float(n_local)))
        dist.all_reduce(n_global)

        def loss_of(m):
            micro_loss_sum = self._forward(m)  # 2. forward
            # DeepSpeed averages gradients over ranks and divides by grad_accum; undo both so the
            # gradient is that of (sum of token losses) / (global label tokens).
            return micro_loss_sum * (world * gas) / n_global.clamp_min(1.0), micro_loss_sum.detach()

        loss_sum, grad_norm = self._micro_steps(micro, loss_of)
        return self._step_out(micro, lr, loss_sum, n_global, grad_norm)

    def _micro_steps(self, micro: List[Dict[str, Any]], loss_of) -> tuple:
        """Forward, backward and DeepSpeed's step for every micro-batch; ``loss_of(m)`` returns (the loss
        to differentiate, detached statistics to sum). Returns (the summed statistics, the pre-clip
        gradient norm on ZeRO-0, else None)."""
        from flash_msa import trusted_inputs

        sums, grad_norm = None, None
        phase = self._phases.phase
        for i, m in enumerate(micro):
            # cu_seqlens was validated on the host: skip flash_msa's per-layer value checks (a host
            # sync each) in the forward and in the backward, whose activation checkpointing re-runs it.
            with trusted_inputs():
                with phase("forward"):
                    loss, stats = loss_of(m)
                # 3. backward, 4. step (DeepSpeed steps the optimizer and LR at the accumulation boundary).
                with phase("backward"):
                    self.engine.backward(loss)
            if i == len(micro) - 1 and self.cfg.parallel.zero_stage == 0:
                # ZeRO 1-3 report the pre-clip norm themselves; stage 0 does not, so take it here,
                # after the boundary all-reduce and before the clipping step (a device tensor).
                grad_norm = _grad_norm(self.module)
            with phase("step"):
                sync_gpu_share(self.engine)  # a partial offload's GPU share follows the LR schedule
                self.engine.step()
            sums = stats if sums is None else sums + stats
        return sums, grad_norm

    def _step_out(self, micro, lr, loss_sum, n_global, grad_norm, tokens: Optional[int] = None,
                  **extra) -> Dict[str, Any]:
        """Counts the step and its tokens (by default train.seq_len per sequence); the step's record
        before the host-side log."""
        self.step += 1
        if tokens is None:
            tokens = len(micro) * self.layout.dp_size * self.cfg.train.seq_len  # an SP group's ranks share sequences
        self.tokens_seen += tokens
        return {"loss_sum": loss_sum, "n_global": n_global, "tokens": tokens, "lr": lr, "grad_norm": grad_norm,
                "document_tokens": sum(m["num_tokens"] for m in micro),  # this rank's sequences
                "mean_context": sum(m["mean_context"] for m in micro) / len(micro), **extra}

    # ------------------------------------------------------------------ DPO
    def _build_reference(self) -> None:
        """DPO's reference: the log-probabilities of the starting model, for every pair this rank will
        train on (the next ``train.steps * grad_accum`` items of its sampler) and its share of the
        held-out pairs (under the key "eval"), computed once before the first step and kept in
        ``<run>/dpo_reference/rank_NNNNN.pt`` for resuming. So no second model is held in memory; the
        cost is one forward pass per pair."""
        from flash_msa import trusted_inputs

        cfg = self.cfg.train
        path = self.run_dir / "dpo_reference" / f"rank_{self.dist.rank:05d}.pt"
        if self.resumed_from is not None:
            if not path.is_file():
                raise ValueError(f"train.resume: {path} is missing: a DPO run resumes with the reference "
                                 "log-probabilities computed at its start")
            self._reference = safe_load(path)
            return
        if self.cfg.eval.only:
            name = self.cfg.train.objective.upper()
            raise ValueError(f"eval.only=true with {name} evaluates a checkpoint of a {name} run (train.resume=auto "
                             "or a checkpoint path): its reference log-probabilities are those of the run's start")
        sampler = type(self.sampler)(self.sampler.num_items, seed=self.sampler.seed, rank=self.sampler.rank,
                                     world_size=self.sampler.world_size)
        sampler.load_state_dict(self.sampler.state_dict())
        it = iter(sampler)
        order = [next(it) for _ in range(cfg.steps * cfg.grad_accum)]  # as many forwards on every rank (ZeRO-3 gathers)
        reference: Dict[int, List[float]] = {}
        self.module.eval()
        with torch.no_grad(), trusted_inputs():
            for index in order:  # host floats: a sync per pair, setup only
                reference[index] = self._pair_logps(self._batch_of(index)).tolist()
            if self.eval_dataset is not None:
                reference["eval"] = {}
                for index, counted in self._eval_shard(self._eval_count()):
                    logps = self._pair_logps(self._batch_of(index, self.eval_dataset)).tolist()
                    if counted:
                        reference["eval"][index] = logps
        self.module.train()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(reference, tmp)
        os.replace(tmp, path)
        self._reference = reference

    def _pair_step(self, micro: List[Dict[str, Any]], lr: float) -> Dict[str, Any]:
        """One optimizer step of the preference objective (msa_train/preference.py): its loss per pair,
        the mean over the global batch's pairs (DeepSpeed averages over ranks and micro steps).

        KTO's reference point z0 is the mean log-ratio r = pi - ref of the *previous* step's examples
        over all ranks (one all-reduce per step), clamped at 0 and 0 before the first step. Taken
        from the examples being scored, with one pair or one example per micro-batch, it would
        contain each example's own r: for an unpaired example on one rank z0 would be r itself and
        its reward beta (r - z0) always 0."""
        log_ratios = []

        def loss_of(m):
            ref = None
            if self.with_reference:
                if m["index"] not in self._reference:
                    name = self.cfg.train.objective.upper()
                    raise ValueError(f"{name}: no reference log-probabilities for pair {m['index']}: this run's "
                                     f"reference covers the pairs of its first train.steps={self.cfg.train.steps} "
                                     f"steps as set when it started; extend a {name} run by starting a new one from "
                                     "its hf/ export")
                ref = self._to_device(torch.tensor(self._reference[m["index"]]))
            logps = self._pair_logps(m)  # chosen, rejected: the engine returns per-segment losses
            desirable = self._to_device(m["desirable"]) if "desirable" in m else None
            loss, margin = self._pair_loss(logps, self._to_device(m["response_tokens"]), ref, desirable)
            if self.cfg.train.objective == "kto":  # an unpaired example's second column is its padding
                log_ratios.append((logps - ref).detach()[: 1 if desirable is not None else 2])
            return loss, torch.stack([loss, (margin > 0).float(), margin]).detach()  # loss, reward accuracy, margin

        sums, grad_norm = self._micro_steps(micro, loss_of)
        if log_ratios:  # the next step's z0: every rank holds as many examples, so the mean of means is the mean
            z0 = torch.cat(log_ratios).float().mean()
            dist.all_reduce(z0)
            self._kto_z0 = (z0 / self.dist.world_size).clamp(min=0)
        n_pairs = torch.tensor(float(len(micro) * self.dist.world_size), device=self.device)
        return self._step_out(micro, lr, sums[0], n_pairs, grad_norm,
                              pair_sums={"reward_accuracy": sums[1], "reward_margin": sums[2]})

    # ------------------------------------------------------------------ GRPO
    def _build_grpo(self) -> None:
        """GRPO's reference policy (msa_train/grpo.py): the starting values of the trainable parameters,
        kept in ``<run>/grpo_reference.pt`` for resuming (written once, by rank 0, atomically). None
        with ``train.grpo_beta=0`` or ``eval.only``, which need no reference."""
        from msa_train.grpo import StartingWeights

        self._grpo_reference = None
        if self.cfg.train.grpo_beta == 0 or self.cfg.eval.only:
            return
        path = self.run_dir / "grpo_reference.pt"
        state = None
        if self.resumed_from is not None:
            if not path.is_file():
                raise ValueError(f"train.resume: {path} is missing: a GRPO run resumes with the starting weights of "
                                 "its reference policy, written when it started")
            state = safe_load(path, map_location="cpu")
        self._grpo_reference = StartingWeights(self.model, state)
        if state is None and self.dist.is_main:
            tmp = path.with_suffix(".tmp")
            torch.save({n: t.cpu() for n, t in self._grpo_reference.state.items()}, tmp)
            os.replace(tmp, path)
        if self.dist.is_main:
            log.info("GRPO reference policy: the starting values of %s trainable parameters", format_count(
                self._grpo_reference.numel()))

    def _pad_and_eos(self) -> tuple:
        """generate()'s padding token and end tokens (none where the tokenizer has no EOS)."""
        from msa_train.data.tokenizer import pad_token_id

        eos = self.tokenizer.eos_token_id
        return pad_token_id(self.tokenizer), [eos] if eos is not None else []

    def _rollouts(self, micro: List[Dict[str, Any]]) -> tuple:
        """Each prompt's group of sampled completions, rewarded and packed (msa_train/grpo.py): the
        micro-batches to train on, the step's rewards [prompts, G] on the host, the seconds spent in
        generate() and the positions it sampled (padding after an EOS included).

        The sampling draws from a generator seeded by (train.seed, rank, step): the ranks sample
        independently (each is seeded alike at the start), and a resumed run samples what the
        uninterrupted one did whatever else drew random numbers."""
        from msa_train.grpo import REWARDS, group_advantages, pack_group, sample_group

        t, tok = self.cfg.train, self.tokenizer
        reward = REWARDS[t.grpo_reward]
        pad, eos = self._pad_and_eos()
        batches, rewards, generate_s, sampled = [], [], 0.0, 0
        seed = int(np.random.SeedSequence([t.seed, self.dist.rank, self.step]).generate_state(1)[0])
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        self.module.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            for m in micro:
                t0 = time.perf_counter()
                completions = sample_group(self.model, self._to_device(m["prompt_ids"]), t.grpo_group,
                                           t.grpo_max_new_tokens, t.grpo_temperature, pad, eos)
                generate_s += time.perf_counter() - t0  # generate() returns on the host: no sync needed
                sampled += t.grpo_group * max(len(c) for c in completions)
                r = torch.tensor([reward(text, m["answer"]) for text in
                                  tok.batch_decode(completions, skip_special_tokens=True)])
                packed = pack_group(m["prompt_ids"], completions, group_advantages(r))
                T = packed["input_ids"].shape[0]
                batch = self._make_batch(packed, torch.arange(T), T)  # one segment per token: per-token losses
                batch["advantages"] = packed["advantages"]
                batches.append(batch)
                rewards.append(r)
        self.module.train()
        return batches, torch.stack(rewards), generate_s, sampled

    def _grpo_step(self, micro: List[Dict[str, Any]], lr: float) -> Dict[str, Any]:
        """One optimizer step of GRPO (msa_train/grpo.py): rollouts of this rank's prompts, then the
        token-level loss over every completion token of the global batch. Generation is host-driven
        (generate() decides every token on the host), so unlike the other objectives this step syncs."""
        from msa_train.grpo import grpo_token_loss

        t, gas, world = self.cfg.train, self.cfg.train.grad_accum, self.dist.world_size
        batches, rewards, generate_s, sampled = self._rollouts(micro)
        # this rank's completion tokens (the loss's tokens) and rollout tokens, then the global batch's
        local = torch.tensor([float(sum(int((b["targets"] != IGNORE_INDEX).sum()) for b in batches)),
                              float(sum(b["num_tokens"] for b in batches))], dtype=torch.float64)
        counts = self._to_device(local.clone())
        dist.all_reduce(counts)
        n_global = counts[0].float()

        def loss_of(m):
            ref = None
            if self._grpo_reference is not None:  # the starting policy's -log pi: its weights swapped in
                with torch.no_grad(), self._grpo_reference.swapped_in():
                    ref = self.module(**self._model_inputs(m))
            nll = self._forward(m)  # [T]: a segment per token
            mask = self._to_device(m["targets"][0] != IGNORE_INDEX)
            loss, kl = grpo_token_loss(nll, self._to_device(m["advantages"]), mask, ref, t.grpo_beta)
            return loss * (world * gas) / n_global.clamp_min(1.0), torch.stack([loss.detach(), kl])

        sums, grad_norm = self._micro_steps(batches, loss_of)
        on = self._to_device
        completions = float(rewards.numel())
        means = {"reward": (on(rewards.sum()), on(torch.tensor(completions))),
                 "reward_std": (on(rewards.std(dim=1).sum()), on(torch.tensor(float(len(micro))))),
                 "kl": (sums[1], on(local[0])),
                 "completion_tokens": (on(local[0]), on(torch.tensor(completions)))}
        return self._step_out(batches, lr, sums[0], n_global, grad_norm, tokens=int(counts[1].item()), means=means,
                              host={"generate_s": generate_s, "generate_tokens_per_s": sampled / max(generate_s, 1e-9)})

    def _eval_grpo(self) -> Dict[str, Any]:
        """The mean reward of greedy completions of the held-out prompts (one per prompt)."""
        from msa_train.grpo import REWARDS, greedy_completion

        t, tok = self.cfg.train, self.tokenizer
        pad, eos = self._pad_and_eos()
        n = self._eval_count()
        total = torch.zeros(2, dtype=torch.float64)
        for index, counted in self._eval_shard(n):
            item = self.eval_dataset[index]
            ids = greedy_completion(self.model, self._to_device(item["prompt_ids"]), t.grpo_max_new_tokens, pad, eos)
            if counted:
                total += torch.tensor([REWARDS[t.grpo_reward](tok.decode(ids, skip_special_tokens=True),
                                                              item["answer"]), 1.0], dtype=torch.float64)
        total = self._to_device(total)
        dist.all_reduce(total)
        return {"eval_reward": (total[0] / total[1].clamp_min(1)).item(), "eval_prompts": n}

    def _profiled_step(self) -> Dict[str, Any]:
        """``train.profile_step``: the step under torch.profiler; rank 0 writes the device time by
        kind and by kernel to profile_step<N>.{json,md} in the run directory (msa_train/metrics.py)."""
        from torch.profiler import ProfilerActivity, profile

        from msa_train.metrics import profile_summary, write_profile

        cuda = self.device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
            out = self.train_step()
            sync()
        wall = time.perf_counter() - t0
        if self.dist.is_main:
            path = write_profile(self.run_dir, profile_summary(prof, self.step, wall))
            log.info("profile of step %d: %s", self.step, path)
        self._profiled_since_log = True
        return out

    def _log(self, out: Dict[str, Any], elapsed: float, tokens: int, document_tokens: int) -> Dict[str, Any]:
        """The record of the steps since the last log: ``tokens`` positions of the whole run (what the
        hardware computed, padding included, and what MFU counts), ``document_tokens`` of this rank's
        sequences (summed over the data-parallel ranks here)."""
        loss_sum = out["loss_sum"].clone()
        dist.all_reduce(loss_sum)
        # the ranks of a sequence-parallel group hold the same sequences: count each once
        documents = torch.tensor(document_tokens * self.layout.dp_size / self.dist.world_size,
                                 dtype=torch.float64, device=self.device)
        dist.all_reduce(documents)
        # host syncs, logging only
        n_global = out["n_global"].item()
        # a step whose global batch has no label token computed no loss: null, not 0 (docs/trainer.md)
        loss = (loss_sum / n_global).item() if n_global else None
        if loss is None and self.dist.is_main:
            log.warning("step %d: no token of its global batch has a label (all masked): its loss is logged as "
                        "null and left out of first_loss / final_loss; the optimizer still stepped (docs/trainer.md)",
                        self.step)
        extra = {}
        for name, value in out.get("pair_sums", {}).items():  # DPO: means over the global batch's pairs
            value = value.clone()
            dist.all_reduce(value)
            extra[name] = (value / out["n_global"]).item()
        for name, (total, count) in out.get("means", {}).items():  # GRPO: sums and counts over the ranks
            both = torch.stack([total.double(), count.double()])
            dist.all_reduce(both)
            extra[name] = (both[0] / both[1].clamp_min(1)).item()
        extra.update(out.get("host", {}))  # rank 0's host-side numbers (GRPO's generation time)
        grad_norm = out["grad_norm"] if out["grad_norm"] is not None else self.engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else None
        tokens_per_s = tokens / max(elapsed, 1e-9)
        document_tokens_per_s = documents.item() / max(elapsed, 1e-9)
        mfu = None
        if self.peak_tflops:
            flops = model_flops_per_token(self.n_matmul, self._num_layers, self._attn_dim,
                                          out["mean_context"])
            mfu = flops * tokens_per_s / (self.peak_tflops * 1e12 * self.dist.world_size)
        record = {"step": self.step, "loss": loss, "lr": out["lr"],
                  "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                  "document_tokens_per_s": document_tokens_per_s, "mfu": mfu,
                  "peak_memory_gb": peak_memory_gb(self.device), "tokens_seen": self.tokens_seen,
                  "elapsed_s": time.perf_counter() - self._t0, **extra, **self._phases.take()}
        if not self.pairs:  # the tokens the loss averages (DPO's denominator is its pairs)
            record["label_tokens"] = int(n_global)
        if self._profiled_since_log:  # its time includes the profiler's: left out of means
            record["profiled"] = True
            self._profiled_since_log = False
        self.logger.log(record)
        return record

    # ------------------------------------------------------------------ loop
    def _run_config(self) -> Dict[str, Any]:
        """The settings an exact resume depends on (the model, its attention, the data and its order)."""
        cfg = dataclasses.asdict(self.cfg)
        train = {k: cfg["train"][k] for k in RESUME_TRAIN_KEYS}
        return json.loads(json.dumps({"model": cfg["model"], "attention": cfg["attention"], "data": cfg["data"],
                                      "data_files": self.data_fingerprint,
                                      "train": train, "world_size": self.dist.world_size,
                                      "sp_degree": self.cfg.parallel.sp_degree,
                                      "zero_stage": self.cfg.parallel.zero_stage}, default=str))

    def _nonfinite_now(self, out: Dict[str, Any]) -> List[str]:
        """Which of the last step's loss and gradient norm, and the weights, are not finite on any rank.
        Collective, with one host sync: run before a save or an export, a sync point anyway."""
        grad_norm = out["grad_norm"] if out["grad_norm"] is not None else self.engine.get_global_grad_norm()
        weights = [getattr(p, "ds_tensor", p) for p in self.module.parameters()]  # ZeRO-3: this rank's partition
        finite = [torch.isfinite(out["loss_sum"]).all(),
                  torch.isfinite(torch.as_tensor(grad_norm if grad_norm is not None else 0.0)).all(),
                  torch.stack([torch.isfinite(w).all() for w in weights if w.numel()] or [torch.tensor(True)]).all()]
        bad = torch.stack([~f.to(self.device) for f in finite]).int()
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return [name for name, b in zip(("loss", "grad_norm", "weights"), bad.tolist()) if b]

    def _on_nonfinite(self, bad: List[str], records: List[Dict[str, Any]]) -> None:
        """``train.on_nonfinite``: ``stop`` raises :class:`NonFiniteError`; ``skip`` restores the newest
        checkpoint (all of them are finite: none is written otherwise) and goes on with the data after
        the offending step, i.e. the batches since that checkpoint are skipped. A second non-finite
        value before a newer checkpoint is written stops the run as ``stop`` does."""
        step, latest = self.step, find_latest(self.ckpt.root)
        where = f"the last checkpoint, {latest}, is finite" if latest else "no checkpoint was written yet"
        if self.cfg.train.on_nonfinite == "stop" or latest is None or latest == self._restored_for_nonfinite:
            again = " again after restoring it" if latest is not None and latest == self._restored_for_nonfinite else ""
            if self.logger is not None:
                self.logger.close()
            raise NonFiniteError(
                f"train.on_nonfinite={self.cfg.train.on_nonfinite}: at step {step} {', '.join(bad)} not finite{again}; "
                f"no checkpoint or hf/ export is written from a non-finite state, {where} (continue from it with "
                "train.resume=auto and, e.g., a lower train.lr or a longer train.warmup_steps)")
        self.ckpt.verify(latest)
        trainer_state, _ = self.ckpt.load(self.engine, latest)  # the RNG too; the sampler goes on from here
        self._restore_counters(trainer_state)
        self.lr_scheduler.step(self.lr_scheduler.last_batch_iteration)  # re-apply the restored rate
        self._restored_for_nonfinite = latest
        records[:] = [r for r in records if r["step"] <= self.step]
        if self.logger is not None:
            self.logger.rewind(self.step, {"step": self.step, "nonfinite_skip": {
                "at_step": step, "values": bad, "restored": latest.name,
                "skipped_steps": [self.step + 1, step]}})
        if self.dist.is_main:
            log.warning("train.on_nonfinite=skip: at step %d %s not finite; restored %s and skipped the batches of "
                        "steps %d-%d", step, ", ".join(bad), latest, self.step + 1, step)

    def _save(self) -> None:
        trainer_state = {"step": self.step, "tokens_seen": self.tokens_seen, "recipe": self.cfg.recipe_name,
                         "kto_z0": float(self._kto_z0),
                         "train_steps": self.cfg.train.steps,
                         "world_size": self.dist.world_size, "run_config": self._run_config()}
        try:
            self.ckpt.save(self.engine, self.step, trainer_state, {"sampler": self.sampler.state_dict()})
        except (OSError, RuntimeError) as e:
            raise self._save_failed(e) from e

    def _save_failed(self, error: Exception) -> Exception:
        """The error of a checkpoint write that failed: a full disk said as such (torch reports it as
        "basic_ios::clear: iostream error" or "file write failed"), the partial write removed, and
        which checkpoint resume=auto would continue from."""
        from msa_train.checkpoint import find_latest

        full = getattr(error, "errno", None) == errno.ENOSPC or any(
            s in str(error) for s in ("No space left", "basic_ios::clear", "iostream error", "file write failed"))
        if not full and not isinstance(error, OSError):
            return error  # a RuntimeError of another kind: not a write failure
        tmp = self.ckpt.root / f".tmp_step_{self.step:06d}"
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        latest = find_latest(self.ckpt.root)
        intact = f"the last complete checkpoint, {latest}, is intact (train.resume=auto continues from it)" \
            if latest else "no complete checkpoint was written before this one"
        what = f"the disk holding {self.ckpt.root} is full" if full else f"writing to {self.ckpt.root} failed"
        return OSError(errno.ENOSPC if full else getattr(error, "errno", None) or errno.EIO,
                       f"checkpoint of step {self.step}: {what} ({str(error).strip().splitlines()[0]}); the partial "
                       f"write {tmp.name} was removed and {intact}. Free space (or set train.keep_checkpoints lower, "
                       "train.output_dir elsewhere) and resume")

    def train(self, stop_after: Optional[int] = None) -> Dict[str, Any]:
        """Run to ``train.steps`` (or stop after step ``stop_after``, checkpointing there). A SIGTERM
        or SIGUSR1 stops every rank at the end of the current step, with a checkpoint there
        (msa_train/preemption.py); the summary then has ``stopped_by_signal``."""
        from msa_train.preemption import StopSignals

        if self.cfg.eval.only:
            raise ValueError("eval.only=true builds the trainer to evaluate: call evaluate_only() (or run())")
        cfg = self.cfg.train
        self.module.train()
        self._t0 = time.perf_counter()
        records: List[Dict[str, Any]] = []
        t_last, tokens_since, documents_since = time.perf_counter(), 0, 0
        last = cfg.steps if stop_after is None else min(stop_after, cfg.steps)
        stop = StopSignals(self.dist.rank, self.dist.world_size, self._control)
        stopped_by = None
        ev = self.cfg.eval
        has_eval = self.eval_dataset is not None or bool(self.passkey_probes) or bool(self.retrieval_probes)
        self.last_eval = None
        try:
            if has_eval and ev.at_start and self.step == 0:
                self._log_eval(self.evaluate())
                t_last = time.perf_counter()
            while self.step < last:
                out = self._profiled_step() if cfg.profile_step == self.step + 1 else self.train_step()
                tokens_since += out["tokens"]
                documents_since += out["document_tokens"]
                bad: List[str] = []
                # 5. log: the only host syncs of the loop, every log_every steps.
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    now = time.perf_counter()
                    records.append(self._log(out, now - t_last, tokens_since, documents_since))
                    t_last, tokens_since, documents_since = now, 0, 0
                    bad = nonfinite_values(records[-1])  # host floats already
                else:
                    self.logger.advance(self.step)
                save_due = (cfg.save_every and self.step % cfg.save_every == 0) or \
                    (self.step == last and (cfg.save_final or stop_after is not None))
                if not bad and (save_due or (self.step == cfg.steps and cfg.save_hf)):
                    bad = self._nonfinite_now(out)  # before anything is written from this state
                if bad:
                    self._on_nonfinite(bad, records)  # raises, or restores a checkpoint
                    t_last, tokens_since, documents_since = time.perf_counter(), 0, 0
                    continue
                if has_eval and ((ev.every and self.step % ev.every == 0) or (ev.at_end and self.step == cfg.steps)):
                    self._log_eval(self.evaluate())
                    t_last = time.perf_counter()  # the evaluation's time is not training time
                if save_due:
                    self._save()
                if stop.requested(self.step):  # host-side agreement over gloo, no GPU sync
                    if not save_due:
                        bad = self._nonfinite_now(out)
                        if bad:  # skip: restored, and the stop takes effect after the next step
                            self._on_nonfinite(bad, records)
                            continue
                        self._save()
                    stopped_by = signal.Signals(stop.received).name if stop.received else "a signal on another rank"
                    if self.dist.is_main:
                        log.warning("stop signal: stopped after step %d with a checkpoint there; continue with "
                                    "train.resume=auto", self.step)
                    break
        finally:
            stop.restore()
        summary = self._summary(records)
        summary["eval"] = self.last_eval
        summary["stopped_by_signal"] = None if stopped_by is None else str(stopped_by)
        if self.step == cfg.steps and cfg.save_hf:
            self._save_hf()
        self.logger.close(summary if self.step == cfg.steps else None)
        return summary

    def _log_eval(self, record: Dict[str, Any]) -> None:
        self.last_eval = record
        self.logger.log_eval(record)

    def evaluate_only(self) -> Dict[str, Any]:
        """``eval.only=true``: evaluate the model as built (``model.path``, or the checkpoint that
        ``train.resume`` names) once, and write ``<train.output_dir>/eval.json``; nothing else in the
        run directory is touched."""
        from msa_train.metrics import format_eval

        record = self.evaluate()
        result = {**record, "checkpoint": self.resumed_from, "model_path": self.cfg.model.path,
                  "attention": self.cfg.attention.name, "seq_len": self.cfg.train.seq_len,
                  "world_size": self.dist.world_size}
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            path = self.run_dir / "eval.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(result, indent=2))
            os.replace(tmp, path)
            log.info("%s; written to %s", format_eval(record), path)
            if "retrieval" in record:
                from msa_train.quality.plots import write_heatmap

                write_heatmap({self.cfg.attention.name: record["retrieval"]}, self.run_dir / "retrieval.png",
                              title=f"retrieval, {self.cfg.model.path or self.resumed_from or 'model'}")
        return result

    def run(self) -> Dict[str, Any]:
        """What the CLI runs: training, or with ``eval.only`` one evaluation."""
        return self.evaluate_only() if self.cfg.eval.only else self.train()

    def _save_hf(self) -> None:
        """Write ``<run>/hf`` (config.json with msa_attention + safetensors), reloadable by load_pretrained."""
        from msa_train.models import save_pretrained

        if self.cfg.parallel.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()  # collective
            state = {k[len("lm."):]: v for k, v in (state or {}).items()}
        else:
            state = None
        if self.cfg.model.lora.enabled and self.dist.is_main:  # the adapters merged in: a plain HF export
            from msa_train.models.lora import merged_state_dict

            state = merged_state_dict(self.model.state_dict() if state is None else state, self.cfg.model.lora)
        if self.dist.is_main:
            # written beside, then swapped in (as the checkpoints): a kill mid-write leaves the
            # previous hf/ (or none), never a half-written one
            tmp = self.run_dir / ".tmp_hf"
            shutil.rmtree(tmp, ignore_errors=True)
            save_pretrained(self.model, str(tmp), state_dict=state)
            self.tokenizer.save_pretrained(str(tmp))
            from msa_train.evaluation import TRAINING_DOCUMENTS

            if (self.run_dir / TRAINING_DOCUMENTS).is_file():  # the hold-out record travels with the export
                shutil.copy(self.run_dir / TRAINING_DOCUMENTS, tmp / TRAINING_DOCUMENTS)
            swap_in(tmp, self.run_dir / "hf")
        if dist.is_initialized():
            dist.barrier()

    def _summary(self, records: List[Dict[str, Any]]) -> Dict[str, Any]:
        losses = [r["loss"] for r in records if r["loss"] is not None]  # null: a step with no label token
        timed = [r for r in records[1:] if not r.get("profiled")] or records  # the first: warmup
        tps = [r["tokens_per_s"] for r in timed]
        dps = [r["document_tokens_per_s"] for r in timed]
        return {
            "recipe": self.cfg.recipe_name, "attention": self.cfg.attention.name, "steps": self.step,
            "world_size": self.dist.world_size, "device": str(self.device), "n_params": self.n_params,
            "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
            "steps_without_labels": sum(r["loss"] is None for r in records),  # of the logged steps
            "mean_tokens_per_s": sum(tps) / len(tps) if tps else None,
            "mean_document_tokens_per_s": sum(dps) / len(dps) if dps else None,
            "peak_memory_gb": peak_memory_gb(self.device), "wall_time_s": time.perf_counter() - self._t0,
            "tokens_seen": self.tokens_seen, "resumed_from": self.resumed_from, "startup_s": self.startup_s,
            "fused_ops": self.fused_ops,  # parallel.fused_ops as it ran (null: on for CUDA)
            **self._reward_summary(records),
        }

    @staticmethod
    def _reward_summary(records: List[Dict[str, Any]]) -> Dict[str, Any]:
        """GRPO: the mean rollout reward of the first and of the last quarter of the logged steps."""
        rewards = [r["reward"] for r in records if r.get("reward") is not None]
        if not rewards:
            return {}
        k = max(1, len(rewards) // 4)
        return {"first_reward": sum(rewards[:k]) / k, "final_reward": sum(rewards[-k:]) / k}
