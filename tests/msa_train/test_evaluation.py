"""Held-out evaluation (msa_train/evaluation.py, Trainer.evaluate) on CPU."""
import json
import math

import pytest
import torch

from tests.msa_train._util import FAST, compose, read_metrics, train

EVAL = ["data.eval_fraction=0.125", "eval.passkey=3"]


def test_position_edges_and_buckets():
    from msa_train.evaluation import bucket_names, position_buckets, position_edges

    edges = position_edges(512, 6)
    assert edges == [0, 16, 32, 64, 128, 256, 512]
    pos = torch.tensor([0, 15, 16, 31, 32, 255, 256, 511])
    assert position_buckets(pos, edges).tolist() == [0, 0, 1, 1, 2, 4, 5, 5]
    assert position_edges(1000, 3) == [0, 250, 500, 1000] and position_edges(8, 1) == [0, 8]
    assert bucket_names([0, 4, 8]) == ["eval_loss_pos_0_4", "eval_loss_pos_4_8"]
    with pytest.raises(ValueError, match="2\\^\\(buckets-1\\) <= seq_len"):
        position_edges(16, 6)


def test_retrieval_metrics_grade_every_probe():
    from msa_train.evaluation import retrieval_metrics

    def probe(task, length, depth, answer_tokens):
        return {"task": task, "input_ids": [0] * length, "depth": depth, "answer_tokens": answer_tokens}

    probes = [probe("passkey", 64, 0.0, 2), probe("passkey", 64, 0.0, 2), probe("passkey", 128, 1.0, 4),
              probe("multi_value", 64, 0.0, 4)]
    # per probe: answer loss summed over its tokens, argmax-correct answer tokens, the first answer
    # token's loss, whether it is correct
    per_probe = torch.tensor([[0.2, 2.0, 0.1, 1.0], [3.0, 1.0, 2.0, 0.0], [8.0, 1.0, 0.5, 1.0], [4.0, 3.0, 1.5, 0.0]])
    m = retrieval_metrics(probes, per_probe)
    assert m["eval_retrieval_accuracy"] == 0.25 and m["eval_retrieval_passkey"] == pytest.approx(1 / 3)
    assert m["retrieval"]["passkey"]["64"]["0"] == 0.5 and m["retrieval"]["multi_value"]["64"]["0"] == 0.0
    # by cell, each probe's own fraction and loss per answer token, averaged
    assert m["retrieval_token_accuracy_by_cell"]["passkey"]["64"]["0"] == 0.75
    assert m["retrieval_token_accuracy_by_cell"]["passkey"]["128"]["1"] == 0.25
    assert m["retrieval_token_accuracy_by_cell"]["multi_value"]["64"]["0"] == 0.75
    assert m["retrieval_answer_loss_by_cell"]["passkey"]["64"]["0"] == pytest.approx((0.1 + 1.5) / 2)
    assert m["retrieval_answer_loss_by_cell"]["passkey"]["128"]["1"] == pytest.approx(2.0)
    # overall and per task: over every answer token (the 4-token probe weighs twice a 2-token one)
    assert m["eval_retrieval_token_accuracy"] == pytest.approx(7 / 12)
    assert m["eval_retrieval_loss"] == pytest.approx(15.2 / 12)
    assert m["eval_retrieval_passkey_token_accuracy"] == pytest.approx(4 / 8)
    assert m["eval_retrieval_passkey_loss"] == pytest.approx(11.2 / 8)
    assert m["eval_retrieval_multi_value_loss"] == pytest.approx(1.0)
    # the first answer token: a fraction of probes, each weighing the same
    assert m["eval_retrieval_first_token_accuracy"] == 0.5
    assert m["eval_retrieval_passkey_first_token_accuracy"] == pytest.approx(2 / 3)
    assert m["eval_retrieval_multi_value_first_token_accuracy"] == 0.0
    assert m["retrieval_first_token_accuracy_by_cell"]["passkey"] == {"64": {"0": 0.5}, "128": {"1": 1.0}}
    assert m["eval_retrieval_first_token_loss"] == pytest.approx(1.025)
    assert m["eval_retrieval_passkey_first_token_loss"] == pytest.approx(2.6 / 3)
    assert m["retrieval_first_token_loss_by_cell"]["passkey"]["64"]["0"] == pytest.approx(1.05)
    with pytest.raises(ValueError, match="at least one answer token"):
        retrieval_metrics([probe("passkey", 64, 0.0, 0)], torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"shape \[4, 4\], got \(4, 2\)"):
        retrieval_metrics(probes, per_probe[:, :2])


