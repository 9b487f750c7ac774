"""``msa-train recipe=NAME key=value ...``: the Hydra entry point.

Configs are found relative to the package, so the command works from any working directory:
a regular install ships them inside it (``msa_train/_configs``, ``msa_train/_recipes``), an
editable install reads them in place (``<repo>/configs``, ``<repo>/recipes``). Recipes are
registered as the ``recipe`` config group (``recipe=tiny`` is the default).
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import msa_train

PACKAGE = Path(msa_train.__file__).resolve().parent
_INSTALLED = (PACKAGE / "_configs" / "config.yaml").is_file()
CONFIG_DIR = PACKAGE / "_configs" if _INSTALLED else PACKAGE.parent / "configs"
RECIPE_DIR = PACKAGE / "_recipes" if _INSTALLED else PACKAGE.parent / "recipes"

HELP = """msa-train: long-context training with Native Sparse Attention (Hydra CLI).

Usage: msa-train [recipe=NAME] [group=option ...] [key=value ...]

Recipes (recipe=NAME, default tiny):
{recipes}

Config groups (group=option):
$APP_CONFIG_GROUPS
Examples:
  msa-train                                        # recipe=tiny on CPU or GPU
  msa-train attention=full train.steps=100
  msa-train recipe=llama3_8b_64k model.path=/models/llama3-8b data.path=/data/docs.jsonl
  torchrun --nproc-per-node 2 -m msa_train.cli parallel=zero2
  msa-train recipe=tiny_qwen3 --cfg job            # print the composed config and exit
"""


def _first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence: one followed by a space or the end, outside
    parentheses and backquoted code (so "(e.g. torchrun ...)" and "`... model.path=... data.path=...`"
    do not end it)."""
    depth, code = 0, False
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        code ^= ch == "`"
        if ch == "." and depth <= 0 and not code and (i + 1 == len(text) or text[i + 1] == " "):
            return text[:i + 1]
    return text


def _recipe_lines(width: int = 100) -> str:
    """Each recipe with the first sentence of its header comment, wrapped under its name."""
    import textwrap

    lines = []
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        doc = []
        for ln in path.read_text().splitlines():
            if not ln.startswith("#"):
                break  # the header comment ends at the first line of YAML
            if not ln.startswith("# @package"):
                doc.append(ln[1:].strip())
        text = " ".join(doc)
        if text.startswith(f"{path.stem}: "):
            text = text[len(path.stem) + 2:]
        lines.append(textwrap.fill(_first_sentence(text), width, initial_indent=f"  {path.stem:<24}",
                                   subsequent_indent=" " * 26))
    return "\n".join(lines)


def register_recipes() -> None:
    """Store every ``recipes/*.yaml`` in Hydra's ConfigStore as the ``recipe`` group (package _global_)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    for path in sorted(RECIPE_DIR.glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


def register_all() -> None:
    """Schemas, recipes and the help page, in Hydra's ConfigStore (idempotent)."""
    from msa_train.config import register_configs

    register_configs()
    register_recipes()
    _register_help(HELP.replace("{recipes}", _recipe_lines()))


