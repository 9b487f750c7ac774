"""``python -m msa_train.quality {corpus,study-a,study-b,study-c,all,report,probe}`` (docs/quality.md)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m msa_train.quality", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("corpus", help="build the site-packages corpus and its BPE tokenizer")
    c.add_argument("--out", required=True, help="output directory (train.jsonl, heldout.jsonl, tokenizer/, manifest.json)")
    c.add_argument("--max-tokens", type=int, default=None, help="cap on the training split's tokens")
    c.add_argument("--vocab", type=int, default=16384, help="BPE vocabulary size, special tokens included")
    c.add_argument("--site-packages", action="append", default=None,
                   help="directory to read (repeatable); default: this interpreter's site-packages")
    c.add_argument("--heldout-fraction", type=float, default=0.05)
    c.add_argument("--seed", type=int, default=0)
    from msa_train.quality import probe

    probe.add_arguments(sub.add_parser("probe", help="the CPU retrieval probe: does a training mix teach a tiny "
                                                     "model retrieval, and at which lengths (msa_train/quality/probe.py)"))
    for name, text in (("study-a", "from scratch: attention=full and fmsa (and a second dense seed)"),
                       ("study-b", "dense -> NSA conversion from study A's dense model"),
                       ("study-c", "the retrieval phase: study A's two models trained on retrieval documents alone"),
                       ("all", "study A's two arms, study B, study A's second dense seed, then study C (with "
                               "--retrieval-phase) and the --mean-phi-arm, in one budget"),
                       ("report", "summary.json and plots from the runs so far")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--work", required=True, help="work directory: corpus/, data/, runs/, state.json")
        s.add_argument("--out", default="runs/quality/results",
                       help="where summary.json and the plots go (the maintainers pass the committed results folder: docs/quality.md)")
        if name != "report":
            s.add_argument("--budget-s", type=float, default=540.0,
                           help="wall-clock seconds for this invocation; rerun the same command to continue")
        s.add_argument("--tiny", action="store_true", help="tiny sizes: the CPU test of the whole pipeline")
        if name in ("study-a", "all"):
            s.add_argument("--mix-fraction", type=float, default=None,
                           help="synthetic retrieval tokens as a fraction of the corpus's training tokens (default "
                                "0.4, 29%% of the mixed data); read when the mix is first written, so give it to the first invocation")
            s.add_argument("--mix-targets", choices=["all", "answers"], default=None,
                           help="what of a synthetic document trains: all its tokens (default) or its answers "
                                "only (the rest is context); read when the mix is first written")
            s.add_argument("--mean-phi-arm", action="store_true",
                           help="also train NSA with phi plain mean pooling (model.nsa_phi=mean), last: the "
                                "ablation of phi's parameters (held-out loss only)")
        if name in ("study-c", "all"):
            s.add_argument("--retrieval-phase", type=int, default=None, metavar="STEPS", required=name == "study-c",
                           help="study C: train study A's dense and NSA models on synthetic retrieval documents "
                                "(answers only) and copy documents for STEPS steps, then evaluate them (default: not run)")
            s.add_argument("--retrieval-phase-lengths", default=None, metavar="N,N,...",
                           help="study C's document lengths in tokens, drawn uniformly (default 256,512,2048), "
                                "each then spread by --retrieval-phase-spread; at most 8190 with the spread, its "
                                "8K sequence less BOS/EOS")
            s.add_argument("--retrieval-phase-spread", type=float, default=None, metavar="FRACTION",
                           help="each study C document's length is uniform within this fraction either side of "
                                "the length drawn (default 0.125; 0: the lengths exactly)")
            s.add_argument("--retrieval-phase-questions", type=int, default=None, metavar="TOKENS",
                           help="study C's documents ask one question per TOKENS tokens, up to 48; 0 (default): "
                                "one question a document, so no question has another's needles as distractors")
            s.add_argument("--retrieval-phase-lr", type=float, default=None, help="study C's peak learning rate (default 3e-4)")
            s.add_argument("--retrieval-phase-schedule", choices=["constant", "wsd", "cosine"], default=None,
                           help="study C's rate after its warm-up: wsd (default), held and then a cosine to a tenth "
                                "over the last --retrieval-phase-decay of its steps (train.lr_schedule=wsd); "
                                "constant; or the recipe's cosine to a tenth")
            s.add_argument("--retrieval-phase-decay", type=float, default=None, metavar="FRACTION",
                           help="with the wsd schedule, the fraction of study C's steps its decay takes (default 0.5)")
            s.add_argument("--retrieval-phase-copies", type=float, default=None, metavar="FRACTION",
                           help="the fraction of study C's documents that are copy documents, a span of real text "
                                "repeated and its repeat trained (default 0.5; 0: retrieval documents alone)")
        s.add_argument("--steps", type=int, default=None,
                       help="study A's optimizer steps (default: the recipe's); study B runs a tenth of them. "
                            "Give the same value to every invocation of one study")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    if args.command == "corpus":
        from msa_train.quality.corpus import build_corpus

        manifest = build_corpus(args.out, args.site_packages, args.max_tokens, args.vocab, args.heldout_fraction,
                                args.seed)
        print(json.dumps({k: manifest[k] for k in ("documents", "tokens", "vocab_size")}))
        return 0
    if args.command == "probe":
        probe.run(args)
        return 0
    from msa_train.quality import study

    work, out = Path(args.work), Path(args.out)
    plan = study.Plan.tiny(len(study._tokenizer(work))) if args.tiny else study.Plan.gpu()
    if args.steps:
        plan = plan.with_steps(args.steps)
    if getattr(args, "mix_fraction", None) is not None:
        if not 0 < args.mix_fraction < 1:
            raise SystemExit(f"--mix-fraction {args.mix_fraction}: expected a fraction in (0, 1)")
        plan = dataclasses.replace(plan, mix_fraction=args.mix_fraction)
    if getattr(args, "mix_targets", None):
        plan = dataclasses.replace(plan, mix_targets=args.mix_targets)
    if getattr(args, "retrieval_phase", None) is not None:
        if args.retrieval_phase < 1:
            raise SystemExit(f"--retrieval-phase {args.retrieval_phase}: expected a number of steps >= 1")
        plan = dataclasses.replace(plan, retrieval_phase_steps=args.retrieval_phase)
    if getattr(args, "retrieval_phase_spread", None) is not None:
        if not 0 <= args.retrieval_phase_spread < 1:
            raise SystemExit(f"--retrieval-phase-spread {args.retrieval_phase_spread}: expected a fraction in [0, 1)")
        plan = dataclasses.replace(plan, retrieval_phase_length_spread=args.retrieval_phase_spread)
    if getattr(args, "retrieval_phase_lengths", None):
        try:
            lengths = [int(x) for x in args.retrieval_phase_lengths.split(",")]
        except ValueError:
            lengths = []
        spread = plan.retrieval_phase_length_spread
        top = int((plan.retrieval_phase_seq_len - 2) / (1 + spread))
        if not lengths or not all(64 <= n <= top for n in lengths):
            raise SystemExit(f"--retrieval-phase-lengths {args.retrieval_phase_lengths}: expected comma-separated "
                             f"token counts from 64 to {top} (with the spread {spread}: at most "
                             f"{plan.retrieval_phase_seq_len - 2} tokens, the sequence less BOS/EOS)")
        plan = dataclasses.replace(plan, retrieval_phase_lengths=lengths)
    if getattr(args, "retrieval_phase_questions", None) is not None:
        if args.retrieval_phase_questions < 0:
            raise SystemExit(f"--retrieval-phase-questions {args.retrieval_phase_questions}: expected tokens >= 0")
        plan = dataclasses.replace(plan, retrieval_phase_tokens_per_query=args.retrieval_phase_questions)
    if getattr(args, "retrieval_phase_lr", None) is not None:
        if not args.retrieval_phase_lr > 0:
            raise SystemExit(f"--retrieval-phase-lr {args.retrieval_phase_lr}: expected a learning rate > 0")
        plan = dataclasses.replace(plan, retrieval_phase_lr=args.retrieval_phase_lr)
    if getattr(args, "retrieval_phase_schedule", None):
        plan = dataclasses.replace(plan, retrieval_phase_schedule=args.retrieval_phase_schedule)
    if getattr(args, "retrieval_phase_decay", None) is not None:
        if not 0 < args.retrieval_phase_decay <= 1:
            raise SystemExit(f"--retrieval-phase-decay {args.retrieval_phase_decay}: expected a fraction in (0, 1]")
        if plan.retrieval_phase_schedule != "wsd":
            raise SystemExit(f"--retrieval-phase-decay {args.retrieval_phase_decay}: only the wsd schedule decays over "
                             f"a fraction of the steps, not --retrieval-phase-schedule {plan.retrieval_phase_schedule}")
        plan = dataclasses.replace(plan, retrieval_phase_decay=args.retrieval_phase_decay)
    if getattr(args, "retrieval_phase_copies", None) is not None:
        if not 0 <= args.retrieval_phase_copies < 1:
            raise SystemExit(f"--retrieval-phase-copies {args.retrieval_phase_copies}: expected a fraction in [0, 1)")
        plan = dataclasses.replace(plan, retrieval_phase_copy_fraction=args.retrieval_phase_copies)
    if getattr(args, "mean_phi_arm", False):
        plan = dataclasses.replace(plan, mean_phi_arm=True)
    if args.command == "report":
        study.report(work, out, plan)
        return 0
    run = {"study-a": study.study_a, "study-b": study.study_b, "study-c": study.study_c,
           "all": study.study_all}[args.command]
    done = run(work, out, args.budget_s, plan)
    print(f"{args.command}: {'done' if done else 'not finished: run the same command again to continue'}")
    return 0 if done else 3


if __name__ == "__main__":
    sys.exit(main())