def test_passkey_probes():
    from msa_train.data import byte_tokenizer
    from msa_train.evaluation import passkey_probes

    tok = byte_tokenizer()
    probes = passkey_probes(tok, 512, 3, seed=0)
    assert [p["depth"] for p in probes] == [0.0, 0.5, 1.0]
    needle_at = []
    for p in probes:
        ids, labels = p["input_ids"], p["labels"]
        assert ids.shape == labels.shape == (512,) and p["cu_seqlens"].tolist() == [0, 512]
        n = p["answer_tokens"]
        assert n == 6 and (labels[:-n] == -100).all() and torch.equal(labels[-n:], ids[-n:])
        text = tok.decode(ids.tolist())
        key = tok.decode(ids[-n:].tolist())
        assert key.strip().isdigit() and len(key.strip()) == 5
        assert text.count(f"The pass key is{key}") == 2  # stated once in the filler, answered at the end
        needle_at.append(text.index(f"The pass key is{key}"))
    assert needle_at == sorted(needle_at) and needle_at[0] < 100 < 400 < needle_at[-1]
    assert passkey_probes(tok, 512, 3, seed=0)[1]["input_ids"].equal(probes[1]["input_ids"])  # deterministic
    with pytest.raises(ValueError, match="eval.passkey: a probe's fixed text takes"):
        passkey_probes(tok, 128, 1, seed=0)


def _reference_eval(trainer, edges):
    """The evaluation recomputed with a plain HF model (eager attention), one document at a time."""
    from transformers import AutoModelForCausalLM

    from msa_train.evaluation import position_buckets
    from msa_train.trainer import next_token_targets

    model = AutoModelForCausalLM.from_config(trainer.model.config, attn_implementation="eager")
    model.load_state_dict(trainer.model.state_dict())
    model.eval()
    nb = len(edges) - 1
    loss, correct, count = torch.zeros(nb, dtype=torch.float64), 0, torch.zeros(nb)
    with torch.no_grad():
        for item in [trainer.eval_dataset[i] for i in range(len(trainer.eval_dataset))]:
            cu = item["cu_seqlens"].tolist()
            targets = next_token_targets(item["labels"], item["cu_seqlens"])
            for a, b in zip(cu[:-1], cu[1:]):
                t = targets[a:b]
                keep = t != -100
                if not keep.any():
                    continue
                logits = model(input_ids=item["input_ids"][None, a:b]).logits[0].double()
                tok_loss = torch.nn.functional.cross_entropy(logits[keep], t[keep], reduction="none")
                bucket = position_buckets(item["position_ids"][a:b][keep], edges)
                loss.index_add_(0, bucket, tok_loss)
                count.index_add_(0, bucket, torch.ones(len(bucket)))
                correct += int((logits[keep].argmax(-1) == t[keep]).sum())
        passkey = []
        for p in trainer.passkey_probes:
            n = p["answer_tokens"]
            logits = model(input_ids=p["input_ids"][None]).logits[0, -n - 1:-1].double()
            answer = p["input_ids"][-n:]
            passkey.append((float(torch.nn.functional.cross_entropy(logits, answer, reduction="sum")),
                            int((logits.argmax(-1) == answer).sum())))
    return loss, count, correct, passkey


