"""GRPO (train.objective=grpo, msa_train/grpo.py): its rewards, advantages and loss against values
computed by hand, the rollouts' packing and reference swap, sampling through both backends' KV cache,
and tiny CPU runs: the reward rises, the first step's KL is 0 (the reference is the starting
policy, with and without LoRA), and a resumed run continues exactly."""
import json
import math

import pytest
import torch

from msa_train.grpo import (StartingWeights, completion_of, group_advantages, grpo_token_loss, pack_group,
                            reward_chars, reward_exact, reward_prefix, sample_group)
from tests.msa_train._util import compose, train

# a tiny, fast GRPO run: 8 prompts of 256 tokens (pass keys in generated text) x 8 completions per step
RUN = ["recipe=tiny_grpo", "attention=full", "train.progress=false", "train.save_hf=false", "data.num_docs=24",
       "data.num_prompts=64", "data.eval_fraction=0", "eval.every=0", "train.grad_accum=8", "train.grpo_group=8",
       "train.grpo_max_new_tokens=6", "train.lr=1e-2"]


def test_rewards_on_hand_made_completions():
    assert reward_exact(" 12345 ", "12345") == 1.0 and reward_exact("12345.", "12345") == 0.0
    assert reward_prefix("  12345. Keep it", " 12345") == 1.0 and reward_prefix("1234", "12345") == 0.0
    assert reward_chars("12x45 and more", "12345") == pytest.approx(4 / 5)
    assert reward_chars("", "12345") == 0.0 and reward_chars("12345", "12345") == 1.0


def test_group_advantages_are_z_scores_and_zero_for_a_tied_group():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    s = math.sqrt(4 * 0.25 / 3)  # mean 0.5, std with Bessel's correction (as TRL)
    assert adv.tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], abs=1e-3)
    assert group_advantages(torch.tensor([0.3, 0.3, 0.3])).tolist() == [0.0, 0.0, 0.0]


def test_token_loss_and_its_gradient_equal_hand_computed_values():
    nll = torch.tensor([0.5, 1.0, 2.0, 0.1], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.7, 1.0, 1.5, 9.0], dtype=torch.float64)
    adv = torch.tensor([2.0, 2.0, -1.0, 5.0], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])
    loss, kl = grpo_token_loss(nll, adv, mask, ref, beta=0.1)
    k3 = [math.exp(r) - r - 1 for r in (0.5 - 0.7, 0.0, 2.0 - 1.5)]  # r = log pi_ref - log pi = nll - ref_nll
    assert kl.item() == pytest.approx(sum(k3))
    assert loss.item() == pytest.approx(2 * 0.5 + 2 * 1.0 - 1 * 2.0 + 0.1 * sum(k3))
    loss.backward()
    # d/dnll: A + beta (exp(r) - 1); the masked position gets nothing
    want = [a + 0.1 * (math.exp(r) - 1) for a, r in ((2.0, -0.2), (2.0, 0.0), (-1.0, 0.5))] + [0.0]
    assert nll.grad.tolist() == pytest.approx(want)
    loss0, kl0 = grpo_token_loss(nll.detach(), adv, mask, None, beta=0.0)
    assert loss0.item() == pytest.approx(1.0) and kl0.item() == 0.0


