"""train.lr_schedule=wsd: warm-up, the full rate, then a cosine over the last decay_fraction of the steps."""
import math

import pytest
import torch

from tests.msa_train._util import FAST, train


def _rates(schedule, steps):
    schedule.step(0)  # as the trainer starts it
    out = []
    for _ in range(steps):
        out.append(schedule.get_last_lr()[0])
        schedule.step()
    return out


def test_wsd_warms_up_holds_then_decays_to_the_floor():
    from msa_train.parallel.lr_schedule import WarmupStableDecayLR

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    rates = _rates(WarmupStableDecayLR(opt, total_num_steps=20, decay_num_steps=5, warmup_num_steps=4,
                                       warmup_min_ratio=0.25, cos_min_ratio=0.1, warmup_type="linear"), 20)
    assert rates[:4] == pytest.approx([0.25, 0.4375, 0.625, 0.8125])  # DeepSpeed's linear warm-up
    assert rates[4:15] == [1.0] * 11  # stable
    decay = [0.1 + 0.9 * (1 + math.cos(math.pi * k / 5)) / 2 for k in range(1, 6)]
    assert rates[15:] == pytest.approx(decay) and rates[-1] == pytest.approx(0.1)  # the last step at the floor


def test_wsd_in_the_trainer_follows_the_schedule_and_resumes_exactly(tmp_path):
    common = ["attention=full", "train.steps=10", "train.warmup_steps=2", "train.lr=1e-3", "train.min_lr_ratio=0.0",
              "train.lr_schedule=wsd", "train.decay_fraction=0.4", "train.save_every=0", *FAST]
    _, full = train([*common, f"train.output_dir={tmp_path / 'a'}"])
    lrs = [r["lr"] for r in full]
    assert lrs[:6] == pytest.approx([5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3, 1e-3])  # the warm-up ends at iteration 2
    assert lrs[6:] == pytest.approx([1e-3 * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(1, 5)], abs=1e-12)
    train([*common, f"train.output_dir={tmp_path / 'b'}"], stop_after=7)  # stopped inside the decay
    summary, resumed = train([*common, f"train.output_dir={tmp_path / 'b'}", "train.resume=auto"])
    assert summary["resumed_from"].endswith("step_000007")
    for a, b in zip(full, resumed):
        assert a["lr"] == pytest.approx(b["lr"], abs=1e-12) and a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    with pytest.raises(ValueError, match=r"train.lr_schedule: 'wsd' -> 'cosine'"):  # another schedule: refused
        train([*common, "train.lr_schedule=cosine", f"train.output_dir={tmp_path / 'b'}", "train.resume=auto"])


def test_bad_schedule_settings_name_themselves():
    from msa_train.config import TrainConfig

    with pytest.raises(ValueError, match="train.lr_schedule"):
        TrainConfig(lr_schedule="linear")
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="train.decay_fraction"):
            TrainConfig(decay_fraction=bad)


def test_wsd_edges_decay_at_least_one_step_and_never_into_the_warm_up():
    from types import SimpleNamespace

    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    from msa_train.parallel.deepspeed_config import _scheduler
    from msa_train.parallel.lr_schedule import WarmupStableDecayLR

    def rates(cls, **params):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        return _rates(cls(opt, **params), params["total_num_steps"])

    def params(steps, warmup, fraction):
        cfg = SimpleNamespace(steps=steps, warmup_steps=warmup, min_lr_ratio=0.1, lr_schedule="wsd",
                              decay_fraction=fraction)
        return _scheduler(cfg)["params"]

    # a tenth of 4 steps: still one step of decay, the last at the floor
    assert params(4, 1, 0.1)["decay_num_steps"] == 1 and rates(WarmupStableDecayLR, **params(4, 1, 0.1))[-1] == 0.1
    # a decay longer than the steps after the warm-up is the cosine over all of them: no drop at its end
    whole = {k: v for k, v in params(100, 50, 1.0).items() if k != "decay_num_steps"}
    assert rates(WarmupStableDecayLR, **params(100, 50, 1.0)) == pytest.approx(rates(WarmupCosineLR, **whole))
    short = {k: v for k, v in params(10, 6, 0.5).items() if k != "decay_num_steps"}  # 5 decay steps, 4 after it
    assert rates(WarmupStableDecayLR, **params(10, 6, 0.5)) == pytest.approx(rates(WarmupCosineLR, **short))


def test_a_cosine_run_resumes_whatever_its_unused_decay_fraction():
    from msa_train.trainer import check_resume_config

    run = {"train": {"lr_schedule": "cosine", "decay_fraction": 0.2}}
    check_resume_config(run, {"train": {"lr_schedule": "cosine", "decay_fraction": 0.5}}, "ck")
    with pytest.raises(ValueError, match=r"train.decay_fraction: 0.2 -> 0.5"):
        check_resume_config({"train": {"lr_schedule": "wsd", "decay_fraction": 0.2}},
                            {"train": {"lr_schedule": "wsd", "decay_fraction": 0.5}}, "ck")