@pytest.mark.parametrize("eval_len", [0, 1024], ids=["train-length", "eval.seq_len"])
def test_eval_matches_hf_document_by_document(tmp_path, eval_len):
    """The packed, chunked evaluation equals a plain HF model run on each held-out document alone:
    loss overall and by position, argmax accuracy, and the pass-key figures; with eval.seq_len the
    held-out documents are packed (and their positions bucketed) at that length, not train.seq_len's."""
    from msa_train.evaluation import position_edges
    from msa_train.trainer import Trainer

    cfg = compose(["attention=full", *FAST, *EVAL, "train.loss_chunk_tokens=100", "eval.only=true",
                   f"eval.seq_len={eval_len}", f"train.output_dir={tmp_path}"])
    torch.manual_seed(0)
    trainer = Trainer(cfg)
    length = eval_len or cfg.train.seq_len
    assert cfg.train.seq_len == 512 and {trainer.eval_dataset[i]["input_ids"].shape[0]
                                         for i in range(len(trainer.eval_dataset))} == {length}
    with torch.no_grad():  # a trained-looking model: the untrained one predicts almost uniformly
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    got = trainer.evaluate()
    edges = position_edges(length, 6)
    loss, count, correct, passkey = _reference_eval(trainer, edges)
    assert got["eval_tokens"] == int(count.sum()) > 5000
    assert got["eval_loss"] == pytest.approx(float(loss.sum() / count.sum()), rel=1e-5)
    assert got["eval_ppl"] == pytest.approx(math.exp(got["eval_loss"]), rel=1e-9)
    assert got["eval_token_accuracy"] == pytest.approx(correct / float(count.sum()), abs=2e-3)
    for (lo, hi), s, c in zip(zip(edges[:-1], edges[1:]), loss.tolist(), count.tolist()):
        assert c > 0 and got[f"eval_loss_pos_{lo}_{hi}"] == pytest.approx(s / c, rel=1e-5)
    need = sum(p["answer_tokens"] for p in trainer.passkey_probes)
    assert got["eval_passkey_loss"] == pytest.approx(sum(x[0] for x in passkey) / need, rel=1e-5)
    assert got["eval_passkey_token_accuracy"] == pytest.approx(sum(x[1] for x in passkey) / need)
    exact = [x[1] == p["answer_tokens"] for x, p in zip(passkey, trainer.passkey_probes)]
    assert got["eval_passkey_accuracy"] == pytest.approx(sum(exact) / len(exact))


def test_held_out_documents_are_not_trained_on():
    from msa_train.data import build_packed_datasets, build_tokenizer

    cfg = compose([*FAST, "data.eval_fraction=0.25"])
    tok = build_tokenizer(cfg.data, None)
    train_ds, eval_ds = build_packed_datasets(cfg.data, tok, 512)

    def docs(ds):
        return {tuple(ds.tokens[int(d)]["input_ids"][:32].tolist()) for d in set(ds.plan.doc.tolist())}

    held, kept = docs(eval_ds), docs(train_ds)
    assert len(held) == 12 and len(kept) == 36 and not held & kept
    again = build_packed_datasets(cfg.data, tok, 512)[1]
    assert docs(again) == held  # the same documents every time (data.seed)


def test_eval_during_training_leaves_training_alone_and_eval_only_repeats_it(tmp_path):
    """Evaluating every 2 steps changes no training figure; eval.only on the final checkpoint gives
    the end-of-training evaluation again, and leaves the run's files alone."""
    common = ["attention=nsa", "train.steps=4", "train.seq_len=256", *FAST, *EVAL]
    _, plain = train([*common, "eval.at_end=false", f"train.output_dir={tmp_path / 'plain'}"])
    summary, records = train([*common, "eval.every=2", "eval.at_start=true", f"train.output_dir={tmp_path / 'ev'}"])
    evals = [r for r in records if "eval_loss" in r]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4] and [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all("eval_loss" not in r for r in plain)
    for a, b in zip(plain, steps):  # two identical CPU runs can differ in the last bits of a reduction
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert summary["eval"]["step"] == 4 and summary["eval"]["eval_loss"] == evals[-1]["eval_loss"]

    run = tmp_path / "ev"
    before = {p: p.read_bytes() for p in (run / "metrics.jsonl", run / "config.json")}
    from msa_train.trainer import Trainer

    result = Trainer(compose([*common, "eval.only=true", "train.resume=auto", f"train.output_dir={run}"])).run()
    assert result["checkpoint"].endswith("step_000004")
    saved = json.loads((run / "eval.json").read_text())
    for key in ("eval_loss", "eval_loss_pos_128_256", "eval_passkey_loss"):
        assert saved[key] == pytest.approx(evals[-1][key], rel=1e-6), key
    assert {p: p.read_bytes() for p in before} == before
    assert read_metrics(run)[-1]["step"] == 4
    # the weights under other evaluation settings: the other NSA implementation name, twice the length
    longer = [a for a in common if not a.startswith(("attention=", "train.seq_len="))]
    result = Trainer(compose([*longer, "attention=auto", "train.seq_len=512", "eval.only=true", "train.resume=auto",
                              f"train.output_dir={run}"])).run()
    assert result["seq_len"] == 512 and "eval_loss_pos_256_512" in result and math.isfinite(result["eval_loss"])
    with pytest.raises(ValueError, match="does not fit this run .*attention"):
        Trainer(compose([*longer, "attention=full", "eval.only=true", "train.resume=auto", f"train.output_dir={run}"]))


@pytest.mark.parametrize("overrides, match", [
    (["eval.every=5"], "eval.every=5 needs evaluation data"),
    (["eval.only=true"], "eval.only=true needs evaluation data"),
    (["data.eval_fraction=1.0"], "data.eval_fraction=1.0 must be in"),
    (["data.eval_path=x.jsonl"], "data.eval_path needs a file format"),
    (["eval.position_buckets=11"], "eval.position_buckets=11"),
    (["eval.every=-1"], "eval.every=-1"),
    (["eval.seq_len=1"], "eval.seq_len=1: expected 0"),
    (["eval.seq_len=-512"], "eval.seq_len=-512: expected 0"),
    (["eval.seq_len=40", "eval.position_buckets=7"], "the first of them would be shorter than one token at eval.seq_len=40"),
    (["eval.seq_len=1001", "parallel.sp_degree=2"], "eval.seq_len=1001 must be divisible by parallel.sp_degree=2"),
    (["eval.seq_len=16"], "eval.seq_len=16 must be >= attention.slc_block=32"),
], ids=["no-data", "only-no-data", "fraction", "generated-path", "buckets", "negative", "eval-len-1", "eval-len-negative",
        "eval-len-buckets", "eval-len-sp", "eval-len-block"])
def test_eval_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        compose(overrides)


def test_eval_data_errors(tmp_path):
    from msa_train.data import build_packed_datasets, build_tokenizer

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(3)))
    cfg = compose(["data=jsonl", f"data.path={docs}", "data.eval_fraction=0.9"])
    with pytest.raises(ValueError, match="none would be left to train on"):
        build_packed_datasets(cfg.data, build_tokenizer(cfg.data, None), 256)
    with pytest.raises(ValueError, match="data.eval_path and data.eval_fraction are alternatives"):
        compose(["data=jsonl", f"data.path={docs}", f"data.eval_path={docs}", "data.eval_fraction=0.5"])
    cfg = compose(["data=jsonl", f"data.path={docs}", f"data.eval_path={docs}"])
    train_ds, eval_ds = build_packed_datasets(cfg.data, build_tokenizer(cfg.data, None), 256)
    assert eval_ds.num_tokens == train_ds.num_tokens  # the same files, read the same way