def test_pack_group_labels_only_completions_and_completions_end_at_eos():
    from msa_train.trainer import next_token_targets

    assert completion_of(torch.tensor([5, 6, 2, 9, 9]), [2]).tolist() == [5, 6, 2]
    assert completion_of(torch.tensor([5, 6, 7]), [2]).tolist() == [5, 6, 7]
    prompt = torch.tensor([1, 10, 11])
    packed = pack_group(prompt, [torch.tensor([20, 21]), torch.tensor([30])], torch.tensor([0.5, -0.5]))
    assert packed["cu_seqlens"].tolist() == [0, 5, 9] and packed["max_seqlen"] == 5 and packed["num_tokens"] == 9
    assert packed["input_ids"].tolist() == [1, 10, 11, 20, 21, 1, 10, 11, 30]
    assert packed["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    targets = next_token_targets(packed["labels"], packed["cu_seqlens"])
    # predicted: the completion tokens only (20, 21 from positions 2, 3; 30 from position 7)
    assert targets.tolist() == [-100, -100, 20, 21, -100, -100, -100, 30, -100]
    assert packed["advantages"].tolist() == [0.5] * 5 + [-0.5] * 4


def test_starting_weights_swap_in_the_reference_by_pointer_and_back():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].weight.requires_grad_(False)  # frozen: not kept, never swapped
    ref = StartingWeights(model)
    assert set(ref.state) == {"0.weight", "0.bias", "1.bias"}
    x = torch.randn(3, 4)
    before = model(x).detach()
    with torch.no_grad():  # a "training step": the trainable parameters move
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    after = model(x).detach()
    assert not torch.allclose(after, before)
    trained = model[0].weight.data_ptr()
    with torch.no_grad(), ref.swapped_in():
        assert torch.equal(model(x), before)  # the starting policy
        assert model[0].weight.data_ptr() == ref.state["0.weight"].data_ptr()  # no copy
    assert model[0].weight.data_ptr() == trained and torch.equal(model(x).detach(), after)
    with pytest.raises(ValueError, match="no starting value for 1 trainable"):
        StartingWeights(model, {"0.weight": torch.zeros(4, 4), "0.bias": torch.zeros(4)})


@pytest.mark.parametrize("attention", ["full", "nsa"])
def test_group_sampling_decodes_through_the_kv_cache(attention, monkeypatch):
    """generate() of a group: G completions at once, each step's queries against the cached keys
    (NSA through NativeSparseAttention.decode), the same tokens as sampling without a cache."""
    from flash_msa import NativeSparseAttention
    from msa_train.config import AttentionConfig, ModelConfig
    from msa_train.models import build_model
    from tests.msa_train.test_models import SMALL_NSA, TINY

    torch.manual_seed(0)
    model = build_model(ModelConfig(model_type="llama", hf_config=TINY["llama"]),
                        AttentionConfig(name=attention, **SMALL_NSA)).eval()
    decodes = []
    real = NativeSparseAttention.decode
    monkeypatch.setattr(NativeSparseAttention, "decode", lambda self, *a, **k: decodes.append(1) or real(self, *a, **k))
    prompt = torch.randint(3, 97, (70,))
    # a checkpoint's own sampling settings must not reshape the policy's distribution
    model.generation_config.repetition_penalty, model.generation_config.top_p = 50.0, 0.1
    torch.manual_seed(1)
    with torch.no_grad():
        out = sample_group(model, prompt, 4, 5, 1.0, pad_id=0, eos_ids=[])
    assert len(out) == 4 and all(len(c) == 5 for c in out)
    assert len({tuple(c.tolist()) for c in out}) > 1  # sampled, not greedy
    assert bool(decodes) == (attention == "nsa")
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig()  # transformers fills a passed config's gaps from the model's
    torch.manual_seed(1)
    with torch.no_grad():
        again = model.generate(input_ids=prompt[None].expand(4, -1), attention_mask=torch.ones(4, 70, dtype=torch.long),
                               generation_config=GenerationConfig(max_new_tokens=5, do_sample=True, temperature=1.0,
                                                                  top_k=0, top_p=1.0, pad_token_id=0, use_cache=False))
    assert torch.equal(torch.stack(out), again[:, 70:])


def test_tiny_grpo_raises_the_reward(tmp_path):
    """From scratch the model rarely samples a pass key's characters; GRPO's partial-credit reward
    climbs (24 steps: the mean of the last 6 is several times that of the first 6)."""
    summary, records = train([*RUN, "train.steps=24", f"train.output_dir={tmp_path}"])
    steps = [r for r in records if "reward" in r]
    assert len(steps) == 24 and steps[0]["kl"] == 0.0  # the first step's policy is the reference
    assert all(r["completion_tokens"] <= 6 and r["generate_tokens_per_s"] > 0 for r in steps)
    assert summary["final_reward"] > 3 * summary["first_reward"] and summary["final_reward"] > 0.02, summary
    assert (tmp_path / "grpo_reference.pt").is_file()


