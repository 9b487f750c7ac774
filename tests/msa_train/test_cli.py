"""The CLI reports user errors as one line (exit 2) and bugs with their traceback; --help shows whole sentences."""
import sys

import torch
import torch.distributed

import pytest

from msa_train import cli
from tests.msa_train._util import run_cli
from tests.msa_train.test_config import RECIPES


def _main(monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "argv", ["msa-train", *argv])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["train.lr=inf"], "train.lr=inf is not allowed; expected a finite number"),
    (["trian.lr=1"], "trian.lr: no such setting (did you mean train.lr?)"),
    (["atention=full"], "atention: no such setting (did you mean attention?)"),
    (["+trian.lr=1"], "unknown setting: +trian.lr (did you mean train.lr?)"),
    (["attention=sparse"], "Could not find 'attention/sparse'; config group 'attention' has: auto, fmsa, full, nsa"),
    (["train.steps=many"], "train.steps=many: Value 'many' of type 'str' could not be converted to Integer"),
], ids=["validation", "misspelt-key", "misspelt-group", "plus-typo", "group-option", "type"])
def test_user_errors_are_one_line_and_exit_2(monkeypatch, capsys, argv, expected):
    code, err = _main(monkeypatch, capsys, *argv)
    assert code == 2
    assert err.strip() == f"msa-train: error: {err.strip().removeprefix('msa-train: error: ')}"
    assert expected in err and "Traceback" not in err and "Error executing job" not in err, err
    assert "+trian.lr=1" not in err.replace("unknown setting: +trian.lr", "")  # Hydra's "+key" hint is gone


def test_a_process_group_of_the_caller_stays_up_and_errors_exit_normally(monkeypatch, capsys, tmp_path):
    """An in-process caller's process group (a test's, an earlier Trainer's) is not this run's:
    the CLI neither ends the process for it (os._exit would take pytest's worker down) nor tears it down."""
    mine = not torch.distributed.is_initialized()
    if mine:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(cli.os, "_exit", lambda code: pytest.fail(f"os._exit({code}) for the caller's group"))
    try:
        code, err = _main(monkeypatch, capsys, "train.lr=inf")
        assert code == 2 and "train.lr=inf" in err
        assert torch.distributed.is_initialized()
    finally:
        if mine:
            torch.distributed.destroy_process_group()


def test_a_plan_that_does_not_fit_exits_3_and_names_the_gpus_it_would_fit(monkeypatch, capsys, tmp_path):
    """`train.plan=true` as a script's check before it launches: exit 0 when the plan fits, 3 when not."""
    plan = ["recipe=llama3_8b_64k", "train.plan=true", "train.plan_gpu_gb=139", f"train.output_dir={tmp_path}"]
    code, _ = _main(monkeypatch, capsys, *plan, "train.plan_world_size=1")
    assert code == cli.PLAN_DOES_NOT_FIT == 3
    monkeypatch.setattr(sys, "argv", ["msa-train", *plan])  # the recipe's own world size: two GPUs
    cli.main()
    assert "(train.plan_world_size=2)" not in capsys.readouterr().out


def test_full_error_keeps_the_traceback_and_bugs_keep_theirs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["msa-train", "train.lr=inf"])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" in err and "msa-train: error: train.lr=inf" in err

    def bug(cfg):
        return {}["missing"]  # a KeyError deep in the run: not the user's
    monkeypatch.setattr(cli, "run", bug)
    monkeypatch.delenv("HYDRA_FULL_ERROR")
    monkeypatch.setattr(sys, "argv", ["msa-train"])
    with pytest.raises(KeyError):
        cli.main()
    monkeypatch.setattr(cli, "run", lambda cfg: int("x"))  # a ValueError raised outside msa_train: a bug too
    with pytest.raises(ValueError):
        cli.main()


def test_a_data_error_is_one_line_naming_the_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = run_cli(["data.format=pretrain", f"data.path={empty}", f"train.output_dir={tmp_path / 'run'}"])
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"msa-train: error: data: {empty} holds no records" in out.stderr
    assert "Traceback" not in out.stderr and "Error executing job" not in out.stderr


def test_help_shows_each_recipes_first_sentence_whole():
    lines = cli._recipe_lines().splitlines()
    entries, current = {}, None
    for line in lines:
        name = line[2:26].strip()
        if name:
            current = name
            entries[name] = line[26:]
        else:
            entries[current] += " " + line.strip()
    assert sorted(entries) == sorted(RECIPES)
    for name, text in entries.items():
        assert text.endswith("."), (name, text)
    assert entries["qwen25_32b_128k"].startswith("Qwen2.5-32B (G = 5, q/k/v biases) at 128K tokens")
    assert "(e.g. torchrun --nproc-per-node 8)." in entries["qwen25_32b_128k"]
    # a full stop inside backquoted code ("model.path=... data.path=...") does not end the sentence
    assert entries["qwen3_14b_1m"].endswith("recipe=qwen3_14b_1m model.path=... data.path=...`.")
    assert all(len(line) <= 100 for line in lines)


def test_a_run_stopped_on_a_non_finite_value_is_one_line_and_exit_1(monkeypatch, capsys):
    from msa_train.trainer import NonFiniteError

    def stopped(cfg):
        raise NonFiniteError("train.on_nonfinite=stop: at step 3 grad_norm=inf not finite")

    monkeypatch.setattr(cli, "run", stopped)
    code, err = _main(monkeypatch, capsys)
    assert code == 1 and err.strip() == "msa-train: error: train.on_nonfinite=stop: at step 3 grad_norm=inf not finite"
