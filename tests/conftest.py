"""Test-wide setup.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before
any flash_msa kernel module is imported: without CUDA every Triton kernel runs in
the CPU interpreter, which is how CI checks the kernels against their references.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")

import pytest  # noqa: E402


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): one pytest worker per core, at most 4. The interpreted kernels
    run one core each, so on CI's 2 cores the suite takes about half the time; past 4 the
    multi-process tests (up to 4 ranks each) would crowd the machine."""
    return max(1, min(4, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_zero_init_left_in_force():
    """DeepSpeed's zero.Init patches module construction process-wide until its context exits. A test
    that leaves it in force would make every later test of its worker partition (allocate) whatever it
    builds (in CI a Qwen3-14B meta-device count got OOM-killed that way): name that test, and lift the
    patches so the tests after it run as alone."""
    yield
    import sys

    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if pp is None or getattr(pp, "top_level_context", None) is None:
        return
    pp.top_level_context.unpatch_init_and_builtins()
    pp.top_level_context, pp.zero_init_context = None, 0
    pytest.fail("this test left DeepSpeed's zero.Init in force (its patches were lifted afterwards)")


@pytest.fixture(autouse=True)
def _meta_construction_still_works():
    """A module built under ``torch.device("meta")`` has meta parameters. In CI a pytest worker lost
    that part-way through the suite (the model dry runs of later tests allocated, and one was
    OOM-killed building Qwen3-14B): this names the test after which it happens, and what changed."""
    yield
    with torch.device("meta"):
        probe = torch.nn.Linear(2, 2)
    if probe.weight.is_meta:
        return
    import sys

    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    init = torch.nn.Linear.__init__
    pytest.fail("after this test a module built under torch.device('meta') has parameters on "
                f"{probe.weight.device}: nn.Linear.__init__ is {getattr(init, '__module__', '?')}."
                f"{getattr(init, '__qualname__', init)}, torch.empty is {getattr(torch.empty, '__module__', '?')}."
                f"{getattr(torch.empty, '__qualname__', torch.empty)}, torch function enabled: "
                f"{torch._C._is_torch_function_enabled()}, function-mode stack: {torch._C._len_torch_function_stack()}, "
                f"default device: {torch.get_default_device()}, zero.Init context: "
                f"{getattr(pp, 'top_level_context', None)}, weight type: {type(probe.weight).__name__}, "
                f"ds attrs: {[a for a in vars(probe.weight) if a.startswith('ds_')][:5]}")


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"