def test_grpo_with_nsa_and_lora_starts_at_the_reference_and_evaluates(tmp_path, monkeypatch):
    """Under LoRA the reference is the adapters' and NSA's starting values swapped in: the first
    step's KL is 0 exactly, the second's not; the held-out prompts are scored by greedy completions."""
    from msa_train import grpo

    # a reward that tells completions apart from the first step (an untrained model retrieves nothing)
    monkeypatch.setitem(grpo.REWARDS, "chars", lambda completion, answer: float(sum(map(ord, completion)) % 2))
    summary, records = train([*RUN, "attention=nsa", "train.steps=2", "train.grad_accum=2", "train.grpo_group=4",
                              "model.lora.r=4", "data.eval_fraction=0.05", "eval.every=2",
                              f"train.output_dir={tmp_path}"])
    steps = [r for r in records if "reward" in r]
    evals = [r for r in records if "eval_reward" in r]
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] > 0.0
    assert evals and evals[0]["eval_prompts"] == 3 and 0.0 <= evals[0]["eval_reward"] <= 1.0
    saved = torch.load(tmp_path / "grpo_reference.pt", weights_only=True)
    assert saved and all("lora_" in k or ".nsa." in k for k in saved)  # the trainable tensors only


def test_a_resumed_grpo_run_continues_exactly(tmp_path):
    """The sampler, the RNG (the rollouts' sampling) and the reference come back: 2 + 2 steps log what 4 do."""
    args = [*RUN, "train.steps=4", "train.grad_accum=2", "train.grpo_group=4", "train.save_every=2"]
    _, whole = train([*args, f"train.output_dir={tmp_path / 'a'}"])
    train([*args, f"train.output_dir={tmp_path / 'b'}"], stop_after=2)
    _, resumed = train([*args, f"train.output_dir={tmp_path / 'b'}", "train.resume=auto"])
    keys = ("reward", "kl", "loss", "completion_tokens")
    assert [[r[k] for k in keys] for r in resumed if "reward" in r] == \
        [[r[k] for k in keys] for r in whole if "reward" in r]


def test_grpo_configuration_errors_name_the_setting(tmp_path):
    with pytest.raises(ValueError, match="train.objective=grpo and data.format=prompts|retrieval go together"):
        compose(["recipe=tiny", "train.objective=grpo"])
    with pytest.raises(ValueError, match="go together"):
        compose(["recipe=tiny_grpo", "train.objective=lm"])
    with pytest.raises(ValueError, match="parallel.zero_stage < 3"):
        compose(["recipe=tiny_grpo", "parallel.zero_stage=3"])
    with pytest.raises(ValueError, match="train.grpo_group=1"):
        compose(["recipe=tiny_grpo", "train.grpo_group=1"])
    with pytest.raises(ValueError, match="data.tasks: unknown task"):
        compose(["recipe=tiny_grpo", "data.tasks=[needle]"])
    with pytest.raises(ValueError, match="train.grpo_reward='f1'"):
        compose(["recipe=tiny_grpo", "train.grpo_reward=f1"])
    for extra in ("eval.retrieval=[passkey]", "model.nsa_init=distill"):
        with pytest.raises(ValueError, match="train.objective=grpo trains on prompts"):
            compose(["recipe=tiny_grpo", "attention=nsa", "data.eval_fraction=0.1", extra])
    with pytest.raises(ValueError, match="raise train.seq_len"):
        train([*RUN, "train.seq_len=128", f"train.output_dir={tmp_path}"])