def compose(overrides=(), typed: bool = True):
    """The config ``msa-train OVERRIDES`` would run, through Hydra's compose API (for scripts and
    tests): validated into the typed ``RootConfig``, or with ``typed=False`` Hydra's DictConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from msa_train.config import to_typed

    register_all()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    return to_typed(cfg) if typed else cfg


def run(cfg) -> dict:
    """Validate the composed config and train (or evaluate, with eval.only). Returns the run summary."""
    import torch

    from msa_train.config import to_typed
    from msa_train.trainer import Trainer

    typed = to_typed(cfg)  # every __post_init__ check runs here, before any work
    _quiet_libraries()
    if typed.train.plan:  # the memory planner: no GPU touched, no weights built
        from msa_train.parallel.planner import print_plan

        return print_plan(typed).to_dict()
    try:
        summary = Trainer(typed).run()
    except torch.OutOfMemoryError as e:  # same type and message, plus what to turn on
        from msa_train.parallel.memory import out_of_memory_hint

        raise torch.OutOfMemoryError(f"{e}\n\nmsa-train: {out_of_memory_hint(typed)}") from e
    except RuntimeError as e:  # a collective that timed out or lost its peer: which rank, and the setting
        from msa_train.parallel.distributed import peer_lost

        lost = peer_lost(e, typed.parallel.timeout_s)
        if lost is None:
            raise
        raise lost from e
    return summary


def _shutdown_distributed() -> bool:
    """All ranks done: tear the process groups down before the interpreter exits, and say whether
    there were any. Left to exit, the communicators' threads (gloo's, several groups with sequence
    parallelism) can be destroyed while running, which aborts the process ("terminate called without
    an active exception")."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    dist.barrier()
    dist.destroy_process_group()
    return True


def _exit_after_distributed_run() -> None:
    """End a finished distributed run's process without the interpreter's finalisation. Destroying
    the process groups was not enough: twice in CI (a 4-process sequence-parallel run, later a
    2-process ZeRO-3 one) a rank aborted at exit after its run had finished, with "terminate called
    without an active exception", and torchrun reported the run as failed. Gloo's worker threads can
    still hold work objects (and tensors) that some Python object references, such as DeepSpeed's
    pending collective handles; destroyed during finalisation they take the GIL of an interpreter
    being torn down (pytorch/pytorch#179291). Everything the run writes is closed and on disk by now
    (checkpoints, hf/, metrics, the logger), so the streams are flushed and the process ends with 0."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _quiet_libraries() -> None:
    """Hydra sets the root logger to INFO; keep third-party INFO chatter (DeepSpeed's op probes,
    compiler checks) out of the terminal, keep msa_train's own messages."""
    import torch

    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("msa_train").setLevel(logging.INFO)
    if not torch.cuda.is_available():
        # deepspeed/accelerator/real_accelerator.py warns "Setting accelerator to CPU. If you have GPU
        # ... we were unable to detect it" on every CPU run: without CUDA in torch, the CPU is the
        # only choice and the trainer's model line says where it runs. With CUDA the warning stays.
        logging.getLogger("DeepSpeed").addFilter(_DropMessage("Setting accelerator to CPU"))


class _DropMessage(logging.Filter):
    """Drops the records whose message contains ``text`` (one known, harmless library message)."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def take_launcher_args(argv: list[str]) -> list[str]:
    """Drop the ``--local_rank=N`` (or ``--local-rank N``) that the ``deepspeed`` launcher (and
    the legacy ``torch.distributed.launch``) append to the command line, which Hydra would reject
    as an override; ``LOCAL_RANK``, which those launchers also set, is taken from it if missing."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--local_rank", "--local-rank"):
            if not eq:  # "--local_rank N"
                if i + 1 >= len(argv):
                    raise SystemExit(f"msa-train: {name} needs a value")
                value, i = argv[i + 1], i + 1
            if not value.isdigit():
                raise SystemExit(f"msa-train: {name} must be a non-negative integer, got {value!r}")
            os.environ.setdefault("LOCAL_RANK", value)
        else:
            out.append(arg)
        i += 1
    return out


def is_user_error(e: BaseException) -> bool:
    """Errors of the configuration or the data, which the message alone explains: Hydra's and
    OmegaConf's composition errors, and the ValueError / TypeError that msa_train and flash_msa raise
    on purpose (their innermost frame is in these packages; one from deep inside torch is a bug)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(e, (HydraException, OmegaConfBaseException)):
        return True
    return isinstance(e, (ValueError, TypeError)) and _raised_by_us(e)


def _raised_by_us(e: BaseException) -> bool:
    """Whether the innermost frame of ``e`` is in msa_train or flash_msa."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    ours = (str(PACKAGE), str(Path(flash_msa_dir()).resolve()))
    return tb is None or str(Path(tb.tb_frame.f_code.co_filename).resolve()).startswith(ours)


def flash_msa_dir() -> str:
    import flash_msa

    return str(Path(flash_msa.__file__).parent)


