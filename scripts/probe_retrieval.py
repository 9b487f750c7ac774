"""CPU probe: how many training examples does a small model need before it retrieves?

The quality study (docs/quality.md) mixes synthetic retrieval documents into its training data
and both of its models end at 0% exact match. This probe asks whether that is the budget or the
mix: it trains a tiny Llama (4 layers, hidden 128, 4 query / 2 KV heads) on nothing but short
synthetic retrieval documents (msa_train/quality/tasks.py's training documents, one question
each, haystacks from the corpus's training split) and scores single-needle probes over held-out
text every ``--eval-every`` steps. A plain PyTorch loop, so that thousands of steps fit a CPU.
``--copy-frac F --copy-kind text`` makes a fraction F of every batch copy documents (a span of
real text, more text, the span again; the repeat trained), ``--seed`` another init and data order.

    python -m msa_train.quality corpus --out /tmp/qc --max-tokens 3000000 --vocab 2048
    python scripts/probe_retrieval.py --corpus /tmp/qc --loss answers
    python scripts/probe_retrieval.py --corpus /tmp/qc --loss answers --copy-frac 0.5 --copy-kind text --seed 1

Prints one JSON line per evaluation (step, training loss, exact match, fraction of answer tokens).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="a corpus directory of `python -m msa_train.quality corpus`")
    p.add_argument("--length", type=int, default=256, help="tokens per training document and per probe")
    p.add_argument("--batch", type=int, default=8, help="documents per step")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--probes", type=int, default=64, help="single-needle probes, depths uniform")
    p.add_argument("--loss", choices=("all", "answers"), default="all",
                   help="all: every token is a target (pretraining, as the study); answers: only the answers")
    p.add_argument("--tasks", default="passkey,single_needle,multi_key", help="tasks of the training documents")
    p.add_argument("--queries", type=int, default=1,
                   help="questions per training document (each about its own needles, as the study's mix asks "
                        "one per 192 tokens): with more than one, every question has the others' needles as distractors")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="model init and data order (0 = the original probe's streams)")
    p.add_argument("--copy-frac", type=float, default=0.0,
                   help="fraction of each batch's documents that are copy documents (S, filler, S; loss on the 2nd S)")
    p.add_argument("--copy-kind", choices=("random", "text"), default="random",
                   help="random: S uniform random token ids; text: S cut from the training haystack")
    p.add_argument("--stop-at", type=float, default=0.9, help="stop once exact match >= this at two evals in a row")
    args = p.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from msa_train.quality.tasks import Haystack, make_probe, training_document

    torch.set_num_threads(args.threads)
    corpus = Path(args.corpus)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(corpus / "tokenizer" / "tokenizer.json"))

    def docs(name, n):
        lines = (corpus / name).read_text().splitlines()[:n]
        return [tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"] for line in lines]

    train_hay, eval_hay = Haystack(docs("train.jsonl", 400), tok), Haystack(docs("heldout.jsonl", 100), tok)
    probes = [make_probe("single_needle", tok, eval_hay, args.length, random.Random(f"depth{i}").random(),
                         random.Random(f"probe{i}")) for i in range(args.probes)]
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      rope_theta=10000.0, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    rng, tasks = random.Random("train" if args.seed == 0 else f"train{args.seed}"), args.tasks.split(",")
    copy_rng = random.Random(f"copy{args.seed}")
    n_copy = round(args.copy_frac * args.batch)

    def copy_document(n, r):
        """n tokens: S (n/4..n/2 tokens), filler of real text, S again; labels on the second S
        except its first token (nothing before it predicts it)."""
        s_len = r.randint(n // 4, n // 2)
        if args.copy_kind == "random":
            span = [r.randrange(len(tok)) for _ in range(s_len)]
        else:
            span = train_hay.window(r, s_len, anywhere=True)
        filler = train_hay.window(r, n - 2 * s_len, anywhere=True)
        ids = span + filler + span
        labels = [-100] * (n - s_len + 1) + span[1:]
        return torch.tensor(ids), torch.tensor(labels)

    def batch():
        xs, ys = [], []
        for _ in range(n_copy):
            x, y = copy_document(args.length, copy_rng)
            xs.append(x)
            ys.append(y)
        for _ in range(args.batch - n_copy):
            while True:  # a draw whose questions and needles leave no room for haystack is drawn again
                try:
                    d = training_document(tasks, tok, train_hay, args.length, args.queries, rng)
                    break
                except ValueError:
                    continue
            xs.append(d["input_ids"])
            ys.append(d["input_ids"] if args.loss == "all" else d["labels"])
        return torch.stack(xs), torch.stack(ys)

    @torch.no_grad()
    def evaluate():
        model.eval()
        exact = right = total = 0
        for i in range(0, len(probes), 16):
            x = torch.stack([q["input_ids"] for q in probes[i:i + 16]])
            y = torch.stack([q["labels"] for q in probes[i:i + 16]])[:, 1:]
            pred, mask = model(input_ids=x).logits[:, :-1].argmax(-1), y != -100
            exact += ((pred == y) | ~mask).all(1).sum().item()
            right += ((pred == y) & mask).sum().item()
            total += mask.sum().item()
        model.train()
        return exact / len(probes), right / total

    start, hits = time.time(), 0
    for step in range(1, args.steps + 1):
        x, y = batch()
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.eval_every == 0:
            exact, tokens = evaluate()
            print(json.dumps({"seed": args.seed, "copy_frac": args.copy_frac, "copy_kind": args.copy_kind,
                              "loss_targets": args.loss, "length": args.length, "queries": args.queries, "batch": args.batch, "step": step,
                              "examples": step * args.batch, "train_loss": round(loss.item(), 3),
                              "exact_match": exact, "answer_token_accuracy": round(tokens, 3),
                              "s": round(time.time() - start)}), flush=True)
            hits = hits + 1 if exact >= args.stop_at else 0
            if hits >= 2:
                break


if __name__ == "__main__":
    main()