def test_prompt_records_from_files(tmp_path):
    """data.format=prompts: {prompt, answer} records; long prompts follow data.long_prompt; a hold-out."""
    from msa_train.data import build_packed_datasets, byte_tokenizer

    path = tmp_path / "p.jsonl"
    rows = [{"prompt": f"question {i}: " + "x" * (300 if i == 3 else 10), "answer": str(i)} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = byte_tokenizer()
    cfg = compose(["recipe=tiny_grpo", "data.format=prompts", f"data.path={path}", "data.eval_fraction=0.2"]).data
    train_ds, eval_ds = build_packed_datasets(cfg, tok, 128)
    assert len(train_ds) == 8 and len(eval_ds) == 2
    items = [train_ds[i] for i in range(8)] + [eval_ds[i] for i in range(2)]
    assert sorted(int(it["answer"]) for it in items) == list(range(10))
    assert max(len(it["prompt_ids"]) for it in items) == 128  # the long one kept its end
    assert all(it["prompt_ids"][0] == tok.bos_token_id for it in items if len(it["prompt_ids"]) < 128)
    import dataclasses
    dropped, _ = build_packed_datasets(dataclasses.replace(cfg, long_prompt="drop", eval_fraction=0.0), tok, 128)
    assert len(dropped) == 9
    with pytest.raises(ValueError, match="data.long_prompt=error"):
        build_packed_datasets(dataclasses.replace(cfg, long_prompt="error", eval_fraction=0.0), tok, 128)
    path.write_text(json.dumps({"prompt": "p"}) + "\n")
    with pytest.raises(ValueError, match="answer"):
        build_packed_datasets(dataclasses.replace(cfg, eval_fraction=0.0), tok, 128)
    path.write_text(json.dumps({"prompt": "x" * 300, "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="no training prompts are left .*data.long_prompt=drop"):
        build_packed_datasets(dataclasses.replace(cfg, long_prompt="drop", eval_fraction=0.0), tok, 128)


def test_the_planner_plans_a_grpo_step_as_its_packed_group():
    """A GRPO step trains grpo_group x (prompt + completion) tokens per prompt with per-token losses:
    planned as that sequence in the recompute form (the fused head's weight gradient is not held)."""
    from msa_train.parallel.planner import plan_of_config

    base = ["recipe=llama3_8b_64k", "attention=fmsa", "model.lora.r=16", "train.seq_len=16384"]
    grpo = [*base, "data=retrieval", "train.grpo_group=8", "train.grpo_max_new_tokens=32"]
    no_kl = plan_of_config(compose([*grpo, "train.grpo_beta=0"]), on_cuda=True)
    lm = plan_of_config(compose([*base, "data=generated", "train.seq_len=131328", "train.loss_impl=recompute"]),
                        on_cuda=True)
    assert no_kl.peak_gb == pytest.approx(lm.peak_gb) and no_kl.peak_gb > 2 * plan_of_config(
        compose([*base, "data=generated"]), on_cuda=True).peak_gb
    # with a KL term, the trainable parameters' starting values (bf16) on every GPU: LoRA's, or all weights
    for lora in ("model.lora.r=16", "model.lora.r=0"):
        kl = plan_of_config(compose([*grpo, lora]), on_cuda=True)
        zero = plan_of_config(compose([*grpo, lora, "train.grpo_beta=0"]), on_cuda=True)
        ref = kl.parts["reference_weights"]
        assert kl.peak_gb == pytest.approx(zero.peak_gb + ref) and zero.parts["reference_weights"] == 0
        if lora == "model.lora.r=0":  # full fine-tuning: a second copy of the (ZeRO-2: whole, bf16) weights
            assert ref == pytest.approx(kl.parts["parameters"])
        else:
            assert 0 < ref < 0.05 * kl.parts["parameters"]


def test_a_grpo_run_from_a_trained_model_keeps_its_training_document_record(tmp_path):
    """Prompts are no documents, but the starting model's record of the documents it trained on
    passes on to the GRPO run (and its export), so a later eval.only still checks its hold-out."""
    import numpy as np

    from msa_train.evaluation import TRAINING_DOCUMENTS

    train(["recipe=tiny", "attention=full", "train.steps=1", "train.seq_len=256", "data.num_docs=8",
           "train.progress=false", f"train.output_dir={tmp_path / 'lm'}"])
    record = np.load(tmp_path / "lm" / "hf" / TRAINING_DOCUMENTS)
    train([*RUN, "train.steps=1", "train.grad_accum=1", "train.grpo_group=2", f"model.path={tmp_path / 'lm' / 'hf'}",
           f"train.output_dir={tmp_path / 'grpo'}"])
    assert np.array_equal(np.load(tmp_path / "grpo" / TRAINING_DOCUMENTS), record) and len(record) == 8
