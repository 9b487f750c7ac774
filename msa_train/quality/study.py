"""The quality study (issue 44, docs/quality.md): dense vs Flash-MSA from scratch, dense -> NSA conversion,
and (on request) a retrieval phase that trains both from-scratch models on retrieval documents alone.

Each study is a list of trainer runs (jobs) under ``<work>/runs/<job>``, run in order by the
existing :class:`~msa_train.trainer.Trainer` with ``train.resume=auto``. An invocation is bounded
by ``budget_s`` seconds: a job is started only when enough of the budget is left, and a timer
sends the process SIGUSR1 when its training must stop, which the trainer's preemption path
(msa_train/preemption.py) turns into a checkpoint at the end of the current step. Running the
same command again continues where it stopped; a finished job is not run again. ``report``
reads the runs and writes ``summary.json`` and the plots.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from msa_train.quality.corpus import write_jsonl

log = logging.getLogger(__name__)

TASKS_ALL = ["passkey", "single_needle", "multi_key", "multi_value", "variable_tracking"]
RECIPE_STEPS = 1600  # recipes/quality_170m.yaml's train.steps (a test keeps the two equal)


@dataclass
class Plan:
    """Sizes of the study; ``gpu()`` is the H200 study, ``tiny()`` the CPU test of the whole pipeline."""
    recipe_overrides: List[str]
    mix_fraction: float = 0.4           # synthetic retrieval tokens, as a fraction of the corpus's training tokens
                                        # (0.4: 29% of the mixed data; 0.03, 0.1 and 0.3 left both models at 0%
                                        # retrieval in the first three runs, which trained every token of them)
    mix_tasks: List[str] = field(default_factory=lambda: list(TASKS_ALL))
    # the longest leaves room below train.seq_len (16384) for BOS/EOS and re-tokenising the text, so no
    # synthetic document is split from its questions by packing
    mix_lengths: List[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16000])
    mix_tokens_per_query: int = 192     # a synthetic document asks one question per this many tokens (0: one) ...
    mix_max_queries: int = 48           # ... and at most this many: 37K questions at the 0.4 mix (the third run:
                                        # 256, 32 and 0.3, 20K; the retrieval probe learnt from 28-40K answer-only
                                        # examples, not from 24K). A question's needles and text take 86 tokens
                                        # on average (150 at most) of the study's 16K BPE: 128 would not fit
    haystack_tokens: int = 2_000_000    # training text the synthetic documents take their haystacks from
    # what of a synthetic document trains: "all" its tokens, or "answers" only (the rest context;
    # tasks.training_records says why). Answers only (the fourth run) cost the language model (held-out
    # 4.86 against 4.19-4.29 with every token trained) and taught no more retrieval: 0% either way
    mix_targets: str = "all"
    seed_spread_retrieval: bool = False  # the second dense seed: held-out loss only
    # an NSA arm with phi plain mean pooling (model.nsa_phi=mean): NSA's gates are then its only
    # parameters beyond dense's, which separates phi's parameters from the sparse attention (held-out
    # loss only; run last, after the second dense seed)
    mean_phi_arm: bool = False
    # study C, the retrieval phase (0: not run): study A's dense and NSA models each trained on
    # synthetic retrieval documents alone, answers only, for these many steps, then evaluated: what
    # the CPU retrieval probe needed (thousands of answers-only steps), which the mix does not give
    retrieval_phase_steps: int = 0
    # short sequences, so that the phase's tokens buy many updates: in the CPU probe the number of
    # updates, not of examples, limited learning (batch 32: 0% exact match after 40K examples in
    # 1,250 steps; batch 8: 97% after 40K in 5,000). Short documents: the probe learnt on 256-token
    # documents and not on 512-token ones in 5,000 steps, and the fifth run's 512-4000 taught neither
    # model; 1K and 2K put most needles beyond NSA's 512-token window. One question a document: at
    # 512 tokens the probe with three a document (each the others' distractors) reached 20% of
    # answer tokens in 5,000 steps, with one 36%, though three train three times the answers a step.
    # A third of the documents 2K long all the same: at 256-512 tokens NSA's 512-token window holds
    # the whole document, so only the window branch would learn to retrieve and copy, while the
    # evaluation's needles (2K-32K) lie mostly beyond the window, where selection must find them.
    # 8K sequences, not 4K: two 2K documents (2,050 tokens with BOS/EOS) do not fit one 4K sequence, so
    # in the eighth run 30% of the 4K sequences were padding and 1,184 of its 4,000 steps trained fewer
    # than 20 tokens (one 2K retrieval document alone, its answer a few tokens); at 8K the packer puts
    # three 2K documents and the short ones together (simulated with plan_packing: 2% padding, 1% of
    # steps under 20 trained tokens, twice the trained tokens a step). On the H100 an NSA step of this
    # model is launch-bound below 16K: on study C's documents 0.136 s at 4K and 0.143 s at 8K (dense
    # 0.062 and 0.080 s; benchmarks/results/probes/results.md#quality_step_times)
    retrieval_phase_seq_len: int = 8192
    retrieval_phase_lengths: List[int] = field(default_factory=lambda: [256, 512, 2048])
    # each document's length is one of those, then uniform within this fraction of it either side
    # (tasks.draw_length): 224-288, 448-576 and 1,792-2,304 tokens. With three fixed lengths every answer
    # sits at one of three places, and on the CPU a model trained on one length retrieved only where
    # its answers had sat (probes/results.md#trainer_path_variants). The shortest, 224, still holds
    # multi-key's question and needles: at most 208 tokens of a 2,048-token BPE of the corpus (300
    # draws), fewer of the study's 16K one (a document that cannot hold them is refused when written)
    retrieval_phase_length_spread: float = 0.125
    # the tasks of study C's documents: the probe's three, whose questions repeat their needle's words
    # (the evaluation still asks all five)
    retrieval_phase_tasks: List[str] = field(default_factory=lambda: ["passkey", "single_needle", "multi_key"])
    # the fraction of study C's documents that are copy documents (tasks.copy_records): in the CPU
    # probe, half of every batch copies of real text brought the retrieval phase change to 1,750-2,250
    # steps (three seeds of three; none of three without, by 3,000); 0 gives retrieval documents
    # alone, as the fifth run's study C had
    retrieval_phase_copy_fraction: float = 0.5
    retrieval_phase_tokens_per_query: int = 0  # one question per this many tokens, at most mix_max_queries (0: one)
    # The probe's rate does not carry to the 169M model: in the eighth run's study C (a constant 2e-3,
    # 4,000 steps) the loss over copies and answers, weighted by their tokens, was 4.9-5.0 while the
    # warm-up's rate stayed below 4e-4, 5.6-5.8 from 4e-4 to 1e-3, 6.1-6.8 at 2e-3, and stayed at 6.2
    # dense and 5.9 NSA to the end (no copying; held-out loss 5.26 -> 6.74 dense); the sixth run's
    # cosine from 5e-4 lowered it from 4.50 to 3.66 in 1,500 steps, the seventh's from 1e-3 from 5.71
    # to 4.82 in 3,000. So a rate below that knee: 3e-4, about the sixth run's mean. (The CPU
    # probe, 1.3M parameters of width 128: retrieval at 1,750 steps at a constant 2e-3, 2,750 at 1e-3.)
    # The warm-up is longer than the probe's: the phase starts Adam afresh on a trained 169M model
    retrieval_phase_lr: float = 3e-4
    # wsd (the rate held, then the recipe's cosine to a tenth over the last retrieval_phase_decay of the
    # steps: train.lr_schedule=wsd) | constant | cosine (the recipe's). wsd: a constant rate learns sooner
    # than the cosine (the probe: 2,000 steps against 2,750), and a decay is the usual end of a held rate
    # (the trainer at the probe's size: 75% exact at 3,000 steps against 33% constant in one paired run,
    # but 8% in a second run with the decay, whose exact match swung as much:
    # probes/results.md#trainer_path_variants)
    retrieval_phase_schedule: str = "wsd"
    # The decay's share of the steps: half. In the ninth run (4,000 steps, the last fifth decayed) the
    # dense model's loss over copies and answers fell from 4.79 to 3.45 in 3,000 steps at the held 3e-4,
    # then by 1.6 nats, to 1.48, in the 800 steps of the decay, faster as the rate fell, and a third of
    # the answer tokens at 2K were then right: the drop came with the lower rate, so a longer decay
    # gives it more steps in a run that must be shorter (NSA's 4,000 steps did not fit the budget:
    # probes/results.md#ninth_run_study_c)
    retrieval_phase_decay: float = 0.5
    retrieval_phase_warmup: int = 100
    seq_len: int = 16384                # train.seq_len of study A's and study B's jobs
    conversion_steps: int = RECIPE_STEPS // 10  # study B: 10% of study A's tokens
    conversion_lr: float = 3e-4
    conversion_warmup: int = 2
    distill_steps: int = 50
    distill_lr: float = 1e-3
    min_piece_s: float = 120.0          # a job is started (or resumed) only with this much budget left
    eval_reserve_s: float = 90.0        # the final evaluation's time, kept out of the training budget

    def with_steps(self, steps: int) -> "Plan":
        """This plan with study A at ``steps`` optimizer steps and study B at a tenth of them."""
        if steps < 10:
            raise ValueError(f"--steps {steps}: expected at least 10 (study B runs a tenth of study A's steps)")
        return dataclasses.replace(self, recipe_overrides=[*self.recipe_overrides, f"train.steps={steps}"],
                                   conversion_steps=steps // 10)

    @staticmethod
    def gpu() -> "Plan":
        return Plan(["recipe=quality_170m", "data.num_proc=8"])  # tokenizing the mix on one core took 2 minutes

    @staticmethod
    def tiny(vocab_size: int) -> "Plan":
        sizes = ["attention.cmp_block=16", "attention.cmp_stride=8", "attention.slc_block=32", "attention.slc_topk=4",
                 "attention.window=64"]
        model = {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16}  # GQA group 4, as the study's
        return Plan(["recipe=quality_170m", "model.name=quality_tiny",
                     *(f"model.hf_config.{k}={v}" for k, v in model.items()), *sizes, "train.grad_accum=1",
                     "train.steps=3", "train.warmup_steps=1", "train.lr=3e-3", "train.loss_chunk_tokens=256",
                     "train.save_every=0", "train.device=cpu", "eval.max_sequences=4",
                     "eval.retrieval=[passkey,single_needle]", "eval.retrieval_lengths=[384,512]",
                     "eval.retrieval_depths=2", "eval.retrieval_probes=1", "eval.retrieval_generate=1"],
                    mix_fraction=0.05, mix_tasks=["passkey", "single_needle"], mix_lengths=[256], mix_tokens_per_query=0,
                    haystack_tokens=20_000, seq_len=256, retrieval_phase_seq_len=256, retrieval_phase_lengths=[256],
                    retrieval_phase_length_spread=0.05,
                    retrieval_phase_tasks=["passkey", "single_needle"], retrieval_phase_warmup=1,
                    conversion_steps=2, conversion_warmup=1, distill_steps=3,
                    min_piece_s=0.0, eval_reserve_s=0.0)


def _jobs_a(plan: Plan, work: Path) -> Dict[str, List[str]]:
    corpus = work / "corpus"
    common = [*plan.recipe_overrides, f"train.seq_len={plan.seq_len}", f"data.path={work / 'data' / 'train_mix.jsonl'}",
              f"data.eval_path={corpus / 'heldout.jsonl'}", f"data.tokenizer={corpus / 'tokenizer'}",
              f"data.cache_dir={work / 'cache'}", "train.resume=auto", "train.progress=false"]
    seed1 = [] if plan.seed_spread_retrieval else ["eval.retrieval=[]"]
    jobs = {"a_full": [*common, "attention=full", "train.seed=0"],
            "a_fmsa": [*common, "attention=fmsa", "train.seed=0"],
            "a_full_seed1": [*common, "attention=full", "train.seed=1", *seed1]}
    if plan.mean_phi_arm:
        jobs["a_fmsa_mean_phi"] = [*common, "attention=fmsa", "train.seed=0", "model.nsa_phi=mean", "eval.retrieval=[]"]
    return jobs


def _jobs_b(plan: Plan, work: Path) -> Dict[str, List[str]]:
    a = _jobs_a(plan, work)["a_full"]
    start = work / "runs" / "a_full" / "hf"
    common = [*a[:-2], f"model.path={start}", f"train.steps={plan.conversion_steps}", f"train.lr={plan.conversion_lr}",
              f"train.warmup_steps={plan.conversion_warmup}", "train.seed=0", "train.save_every=0",
              "data.seed=1"]  # another packing order: study A trained on the first sequences of seed 0
    return {"b_dense": [*common, "attention=full"],
            "b_nsa": [*common, "attention=fmsa"],
            "b_nsa_distill": [*common, "attention=fmsa", "model.nsa_init=distill",
                              f"model.nsa_distill_steps={plan.distill_steps}", f"model.nsa_distill_lr={plan.distill_lr}"]}


def _jobs_c(plan: Plan, work: Path) -> Dict[str, List[str]]:
    """Study C: each of study A's two models trained on the retrieval-phase documents alone, NSA's
    first: it is the open question (the ninth run's dense arm began to copy, its NSA arm was stopped
    by the budget) and the slower arm, so a budget that ends early cuts the dense one."""
    if not plan.retrieval_phase_steps:
        return {}
    a = _jobs_a(plan, work)
    out = {}
    for arm in ("fmsa", "full"):
        keep = [x for x in a[f"a_{arm}"] if not x.startswith(("data.path=", "train.seed=", "train.seq_len="))]
        out[f"c_{arm}"] = [*keep, f"train.seq_len={plan.retrieval_phase_seq_len}",
                           f"data.path={work / 'data' / 'retrieval_phase.jsonl'}",
                           f"model.path={work / 'runs' / f'a_{arm}' / 'hf'}", f"train.steps={plan.retrieval_phase_steps}",
                           f"train.lr={plan.retrieval_phase_lr}", f"train.warmup_steps={plan.retrieval_phase_warmup}",
                           *{"constant": ["train.min_lr_ratio=1.0"],
                             "wsd": ["train.lr_schedule=wsd", f"train.decay_fraction={plan.retrieval_phase_decay}"],
                             "cosine": []}[plan.retrieval_phase_schedule],
                           "train.seed=0", "train.save_every=0",
                           f"eval.seq_len={plan.seq_len}"]  # held-out loss packed as study A's, so the two compare
    return out


def _jobs_all(plan: Plan, work: Path) -> List[Dict[str, List[str]]]:
    """``all``'s jobs, most important first, in two stages (the second starts from the first's
    models): study A's dense and NSA arms; then study C when asked for (retrieval is what no run has
    shown yet; the fifth run's budget ended before the second seed, whose spread earlier runs
    measured), study B, the second dense seed and the mean-pooling NSA arm."""
    a = _jobs_a(plan, work)
    first = {k: a.pop(k) for k in ("a_full", "a_fmsa")}
    mean_phi = {k: a.pop(k) for k in ("a_fmsa_mean_phi",) if k in a}
    return [first, {**_jobs_c(plan, work), **_jobs_b(plan, work), **a, **mean_phi}]


def _tokenizer(work: Path):
    from transformers import PreTrainedTokenizerFast

    path = work / "corpus" / "tokenizer"
    if not path.is_dir():
        raise ValueError(f"--work {work}: no corpus there; run `python -m msa_train.quality corpus --out {work}/corpus` first")
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def _training_documents(work: Path) -> List[str]:
    return [json.loads(line)["text"] for line in (work / "corpus" / "train.jsonl").read_text(encoding="utf-8").splitlines()]


def _haystack(plan: Plan, tok, docs: Sequence[str]) -> List[List[int]]:
    """The token ids of the first training documents ``docs``, ``plan.haystack_tokens`` of them."""
    hay, total = [], 0
    for text in docs:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        hay.append(ids)
        total += len(ids)
        if total >= plan.haystack_tokens:
            break
    return hay


def prepare_mix(plan: Plan, work: Path) -> Path:
    """``<work>/data/train_mix.jsonl``: the corpus's training documents plus synthetic retrieval
    documents (``plan.mix_fraction`` of the training tokens), from the same task generators as the
    evaluation but a seed space of their own and a haystack of training text. Written once."""
    from msa_train.quality.tasks import Haystack, questions_per_document, training_records

    out = work / "data" / "train_mix.jsonl"
    if out.is_file():
        return out
    tok = _tokenizer(work)
    manifest = json.loads((work / "corpus" / "manifest.json").read_text())
    docs = _training_documents(work)
    hay = _haystack(plan, tok, docs)
    mean_len = sum(plan.mix_lengths) / len(plan.mix_lengths)
    count = max(1, round(plan.mix_fraction * manifest["tokens"]["train"] / mean_len))
    synthetic = training_records(plan.mix_tasks, tok, Haystack(hay, tok), plan.mix_lengths, count, seed="study",
                                 tokens_per_query=plan.mix_tokens_per_query, max_queries=plan.mix_max_queries,
                                 answers_only=plan.mix_targets == "answers")
    queries = [questions_per_document(n, plan.mix_tokens_per_query, plan.mix_max_queries) for n in plan.mix_lengths]
    write_jsonl(out, [{"text": text} for text in docs] + synthetic)
    (work / "data" / "mix.json").write_text(json.dumps({
        "corpus_documents": len(docs), "synthetic_documents": len(synthetic), "mix_fraction": plan.mix_fraction,
        "synthetic_targets": plan.mix_targets,
        "synthetic_tokens_approx": round(count * mean_len), "tasks": plan.mix_tasks, "lengths": plan.mix_lengths,
        "questions_per_document": dict(zip(map(str, plan.mix_lengths), queries)),
        "questions_approx": round(count * sum(queries) / len(queries)),
        "seed_space": "train-mix/study (evaluation probes: eval)"}, indent=2))
    return out


def prepare_retrieval_phase(plan: Plan, work: Path) -> Optional[Path]:
    """``<work>/data/retrieval_phase.jsonl`` for study C (None when it is not run): synthetic
    retrieval documents (answers trained) and copy documents (their repeat trained), enough for
    ``plan.retrieval_phase_steps`` sequences of ``plan.retrieval_phase_seq_len`` tokens, from a seed
    space of their own (``train-mix/retrieval-phase``) and the mix's haystack of training text;
    ``retrieval_phase.json`` beside it counts them. Written once."""
    from msa_train.quality.tasks import Haystack, copy_records, training_records

    if not plan.retrieval_phase_steps:
        return None
    out = work / "data" / "retrieval_phase.jsonl"
    lengths = list(plan.retrieval_phase_lengths)
    # the training settings too: both arms must train alike, and the file is what the summary reports
    spec = {"steps": plan.retrieval_phase_steps, "lengths": lengths,
            "length_spread": plan.retrieval_phase_length_spread,
            "tokens_per_question": plan.retrieval_phase_tokens_per_query, "tasks": list(plan.retrieval_phase_tasks),
            "copy_fraction": plan.retrieval_phase_copy_fraction, "lr": plan.retrieval_phase_lr,
            "schedule": plan.retrieval_phase_schedule, "warmup_steps": plan.retrieval_phase_warmup,
            **({"decay_fraction": plan.retrieval_phase_decay} if plan.retrieval_phase_schedule == "wsd" else {})}
    if out.is_file():
        written = json.loads((work / "data" / "retrieval_phase.json").read_text())
        differ = {k: v for k, v in spec.items() if written.get(k) != v}
        if differ:
            was = ", ".join(f"{k}={written.get(k)}" for k in differ)
            raise ValueError(f"study C with {', '.join(f'{k}={v}' for k, v in differ.items())}: {out} was written for "
                             f"{was}; give those, or delete it and runs/c_* to start study C again")
        return out
    tok = _tokenizer(work)
    count = math.ceil(plan.retrieval_phase_steps * plan.retrieval_phase_seq_len / (sum(lengths) / len(lengths)))
    haystack = Haystack(_haystack(plan, tok, _training_documents(work)), tok)
    copies = round(plan.retrieval_phase_copy_fraction * count)
    records = training_records(plan.retrieval_phase_tasks, tok, haystack, lengths, count - copies,
                               seed="retrieval-phase", tokens_per_query=plan.retrieval_phase_tokens_per_query,
                               max_queries=plan.mix_max_queries, spread=plan.retrieval_phase_length_spread)
    questions = sum(sum(x["train"] for x in r["segments"]) for r in records)
    records += copy_records(tok, haystack, lengths, copies, seed="retrieval-phase",
                            spread=plan.retrieval_phase_length_spread)
    random.Random("retrieval-phase/order").shuffle(records)  # copies and questions mixed through every step
    write_jsonl(out, records)
    (work / "data" / "retrieval_phase.json").write_text(json.dumps({
        **spec, "documents": count, "copy_documents": copies, "questions": questions,
        "seq_len": plan.retrieval_phase_seq_len,
        "targets": "answers of the questions, repeats of the copies",
        "seed_space": "train-mix/retrieval-phase (evaluation probes: eval)"}, indent=2))
    return out


def _state_path(work: Path) -> Path:
    return work / "state.json"


def _read_state(work: Path) -> Dict[str, Any]:
    p = _state_path(work)
    return json.loads(p.read_text()) if p.is_file() else {}


def _write_state(work: Path, state: Dict[str, Any]) -> None:
    p = _state_path(work)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, p)


def run_jobs(jobs: Dict[str, List[str]], work: Path, deadline: float, plan: Plan) -> bool:
    """Run (or continue) the jobs in order until the deadline (``time.time()``). Returns whether all are done."""
    from msa_train.cli import compose
    from msa_train.trainer import Trainer

    state = _read_state(work)
    for name, overrides in jobs.items():
        if state.get(name, {}).get("done"):
            continue
        left = deadline - time.time()
        if left < plan.min_piece_s:
            log.warning("budget: %.0f s left, %s needs at least %.0f: rerun the same command to continue", left, name,
                        plan.min_piece_s)
            return False
        cfg = compose([*overrides, f"train.output_dir={work / 'runs' / name}"])
        def ignore(*args):  # a late timer must not end the process
            pass

        previous = signal.signal(signal.SIGUSR1, ignore)
        try:
            trainer = Trainer(cfg)
            cancel = threading.Event()

            def stop_training():  # once train() has installed its stop handlers (msa_train/preemption.py)
                while not cancel.is_set() and signal.getsignal(signal.SIGUSR1) is ignore:
                    time.sleep(0.05)
                if not cancel.is_set():
                    os.kill(os.getpid(), signal.SIGUSR1)

            timer = threading.Timer(max(0.0, deadline - time.time() - plan.eval_reserve_s), stop_training)
            timer.daemon = True
            timer.start()
            try:
                summary = trainer.train()
            finally:
                cancel.set()
                timer.cancel()
        finally:
            signal.signal(signal.SIGUSR1, previous)
        done = trainer.step >= cfg.train.steps
        state[name] = {"done": done, "step": trainer.step, "steps": cfg.train.steps, "n_params": summary["n_params"]}
        _write_state(work, state)
        if not done:
            log.warning("budget: %s stopped at step %d of %d with a checkpoint; rerun the same command to continue",
                        name, trainer.step, cfg.train.steps)
            return False
    return True


def study_a(work: Path, out: Path, budget_s: float, plan: Plan) -> bool:
    deadline = time.time() + budget_s
    prepare_mix(plan, work)
    done = run_jobs(_jobs_a(plan, work), work, deadline, plan)
    report(work, out, plan)
    return done


def study_b(work: Path, out: Path, budget_s: float, plan: Plan) -> bool:
    deadline = time.time() + budget_s
    if not _read_state(work).get("a_full", {}).get("done"):
        raise ValueError(f"study-b converts study A's dense model: finish study-a under --work {work} first")
    done = run_jobs(_jobs_b(plan, work), work, deadline, plan)
    report(work, out, plan)
    return done


def study_all(work: Path, out: Path, budget_s: float, plan: Plan) -> bool:
    """Every study in one budget, most important first (``_jobs_all``). A piece that runs out of
    budget leaves the rest for the next invocation, as study-a and study-b do."""
    deadline = time.time() + budget_s
    prepare_mix(plan, work)
    prepare_retrieval_phase(plan, work)
    done = True
    for stage in _jobs_all(plan, work):
        done = done and run_jobs(stage, work, deadline, plan)
    report(work, out, plan)
    return done


def study_c(work: Path, out: Path, budget_s: float, plan: Plan) -> bool:
    deadline = time.time() + budget_s
    if not plan.retrieval_phase_steps:
        raise ValueError("study-c needs --retrieval-phase STEPS (> 0)")
    state = _read_state(work)
    if not (state.get("a_full", {}).get("done") and state.get("a_fmsa", {}).get("done")):
        raise ValueError(f"study-c trains study A's two models further: finish study-a under --work {work} first")
    prepare_retrieval_phase(plan, work)
    done = run_jobs(_jobs_c(plan, work), work, deadline, plan)
    report(work, out, plan)
    return done


# ------------------------------------------------------------------ report
def _records(run: Path) -> List[Dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train_curve(run: Path) -> List[Dict[str, Any]]:
    """Training records, one per step (a step logged again after a hard restart keeps its last record),
    each with ``wall_s``: the training seconds up to and including it, summed over every piece."""
    by_step = {}
    for r in _records(run):
        if "loss" in r and "eval_loss" not in r:
            by_step[r["step"]] = r
    out, wall, prev_tokens = [], 0.0, 0
    steps = sorted(by_step)
    for i, step in enumerate(steps):
        r = dict(by_step[step])
        tokens = r["tokens_seen"] - prev_tokens
        # the first step of a run compiles and autotunes its kernels (36 s for fmsa's Triton kernels,
        # 8 s for dense, on the H100): it is timed at the next step's speed, as start-up is left out
        timed = by_step[steps[1]] if i == 0 and len(steps) > 1 else r
        wall += tokens / timed["tokens_per_s"] if timed.get("tokens_per_s") else 0.0
        prev_tokens = r["tokens_seen"]
        r["wall_s"] = wall
        out.append(r)
    return out


def _last_eval(run: Path) -> Optional[Dict[str, Any]]:
    evals = [r for r in _records(run) if "eval_loss" in r]
    return evals[-1] if evals else None


def steps_to_within(curve: Sequence[float], reference: Sequence[float], rel: float = 0.01,
                    window: int = 5) -> Optional[int]:
    """The first step (1-based) from which the smoothed ``curve`` stays within ``rel`` of the smoothed
    ``reference`` (same steps, same batches) to the end; None if it never does."""
    n = min(len(curve), len(reference))
    if n == 0:
        return None
    from msa_train.quality.plots import moving_mean

    a, b = moving_mean(curve[:n], window), moving_mean(reference[:n], window)
    ok = [x <= (1 + rel) * y for x, y in zip(a, b)]
    if not ok[-1]:
        return None
    i = n - 1
    while i > 0 and ok[i - 1]:
        i -= 1
    return i + 1


def _run_entry(run: Path) -> Dict[str, Any]:
    curve, ev = _train_curve(run), _last_eval(run)
    return {"tokens": curve[-1]["tokens_seen"] if curve else None,
            "steps": curve[-1]["step"] if curve else None,
            "wall_s": curve[-1]["wall_s"] if curve else None,
            "final_train_loss": curve[-1]["loss"] if curve else None,
            "final_eval_loss": ev.get("eval_loss") if ev else None,
            "eval_loss_by_position": {k[len("eval_loss_pos_"):]: v for k, v in (ev or {}).items()
                                      if k.startswith("eval_loss_pos_")},
            "retrieval": ev.get("retrieval") if ev else None,
            "retrieval_accuracy": ev.get("eval_retrieval_accuracy") if ev else None,
            # teacher-forced loss per answer token: it tells models apart before exact matches appear
            "retrieval_answer_loss": ev.get("eval_retrieval_loss") if ev else None,
            "retrieval_token_accuracy": ev.get("eval_retrieval_token_accuracy") if ev else None,
            # the probes whose first answer token is the top prediction: teacher-forced, the later ones
            # can be copied on from the needle once the first is given; the first has to be found
            "retrieval_first_token_accuracy": ev.get("eval_retrieval_first_token_accuracy") if ev else None,
            "retrieval_first_token": ev.get("retrieval_first_token_accuracy_by_cell") if ev else None,  # as `retrieval`
            # the same by task -> length (the mean over depths): does any fall off with length?
            "retrieval_by_length": _by_length(ev) if ev else None,
            "retrieval_generate_agreement": ev.get("eval_retrieval_generate_agreement") if ev else None,
            "mean_tokens_per_s": (sum(r["tokens_per_s"] for r in curve[1:]) / (len(curve) - 1)) if len(curve) > 1 else None}


def _by_length(ev: Dict[str, Any]) -> Optional[Dict[str, Dict[str, Dict[str, float]]]]:
    """``{"token_accuracy" | "answer_loss" | "first_token_accuracy": task -> length -> mean over depths}``
    from an evaluation record (``first_token_accuracy`` where it was scored)."""
    tables = {"token_accuracy": ev.get("retrieval_token_accuracy_by_cell"),
              "answer_loss": ev.get("retrieval_answer_loss_by_cell")}
    if not all(tables.values()):
        return None
    if ev.get("retrieval_first_token_accuracy_by_cell"):
        tables["first_token_accuracy"] = ev["retrieval_first_token_accuracy_by_cell"]
    return {name: {task: {length: sum(cells.values()) / len(cells) for length, cells in lengths.items()}
                   for task, lengths in table.items()} for name, table in tables.items()}


def _steps_done_by(curve: List[Dict[str, Any]], wall: float) -> int:
    return sum(1 for r in curve if r["wall_s"] <= wall + 1e-9)


def _loss_at_wall(curve: List[Dict[str, Any]], wall: float, window: int) -> Optional[float]:
    """The training loss at ``wall`` seconds: the mean of ``window`` steps centred on the last step
    done by then, or the last ``window`` steps of a run that ends there, weighted by the steps'
    ``label_tokens`` where they are logged. A trailing mean on a
    still-falling curve lags it (the third run: NSA 3.624 trailing, 3.583 centred, at 230 s)."""
    done = _steps_done_by(curve, wall)
    if not done:
        return None
    hi = min(len(curve), done + (window - 1) // 2)
    lo = max(0, hi - window)
    steps = curve[lo:hi]
    if all(r.get("label_tokens") for r in steps):
        # weighted by each step's label tokens: a step of a synthetic document trained on its answers
        # alone (a few hundred tokens) counts for its tokens, not as much as a step of 16K text
        # tokens (runs logged before label_tokens existed: the plain mean)
        return sum(r["loss"] * r["label_tokens"] for r in steps) / sum(r["label_tokens"] for r in steps)
    return sum(r["loss"] for r in steps) / len(steps)


def report(work: Path, out: Path, plan: Optional[Plan] = None) -> Dict[str, Any]:
    """``<out>/summary.json`` and the plots from the runs under ``<work>/runs`` (missing runs: nulls)."""
    from msa_train.quality.plots import write_curves, write_heatmap

    runs = work / "runs"
    out.mkdir(parents=True, exist_ok=True)
    state = _read_state(work)
    arms = ["full", "fmsa", "full_seed1"] + (["fmsa_mean_phi"] if (runs / "a_fmsa_mean_phi").is_dir() else [])
    a = {name: _run_entry(runs / f"a_{name}") for name in arms}
    curves = {name: _train_curve(runs / f"a_{name}") for name in arms}

    def label(name: str, run: str) -> str:  # a run the budget stopped says so in the plots' legends
        st, curve = state.get(run, {}), curves[name]
        if st.get("done") or not curve:
            return name
        return f"{name} (unfinished: stopped at step {curve[-1]['step']})"

    for name in a:
        a[name]["done"] = state.get(f"a_{name}", {}).get("done", False)
    walls = [a[n]["wall_s"] for n in ("full", "fmsa") if a[n]["wall_s"]]
    equal_wall = min(walls) if len(walls) == 2 else None
    # a step is one 16K-token sequence, and its loss depends on what the sequence holds (code, prose,
    # synthetic questions), so 10-step means swing by several percent: the mean over a twentieth of the run
    longest_a = max((len(c) for c in curves.values()), default=0)
    wall_window = max(10, longest_a // 20)
    for name in a:
        curve = curves[name]
        done = _steps_done_by(curve, equal_wall) if equal_wall else 0
        a[name]["train_loss_at_equal_wall"] = _loss_at_wall(curve, equal_wall, wall_window) if done else None
        a[name]["step_at_equal_wall"] = curve[done - 1]["step"] if done else None  # a shorter run: its last step
    spread = None
    if a["full"]["final_eval_loss"] is not None and a["full_seed1"]["final_eval_loss"] is not None:
        spread = abs(a["full"]["final_eval_loss"] - a["full_seed1"]["final_eval_loss"])
    def gap_to_full(name: str) -> Optional[float]:
        if name in a and a["full"]["final_eval_loss"] and a[name]["final_eval_loss"] is not None:
            return a[name]["final_eval_loss"] / a["full"]["final_eval_loss"] - 1
        return None

    gap, mean_phi_gap = gap_to_full("fmsa"), gap_to_full("fmsa_mean_phi")
    b_names = {"dense_continued": "b_dense", "nsa_converted": "b_nsa", "nsa_distilled": "b_nsa_distill"}
    b = {key: _run_entry(runs / run) for key, run in b_names.items()}
    b_curves = {key: _train_curve(runs / run) for key, run in b_names.items()}
    dense_losses = [r["loss"] for r in b_curves["dense_continued"]]
    for key in b:
        losses = [r["loss"] for r in b_curves[key]]
        b[key]["loss_after_patch"] = losses[0] if losses else None  # step 1's forward runs the starting weights
        b[key]["steps_to_1pct"] = (0 if key == "dense_continued" else steps_to_within(losses, dense_losses)) \
            if losses and dense_losses else None
    distill = runs / "b_nsa_distill" / "nsa_distill.json"
    if distill.is_file():
        d = json.loads(distill.read_text())
        b["nsa_distilled"]["distill"] = {"steps": d["steps"], "lr": d["lr"], "time_s": d["time_s"],
                                         "first_error": d["losses"][0], "last_error": d["losses"][-1]}
    else:
        b["nsa_distilled"]["distill"] = None
    phase = None
    if (runs / "c_full").is_dir() or (runs / "c_fmsa").is_dir():
        phase = {arm: {**_run_entry(runs / f"c_{arm}"), "done": state.get(f"c_{arm}", {}).get("done", False)}
                 for arm in ("full", "fmsa")}
        phase["data"] = _json_or_none(work / "data" / "retrieval_phase.json")
    summary = {
        "status": {k: v for k, v in state.items()},
        "corpus": _json_or_none(work / "corpus" / "manifest.json", keep=("python", "site_packages", "documents",
                                                                         "tokens", "vocab_size", "packages")),
        "mix": _json_or_none(work / "data" / "mix.json"),
        "from_scratch": {**a, "equal_wall_s": equal_wall, "equal_wall_window_steps": wall_window,
                         "fmsa_vs_full_eval_loss": gap, "dense_seed_spread": spread,
                         **({"fmsa_mean_phi_vs_full_eval_loss": mean_phi_gap} if "fmsa_mean_phi" in a else {})},
        "conversion": b,
        **({"retrieval_phase": phase} if phase else {}),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    # plots: training losses as a moving mean of about a fiftieth of the run
    smooth_a = max(1, longest_a // 50)
    smooth_b = max(1, max((len(c) for c in b_curves.values()), default=0) // 50)
    write_curves({label(n, f"a_{n}"): [(r["tokens_seen"], r["loss"]) for r in c] for n, c in curves.items()},
                 out / "loss_tokens.png", "tokens", "training loss", "from scratch: loss at equal tokens", smooth=smooth_a)
    write_curves({label(n, f"a_{n}"): [(r["wall_s"], r["loss"]) for r in c] for n, c in curves.items()},
                 out / "loss_wall.png", "training seconds", "training loss", "from scratch: loss at equal wall-clock",
                 smooth=smooth_a)
    pos = {n: [(int(k.split("_")[1]), v) for k, v in e["eval_loss_by_position"].items() if v is not None]
           for n, e in a.items()}
    write_curves(pos, out / "loss_by_position.png", "position in document (bucket end, tokens)", "held-out loss",
                 "held-out loss by position", logx=True)
    write_curves({k: [(r["step"], r["loss"]) for r in c] for k, c in b_curves.items()}, out / "conversion_loss.png",
                 "step", "training loss", "dense -> NSA conversion", smooth=smooth_b)
    # study C's two models are columns of the from-scratch heatmap, beside the models they started from
    after_phase = {f"{k} after study C": v for k, v in (phase or {}).items() if k != "data"}
    for name, entries in (("retrieval_from_scratch.png", {"full": a["full"], "fmsa": a["fmsa"], **after_phase}),
                          ("retrieval_conversion.png", b)):
        results = {k: e["retrieval"] for k, e in entries.items() if e.get("retrieval")}
        if results:
            write_heatmap(results, out / name, title=name[:-4].replace("_", " "))
    return summary


def _json_or_none(path: Path, keep: Optional[Sequence[str]] = None):
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return {k: data[k] for k in keep if k in data} if keep else data