def error_message(e: BaseException) -> str:
    """The message of a user error, with Hydra's composition errors made specific: the options of a
    group, or a did-you-mean for a misspelt key (Hydra's own hint, ``+key``, would add it)."""
    import re

    from hydra.errors import HydraException, MissingConfigException

    from msa_train.config import did_you_mean

    text = str(e).strip()
    if isinstance(e, MissingConfigException) and e.options:
        group = re.search(r"Could not find '([^'/]+)/", text)
        first = text.splitlines()[0].removeprefix("In 'config': ")
        return f"{first}; {'config group ' + repr(group.group(1)) + ' has' if group else 'choose one of'}: " \
               f"{', '.join(sorted(e.options))}"
    missing = re.match(r"Could not override '([^']+)'", text)
    if missing and "To append to your config use +" in text:
        key = missing.group(1)
        return f"{key}: no such setting{did_you_mean(key) or ''}; `msa-train --cfg job` prints every setting"
    cause = e.__cause__  # Hydra's composition errors keep OmegaConf's reason in their cause
    if isinstance(e, HydraException) and cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text = f"{text.splitlines()[0]}: {str(cause).strip().splitlines()[0]}"
    return text


# exit status of `train.plan=true` when the plan does not fit (2 is a user error, 1 a failed run), so a
# script can plan before it launches: `msa-train ... train.plan=true && torchrun ...`
PLAN_DOES_NOT_FIT = 3


def main() -> None:
    import hydra

    sys.argv[1:] = take_launcher_args(sys.argv[1:])

    if not (CONFIG_DIR / "config.yaml").is_file() or not RECIPE_DIR.is_dir():
        raise SystemExit(f"msa-train: no configs at {CONFIG_DIR} / recipes at {RECIPE_DIR}: the installation is "
                         "incomplete; reinstall msa-train (pip install <repo>, or pip install -e <repo>).")
    register_all()

    previous = os.environ.get("HYDRA_FULL_ERROR")
    full_error = previous == "1"
    import torch.distributed as dist

    # The process groups this invocation may tear down, and end the process for, are the ones its
    # run brings up. One already up belongs to the caller (an in-process test): it stays, and
    # errors exit through SystemExit as usual.
    own_groups = not (dist.is_available() and dist.is_initialized())
    ended_distributed = False

    @hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
    def _app(cfg) -> None:
        nonlocal ended_distributed
        try:
            summary = run(cfg)
            ended_distributed = own_groups and _shutdown_distributed()
        except Exception as e:  # here, before Hydra adds its "Error executing job" line
            _report(e, full_error, own_groups)
        else:
            if cfg.train.plan and not summary["fits"]:
                raise SystemExit(PLAN_DOES_NOT_FIT)

    # Hydra hands a failed composition to its caller only under HYDRA_FULL_ERROR=1; otherwise it prints
    # it and exits 1 itself, and user errors could not be told from bugs. So it is set for the call, and
    # whether the user had set it decides whether a user error shows its traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _app()
    except Exception as e:
        _report(e, full_error, own_groups)
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
    if ended_distributed:
        _exit_after_distributed_run()


def _report(e: Exception, full_error: bool, own_groups: bool) -> None:
    """A user error (exit 2) or a lost peer (exit 1) as one line "msa-train: error: ...", its traceback
    only with HYDRA_FULL_ERROR=1; anything else is a bug and raises on with its traceback (exit 1).
    ``own_groups``: a process group up now was brought up by this invocation (see :func:`_exit`)."""
    from msa_train.parallel.distributed import PeerLost
    from msa_train.trainer import NonFiniteError

    user = is_user_error(e)
    # a lost peer, a run that stopped on a non-finite value, or a write that failed (a full disk),
    # explained by msa_train: one line, exit 1
    reported = isinstance(e, (PeerLost, NonFiniteError)) or (isinstance(e, OSError) and _raised_by_us(e))
    if not (user or reported):
        raise e
    if full_error:
        import traceback

        traceback.print_exception(e)
    print(f"msa-train: error: {error_message(e)}", file=sys.stderr, flush=True)
    _exit(2 if user else 1, own_groups)


def _exit(code: int, own_groups: bool) -> None:
    """Exit with ``code``. With a process group of this run still up (a rank failed mid-run, its
    peers may be gone), skip the interpreter's finalisation, which would tear down communicator
    threads that are still running (see _exit_after_distributed_run)."""
    import torch.distributed as dist

    if own_groups and dist.is_available() and dist.is_initialized():
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    sys.exit(code)


def _register_help(text: str) -> None:
    """``msa-train --help`` lists the recipes (configs/config.yaml selects hydra/help=msa_train)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="hydra/help", name="msa_train",
                                 node={"app_name": "msa-train", "header": "", "footer": "", "template": text})


if __name__ == "__main__":
    main()
