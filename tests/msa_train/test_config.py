"""Config errors fail before any work, naming the key and the allowed values; every recipe composes."""
import dataclasses
import os
import re

import pytest

from msa_train.config import ParallelConfig, TrainConfig
from msa_train.parallel import build_deepspeed_config
from tests.msa_train._util import compose, run_cli

RECIPES = ["tiny", "tiny_qwen3", "tiny_grpo", "llama3_8b_64k", "qwen3_14b_1m", "qwen25_32b_128k", "llama3_8b_sft_longdoc",
           "llama3_8b_lora_longdoc", "quality_170m"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    extra = [] if recipe.startswith("tiny") else ["data.path=/data/docs.jsonl"]
    if recipe.startswith("quality"):  # its retrieval grid draws haystacks from held-out documents
        extra.append("data.eval_fraction=0.01")
    cfg = compose([f"recipe={recipe}", *extra])
    assert cfg.recipe_name == recipe
    assert cfg.model.hf_config or cfg.model.path


def test_bare_config_is_tiny_with_nsa_auto():
    cfg = compose([])
    assert cfg.recipe_name == "tiny" and cfg.model.model_type == "llama" and cfg.attention.name == "auto"


@pytest.mark.parametrize("override, expected", [
    ("attention.name=sparse", "attention.name='sparse' is not allowed; choose one of: full, nsa, fmsa, auto"),
    ("parallel.zero_stage=4", "parallel.zero_stage=4 is not allowed; choose one of: 0, 1, 2, 3"),
    ("train.precision=fp8", "train.precision='fp8' is not allowed; choose one of: auto, bf16, fp32"),
    ("logger.name=tensorboard", "logger.name='tensorboard' is not allowed; choose one of: none, wandb"),
    ("model.model_type=gpt2", "model.model_type='gpt2' is not allowed; choose one of: llama, qwen2, qwen3"),
    ("attention.slc_block=48", "slc_block must be one of (16, 32, 64, 128)"),
    ("parallel.offload_params=true", "parallel.offload_params=true needs parallel.zero_stage=3"),
    ("parallel.offload_activations=true",
     "parallel.offload_activations=true needs parallel.activation_checkpointing=true"),
    ("parallel.offload_ratio=0", "parallel.offload_ratio=0.0 is not allowed; expected a fraction in (0, 1]"),
    ("parallel.offload_ratio=0.5", "parallel.offload_ratio=0.5 (a partial offload) needs parallel.offload_optimizer=true, "
     "parallel.zero_stage=3 and parallel.optimizer=deepspeed"),
    ("parallel.tile_tokens=-8", "parallel.tile_tokens=-8 is not allowed; expected an integer >= 0 (0: no tiling)"),
    ("train.lr=inf", "train.lr=inf is not allowed; expected a finite number"),
    ("train.grad_clip=nan", "train.grad_clip=nan is not allowed; expected a finite number"),
    ("train.min_lr_ratio=nan", "train.min_lr_ratio=nan is not allowed; expected a finite number"),
    ("train.dpo_beta=inf", "train.dpo_beta=inf is not allowed; expected a finite number"),
    ("train.betas=[0.9,inf]", "train.betas[1]=inf is not allowed; expected a finite number"),
    ("train.weight_decay=-5", "train.weight_decay=-5.0 is not allowed; expected a float >= 0"),
    ("parallel.timeout_s=0", "parallel.timeout_s=0.0 is not allowed; expected seconds > 0"),
    ("+trian.lr=1", "unknown setting: +trian.lr (did you mean train.lr?)"),
    ("+train.lrr=1", "unknown setting: +train.lrr (did you mean train.lr?)"),
])
def test_bad_value_names_key_and_choices(override, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        compose([override])


def test_free_form_hf_config_takes_new_keys():
    assert compose(["+model.hf_config.pretraining_tp=1"]).model.hf_config["pretraining_tp"] == 1


def test_unknown_key_and_type_errors_are_caught_at_composition():
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ConfigKeyError

    with pytest.raises((ConfigCompositionException, ConfigKeyError), match="train.stepz"):
        compose(["train.stepz=3"])
    with pytest.raises(ConfigCompositionException, match="train.steps"):
        compose(["train.steps=many"])


def test_cli_reports_errors_before_any_work_and_help_lists_recipes(tmp_path):
    out = run_cli(["attention=sparse", f"train.output_dir={tmp_path / 'run'}"])
    assert out.returncode == 2
    assert "config group 'attention' has: auto, fmsa, full, nsa" in out.stderr
    out = run_cli(["train.seq_len=0", f"train.output_dir={tmp_path / 'run'}"])
    assert out.returncode != 0 and "train.seq_len=0 is not allowed" in out.stderr
    assert not (tmp_path / "run").exists()  # failed before creating anything
    out = run_cli(["--help"])
    assert out.returncode == 0
    for recipe in RECIPES:
        assert recipe in out.stdout


def test_deepspeed_launchers_local_rank_argument_is_taken_not_passed_to_hydra(monkeypatch):
    from msa_train.cli import take_launcher_args

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert take_launcher_args(["--local_rank=3", "train.steps=2"]) == ["train.steps=2"]
    assert os.environ["LOCAL_RANK"] == "3"
    monkeypatch.setenv("LOCAL_RANK", "1")  # the launcher's environment wins
    assert take_launcher_args(["train.steps=2", "--local-rank", "5"]) == ["train.steps=2"]
    assert os.environ["LOCAL_RANK"] == "1"
    with pytest.raises(SystemExit, match="--local_rank must be a non-negative integer, got 'x'"):
        take_launcher_args(["--local_rank=x"])
    with pytest.raises(SystemExit, match="--local_rank needs a value"):
        take_launcher_args(["--local_rank"])
    out = run_cli(["--local_rank=0", "recipe=tiny", "--cfg", "job"])  # as `deepspeed --module` runs it
    assert out.returncode == 0, out.stderr
    assert "local_rank" not in out.stdout and "recipe_name: tiny" in out.stdout


def test_a_partial_offload_is_a_zero3_json_that_deepspeed_accepts():
    """``parallel.offload_ratio`` reaches DeepSpeed's offload config, with sub-groups small enough for
    the split to land near the ratio; DeepSpeed's own config model validates the result."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from msa_train.parallel.deepspeed_config import PARTIAL_OFFLOAD_SUB_GROUP

    par = ParallelConfig(zero_stage=3, offload_optimizer=True, offload_ratio=0.8, optimizer="deepspeed")
    zero = build_deepspeed_config(par, TrainConfig(), world_size=1, bf16=True)["zero_optimization"]
    assert zero["offload_optimizer"]["ratio"] == 0.8 and zero["sub_group_size"] == PARTIAL_OFFLOAD_SUB_GROUP
    parsed = DeepSpeedZeroConfig(**zero)
    assert parsed.offload_optimizer.ratio == 0.8 and parsed.stage == 3
    full = build_deepspeed_config(dataclasses.replace(par, offload_ratio=1.0), TrainConfig(), world_size=1, bf16=True)
    assert "ratio" not in full["zero_optimization"]["offload_optimizer"] and "sub_group_size" not in full["zero_optimization"]


def test_deepspeed_json_is_generated_from_the_typed_config():
    ds = build_deepspeed_config(ParallelConfig(zero_stage=3, offload_optimizer=True, offload_params=True),
                                TrainConfig(grad_accum=4, grad_clip=0.5, lr=1e-4, steps=100, warmup_steps=10),
                                world_size=8, bf16=True)
    assert ds["train_batch_size"] == 32 and ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"]
    assert ds["optimizer"]["params"]["torch_adam"] and not ds["zero_force_ds_cpu_optimizer"]
    assert ds["scheduler"]["type"] == "WarmupCosineLR" and ds["scheduler"]["params"]["total_num_steps"] == 100
