"""A positive control for the retrieval evaluation: every study run so far scored 0% exact match,
which a misaligned scorer would also give. A tiny model that has memorised the answers of the
evaluation's own probes must score 100% through the trainer's evaluation path (probes packed several
to a sequence, the chunked loss's argmax, segments mapped back to probes) and through generate().
Dense attention on the CPU; the NSA backends share this path after their forward."""
import pytest
import torch

from msa_train.quality.study import Plan
from msa_train.quality.tasks import pack_probes
from msa_train.trainer import Trainer
from tests.msa_train._util import compose


def test_a_model_that_knows_the_answers_scores_them_all(tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    _, corpus, manifest = tiny_corpus
    plan = Plan.tiny(manifest["vocab_size"])
    cfg = compose([*plan.recipe_overrides, "attention=full", "train.seq_len=256", f"data.path={corpus / 'train.jsonl'}",
                   f"data.eval_path={corpus / 'heldout.jsonl'}", f"data.tokenizer={corpus / 'tokenizer'}",
                   f"data.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path / 'run'}", "train.progress=false",
                   "eval.retrieval_lengths=[256,512]", "eval.retrieval_depths=1", "eval.retrieval_probes=1",
                   "eval.retrieval_generate=4"])
    trainer = Trainer(cfg)
    probes = trainer.retrieval_probes
    assert len(probes) == 2 * 2 and len({tuple(p["input_ids"][-p["answer_tokens"]:].tolist()) for p in probes}) == 4
    # the evaluation packs them longest first into 512-token sequences: the two 256-token probes share one
    order = sorted(range(len(probes)), key=lambda i: -len(probes[i]["input_ids"]))
    assert order != list(range(len(probes)))
    assert sorted(len(p["probe_ids"]) for p in pack_probes([probes[i] for i in order], 512, 0)) == [1, 1, 2]

    before = trainer._eval_retrieval()
    assert before["eval_retrieval_accuracy"] < 0.5
    # each cell holds one probe: its scores, with the first answer token scored as a segment of its own
    # and added back, equal a forward of the probe alone
    with torch.no_grad():
        for p in probes:
            ids, labels = p["input_ids"], p["labels"]
            logits = trainer.model(input_ids=ids[None]).logits[0].float()
            at = (labels != -100).nonzero()[:, 0]
            loss = torch.nn.functional.cross_entropy(logits[at - 1], ids[at], reduction="sum")
            cell = lambda key: before[key][p["task"]][str(len(ids))][f"{p['depth']:g}"]  # noqa: E731
            assert cell("retrieval_answer_loss_by_cell") == pytest.approx(loss.item() / len(at), rel=1e-4)
            first = torch.nn.functional.cross_entropy(logits[at[0] - 1], ids[at[0]])  # the first answer token's
            assert cell("retrieval_first_token_loss_by_cell") == pytest.approx(first.item(), rel=1e-4)
            assert len(at) > 1  # a number of several tokens: scoring the second in place of the first fails above
            second = torch.nn.functional.cross_entropy(logits[at[1] - 1], ids[at[1]])
            assert abs(second.item() - first.item()) > 1e-3
            assert cell("retrieval_first_token_accuracy_by_cell") == float(logits[at[0] - 1].argmax() == ids[at[0]])

    # memorise the probes' answers: all four in one packed sequence
    pack = pack_probes(probes, 2 * 256 + 2 * 512, 0)[0]
    batch = trainer._make_batch(pack)
    opt = torch.optim.Adam(trainer.module.parameters(), lr=1e-2)
    trainer.module.train()
    for step in range(200):
        loss = trainer._forward(batch)  # summed over the answers' tokens
        opt.zero_grad()
        trainer.engine.backward(loss)
        opt.step()
        if loss.item() < 0.05:  # about 125 steps
            break
    trainer.module.eval()

    after = trainer._eval_retrieval()
    assert after["eval_retrieval_accuracy"] == 1.0, after["eval_retrieval_accuracy"]
    assert after["eval_retrieval_token_accuracy"] == 1.0 and after["eval_retrieval_first_token_accuracy"] == 1.0
    assert all(v == 1.0 for task in after["retrieval"].values() for cells in task.values() for v in cells.values())
    assert after["eval_retrieval_generate_accuracy"] == 1.0 and after["eval_retrieval_generate_agreement"] == 1.0