def test_eval_only_tokenizes_only_the_evaluation_documents(tmp_path, monkeypatch):
    """eval.only does not tokenise (or pack) the training documents."""
    import msa_train.data.dataset as dataset
    from msa_train.trainer import Trainer

    seen = []
    real = dataset.tokenize_dataset
    monkeypatch.setattr(dataset, "tokenize_dataset", lambda ds, *a, **k: (seen.append(len(ds)), real(ds, *a, **k))[1])
    trainer = Trainer(compose(["attention=full", *FAST, "data.eval_fraction=0.25", "eval.only=true",
                               f"train.output_dir={tmp_path}"]))
    assert seen == [12] and trainer.dataset is None and len(trainer.eval_dataset) > 0


def test_eval_only_refuses_documents_the_model_trained_on(tmp_path):
    """A run records the documents it trained on (also in its hf/ export); eval.only on held-out
    documents it trained on is refused, on its own hold-out it runs."""
    from msa_train.trainer import Trainer

    common = ["attention=full", *FAST, "train.steps=1", "train.seq_len=256"]
    train([*common, "train.save_hf=true", f"train.output_dir={tmp_path / 'run'}"])  # no hold-out
    assert (tmp_path / "run" / "hf" / "training_documents.npy").is_file()
    for source in (["train.resume=auto", f"train.output_dir={tmp_path / 'run'}"],
                   [f"model.path={tmp_path / 'run' / 'hf'}", f"train.output_dir={tmp_path / 'ev'}"]):
        with pytest.raises(ValueError, match="evaluation documents were trained on"):
            Trainer(compose([*common, "data.eval_fraction=0.25", "eval.only=true", *source]))
    train([*common, "data.eval_fraction=0.25", f"train.output_dir={tmp_path / 'held'}"])
    out = Trainer(compose([*common, "data.eval_fraction=0.25", "eval.only=true", "train.resume=auto",
                           f"train.output_dir={tmp_path / 'held'}"])).run()
    assert math.isfinite(out["eval_loss"])


def test_eval_line_shows_the_graded_retrieval_figures():
    from msa_train.metrics import format_eval

    line = format_eval({"step": 7, "eval_loss": 2.5, "eval_retrieval_accuracy": 0.0,
                        "eval_retrieval_token_accuracy": 0.3125, "eval_retrieval_loss": 4.25})
    assert line == "eval step 7:  loss 2.5000  retrieval acc 0.000  answer-token acc 0.312  answer loss 4.250"
