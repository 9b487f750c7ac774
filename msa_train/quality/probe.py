"""The retrieval probe: does a training mix teach retrieval at all, and at which lengths? A CPU
experiment that decides the quality study's design before GPU time is spent on it.

A 1.3M-parameter Llama (4 layers, hidden 128, 4 query / 2 KV heads of 32, RoPE) is trained on short
synthetic retrieval documents (``tasks.training_document``: one question each, the haystack cut
from the corpus's training split), optionally with copy documents (a span, more text, the span
again; the repeat trained: what an induction head predicts) and optionally after plain
language-model pretraining on longer windows of real text; every ``--eval-every`` steps it scores
single-needle probes over held-out text at each of ``--eval-lengths``. Its findings are in
benchmarks/results/probes/results.md (``retrieval_probe``, ``copy_documents``, ``length_transfer``,
``nsa_probe``).

This is a plain PyTorch loop, not the trainer: thousands of steps of a model this small fit a CPU
in minutes only without the trainer's per-step machinery (packing, DeepSpeed, checkpoints), which
a probe of learnability does not need. Each evaluation prints one JSON line.

``--attention fmsa`` patches the same model with NSA (``--nsa-sizes``, by default a window and
local blocks shorter than the document), so that the probe asks whether sparse attention learns
to copy and retrieve as dense does, where a needle is reachable only through compression and
block selection (``scripts/gpu_session.sh probe`` runs dense and NSA side by side on a GPU); an NSA
probe's evaluations also say, layer by layer, how often the selected blocks hold the needle.

    python -m msa_train.quality corpus --out /tmp/qc --max-tokens 3000000 --vocab 2048
    python -m msa_train.quality probe --corpus /tmp/qc --copy-fraction 0.5 --lengths 256,512 --eval-lengths 256,512,1024
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch


def _ints(text: str, name: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 64:
        raise SystemExit(f"{name} {text}: expected comma-separated token counts >= 64")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", required=True, help="a corpus directory of `python -m msa_train.quality corpus`")
    p.add_argument("--lengths", default="256", help="training document lengths in tokens, one drawn per step "
                                                    "(a step's documents share it)")
    p.add_argument("--spread", type=float, default=0.0,
                   help="each step's length uniform within this fraction either side of the one drawn "
                        "(tasks.draw_length, study C's --retrieval-phase-spread; default 0: exactly)")
    p.add_argument("--eval-lengths", default=None, help="probe lengths scored at every evaluation (default: --lengths)")
    p.add_argument("--batch", type=int, default=8, help="documents per step")
    p.add_argument("--steps", type=int, default=3000, help="retrieval-phase steps (after any pretraining)")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--probes", type=int, default=64, help="single-needle probes per evaluation length, depths uniform")
    p.add_argument("--loss", choices=("all", "answers"), default="answers",
                   help="answers: only the answers are targets (default); all: every token, as pretraining")
    p.add_argument("--tasks", default="passkey,single_needle,multi_key", help="tasks of the training documents")
    p.add_argument("--queries", type=int, default=1, help="questions per training document (the others' needles "
                                                          "are each one's distractors)")
    p.add_argument("--copy-fraction", type=float, default=0.0, help="fraction of each step's documents that are copy "
                                                                    "documents (S, more text, S; loss on the second S)")
    p.add_argument("--copy-kind", choices=("text", "random"), default="text",
                   help="text: S cut from the training text; random: S uniform random token ids")
    p.add_argument("--pretrain-steps", type=int, default=0, help="language-model steps on real text first (every "
                                                                 "token a target), same optimizer and schedule")
    p.add_argument("--pretrain-length", type=int, default=2048, help="tokens per pretraining window")
    p.add_argument("--pretrain-batch", type=int, default=2, help="windows per pretraining step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                   help="after the warm-up: constant, or cosine to a tenth over all steps (the trainer's schedule)")
    p.add_argument("--rope-theta", type=float, default=10000.0, help="RoPE base (the quality study's model: 500000)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--attention", choices=("full", "fmsa", "nsa"), default="full",
                   help="full: HF's SDPA attention (the probe as it was); fmsa / nsa: the model patched with NSA "
                        "(msa_train.models.patch_model) at --nsa-sizes")
    p.add_argument("--nsa-sizes", default="16,8,16,5,32",
                   help="NSA's l,d,l',n,w (compression block and stride, selection block, selected blocks with the "
                        "initial and two local ones, window) for --attention fmsa|nsa; the default leaves the "
                        "window and the local blocks short of a 256-token document, so a needle is reached "
                        "only through the compressed and the selected branches")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the NSA kernels need it: on a CPU NSA runs its "
                                                   "PyTorch reference, 24x slower a step than the dense probe)")
    p.add_argument("--stop-at", type=float, default=2.0,
                   help="stop once the first eval length's exact match is >= this at two evaluations in a row "
                        "(default: never)")


class _Probe:
    """The probe's model, data streams and scorer (``run`` drives them)."""

    def __init__(self, args: argparse.Namespace):
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        from msa_train.quality.tasks import Haystack, make_probe

        self.args = args
        self.train_lengths = _ints(args.lengths, "--lengths")
        self.eval_lengths = _ints(args.eval_lengths, "--eval-lengths") if args.eval_lengths else self.train_lengths
        if not 0 <= args.spread < 1:
            raise SystemExit(f"--spread {args.spread}: expected a fraction in [0, 1)")
        if not 0 <= args.copy_fraction < 1:
            raise SystemExit(f"--copy-fraction {args.copy_fraction}: expected a fraction in [0, 1)")
        corpus = Path(args.corpus)
        if not (corpus / "tokenizer" / "tokenizer.json").is_file():
            raise SystemExit(f"--corpus {corpus}: expected a corpus directory of `python -m msa_train.quality corpus`")
        tok = PreTrainedTokenizerFast(tokenizer_file=str(corpus / "tokenizer" / "tokenizer.json"))
        self.tok = tok

        def docs(name: str, n: int) -> List[List[int]]:
            lines = (corpus / name).read_text().splitlines()[:n]
            return [tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"] for line in lines]

        self.train_hay = Haystack(docs("train.jsonl", 400), tok)
        self.eval_hay = Haystack(docs("heldout.jsonl", 100), tok)
        # the same probes at every evaluation, each length's from the same depth and content streams
        try:
            self.probes = {n: [make_probe("single_needle", tok, self.eval_hay, n, random.Random(f"depth{i}").random(),
                                          random.Random(f"probe{i}")) for i in range(args.probes)]
                           for n in self.eval_lengths}
        except ValueError as e:
            raise SystemExit(f"--eval-lengths {args.eval_lengths or args.lengths}: {e}") from None
        longest = max([round(n * (1 + args.spread)) for n in self.train_lengths] + self.eval_lengths
                      + [args.pretrain_length if args.pretrain_steps else 0])
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          max_position_embeddings=max(4096, longest), rope_theta=args.rope_theta,
                          tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(args.seed)
        self.model = LlamaForCausalLM(cfg)
        if args.attention != "full":
            from msa_train.config import AttentionConfig
            from msa_train.models import patch_model

            try:
                l, d, l_slc, n, w = (int(x) for x in args.nsa_sizes.split(","))
                attention = AttentionConfig(name=args.attention, cmp_block=l, cmp_stride=d, slc_block=l_slc,
                                            slc_topk=n, window=w)
            except ValueError as e:
                raise SystemExit(f"--nsa-sizes {args.nsa_sizes}: expected l,d,l',n,w that NSA accepts ({e})") from None
            torch.manual_seed(args.seed + 1)  # NSA's own parameters, the dense ones as in the dense probe
            patch_model(self.model, attention)
        self.device = torch.device(args.device)
        self.model.to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
        total, warm = args.pretrain_steps + args.steps, args.warmup

        def factor(step: int) -> float:
            if step < warm or args.schedule == "constant":
                return min(1.0, (step + 1) / max(1, warm))
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, factor)
        # separate streams, so that adding one kind of data leaves the others' draws as they were
        self.rng = random.Random("train" if args.seed == 0 else f"train{args.seed}")
        self.copy_rng = random.Random(f"copy{args.seed}")
        self.len_rng = random.Random(f"lengths{args.seed}")
        self.tasks = args.tasks.split(",")
        self.n_copy = round(args.copy_fraction * args.batch)

    def copy_document(self, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """n tokens: S (n/4..n/2 tokens), filler of real text, S again; the second S is the target
        from its second token (nothing before it predicts its first)."""
        from msa_train.quality.tasks import copy_document

        vocab = len(self.tok) if self.args.copy_kind == "random" else 0
        span, filler = copy_document(self.copy_rng, self.train_hay, n, vocab)
        return torch.tensor(span + filler + span), torch.tensor([-100] * (n - len(span) + 1) + span[1:])

    def batch(self) -> Tuple[torch.Tensor, torch.Tensor]:
        from msa_train.quality.tasks import draw_length, training_document

        n = draw_length(self.len_rng, self.train_lengths, self.args.spread)  # one length a step: the batch is stacked
        xs, ys = [], []
        for _ in range(self.n_copy):
            x, y = self.copy_document(n)
            xs.append(x), ys.append(y)
        for _ in range(self.args.batch - self.n_copy):
            for _ in range(100):  # a draw whose questions and needles leave no room for haystack is drawn again
                try:
                    d = training_document(self.tasks, self.tok, self.train_hay, n, self.args.queries, self.rng)
                    break
                except ValueError as e:
                    error = e
            else:
                raise SystemExit(f"--lengths {self.args.lengths}: 100 training documents of {n} tokens in a row "
                                 f"did not fit ({error}); give longer lengths or fewer --queries")
            xs.append(d["input_ids"])
            ys.append(d["input_ids"] if self.args.loss == "all" else d["labels"])
        return torch.stack(xs), torch.stack(ys)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.model(input_ids=x.to(self.device), labels=y.to(self.device)).loss
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        return loss.detach()  # read at the evaluations only: no host sync a step on a GPU

    @torch.no_grad()
    def score(self, n: int) -> Tuple[float, float]:
        """(exact match, fraction of answer tokens right) of the length-n probes, teacher-forced."""
        self.model.eval()
        probes, chunk = self.probes[n], max(1, 4096 // n)  # long probes a few at a time, to bound memory
        exact = right = total = 0
        for i in range(0, len(probes), chunk):
            x = torch.stack([q["input_ids"] for q in probes[i:i + chunk]]).to(self.device)
            y = torch.stack([q["labels"] for q in probes[i:i + chunk]])[:, 1:].to(self.device)
            pred, mask = self.model(input_ids=x).logits[:, :-1].argmax(-1), y != -100
            exact += ((pred == y) | ~mask).all(1).sum().item()
            right += ((pred == y) & mask).sum().item()
            total += mask.sum().item()
        self.model.train()
        return exact / len(probes), right / total

    @torch.no_grad()
    def needle_selected(self, n: int) -> List[float]:
        """NSA only: for each layer, the fraction of (answer position, KV head) whose selected blocks
        include one that holds part of the needle, over the length-n probes: whether block selection
        finds what the answer needs (with n selected blocks of l' among T/l' the chance is about
        (n - 3) / (T/l' - 3) beyond the initial and local blocks). The blocks are chosen again by the
        PyTorch reference from each layer's q and k, which the kernels' selection is tested to equal."""
        from flash_msa import reference

        layers = [layer.self_attn.nsa for layer in self.model.model.layers]
        seen: List[torch.Tensor] = []

        def capture(nsa, args, kwargs):  # NativeSparseAttention(hidden, q, k, v, ..., scale=)
            q, k, v = (t.float() for t in args[1:4])
            weights = (p.float() for p in (nsa.compress_k.weight, nsa.compress_k.pos, nsa.compress_v.weight,
                                           nsa.compress_v.pos))
            gates = q.new_ones(*q.shape[:3], 3)  # the output is not used, only the blocks
            _, idx = reference.nsa_attention(q, k, v, gates, *weights, **nsa.sizes, scale=kwargs.get("scale"),
                                             return_indices=True, k_cmp_proj=nsa.compress_k.proj.float(),
                                             v_cmp_proj=nsa.compress_v.proj.float())
            seen.append(idx)  # [B, T, HK, n]

        hooks = [nsa.register_forward_pre_hook(capture, with_kwargs=True) for nsa in layers]
        self.model.eval()
        probes, chunk = self.probes[n], max(1, 4096 // n)
        hits, count = torch.zeros(len(layers), device=self.device), 0  # read once, at the end
        try:
            for i in range(0, len(probes), chunk):
                group = probes[i:i + chunk]
                seen.clear()
                self.model(input_ids=torch.stack([q["input_ids"] for q in group]).to(self.device))
                for b, q in enumerate(group):
                    rows = (q["labels"][1:] != -100).nonzero().flatten().to(self.device)  # positions predicting answers
                    lo, hi = q["needle_at"][0], q["needle_at"][0] + q["needle_len"][0]
                    for j, idx in enumerate(seen):
                        start = idx[b, rows].long() * layers[j].sizes["slc_block"]  # [answer, HK, n]; -1: none
                        over = (idx[b, rows] >= 0) & (start < hi) & (start + layers[j].sizes["slc_block"] > lo)
                        hits[j] += over.any(-1).sum()
                    count += rows.numel() * seen[0].shape[2]
        finally:
            for h in hooks:
                h.remove()
            self.model.train()
        return [round(h / count, 3) for h in hits.tolist()]


def run(args: argparse.Namespace, emit=print) -> List[Dict]:
    """Trains and evaluates as ``args`` say; each evaluation is a dict, passed to ``emit`` as a JSON
    line and returned."""
    torch.set_num_threads(args.threads)
    probe = _Probe(args)
    start, lines, hits = time.time(), [], 0
    common = {"seed": args.seed, "attention": args.attention,
              **({"nsa_sizes": args.nsa_sizes} if args.attention != "full" else {}),
              "lengths": probe.train_lengths, "spread": args.spread,
              "copy_fraction": args.copy_fraction, "copy_kind": args.copy_kind, "loss_targets": args.loss,
              "batch": args.batch, "lr": args.lr, "schedule": args.schedule, "rope_theta": args.rope_theta,
              "pretrain_steps": args.pretrain_steps}
    pre_rng = random.Random(f"pretrain{args.seed}")
    for pstep in range(1, args.pretrain_steps + 1):
        x = torch.tensor([probe.train_hay.window(pre_rng, args.pretrain_length, anywhere=True)
                          for _ in range(args.pretrain_batch)])
        loss = probe.step(x, x)
        if pstep == args.pretrain_steps:
            emit(json.dumps({"phase": "pretrain", "pretrain_step": pstep, "pretrain_length": args.pretrain_length,
                             "train_loss": round(float(loss), 3), "s": round(time.time() - start)}))
    for step in range(1, args.steps + 1):
        loss = probe.step(*probe.batch())
        if step % args.eval_every and step != args.steps:
            continue
        line = {**common, "step": step, "train_loss": round(float(loss), 3)}
        for n in probe.eval_lengths:
            exact, tokens = probe.score(n)
            line[f"exact_{n}"], line[f"tokens_{n}"] = exact, round(tokens, 3)
            if args.attention != "full":
                line[f"needle_selected_{n}"] = probe.needle_selected(n)
        line["s"] = round(time.time() - start)
        lines.append(line)
        emit(json.dumps(line))
        hits = hits + 1 if line[f"exact_{probe.eval_lengths[0]}"] >= args.stop_at else 0
        if hits >= 2:
            break
    return lines

