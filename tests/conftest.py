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

# pytest-xdist workers share the cores: each worker's torch (and the torchrun processes its tests
# start, through OMP_NUM_THREADS) gets its share of them rather than one thread per core each, which
# oversubscribed CI's 2 cores (a GRPO test took 230 s in the suite and 51 s alone)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and not torch.cuda.is_available():
    _share = max(1, (os.cpu_count() or 1) // _workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    torch.set_num_threads(_share)

import pytest  # noqa: E402


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): one pytest worker per core, at most 4. The interpreted kernels
    run one core each, so on CI's 2 cores the suite takes about half the time; past 4 the
    multi-process tests (up to 4 ranks each) would crowd the machine."""
    return max(1, min(4, os.cpu_count() or 1))


@pytest.fixture(scope="session", autouse=True)
def _own_extension_builds(tmp_path_factory):
    """DeepSpeed's C++ extensions (cpu_adam) build into this run's own directory, one for all its
    workers (an xdist worker's base directory sits in the run's), never into the user's cache: a
    build killed in an earlier run there leaves a lock that the trainer refuses
    (tests/msa_train/test_extension_builds.py), and once left CI waiting on it for 90 minutes."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root / "torch_extensions")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _construction_left_as_found():
    """What a test leaves behind must not change how later tests of its worker build modules. In CI a
    worker lost meta-device construction part-way through the suite (later model dry runs allocated,
    one was OOM-killed building Qwen3-14B): this fails the test after which it happens, naming what
    changed. DeepSpeed's zero.Init, which patches module construction process-wide until its context
    exits, is also lifted then, so the tests after it run as alone."""
    yield
    import sys

    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    if pp is not None and getattr(pp, "top_level_context", None) is not None:
        pp.top_level_context.unpatch_init_and_builtins()
        pp.top_level_context, pp.zero_init_context = None, 0
        pytest.fail("this test left DeepSpeed's zero.Init in force (its patches were lifted afterwards)")
    with torch.device("meta"):
        probe = torch.nn.Linear(2, 2)
    if probe.weight.is_meta:
        return
    init = torch.nn.Linear.__init__
    pytest.fail("after this test a module built under torch.device('meta') has parameters on "
                f"{probe.weight.device}: nn.Linear.__init__ is {getattr(init, '__module__', '?')}."
                f"{getattr(init, '__qualname__', init)}, torch.empty is {getattr(torch.empty, '__module__', '?')}."
                f"{getattr(torch.empty, '__qualname__', torch.empty)}, torch function enabled: "
                f"{torch._C._is_torch_function_enabled()}, function-mode stack: {torch._C._len_torch_function_stack()}, "
                f"default device: {torch.get_default_device()}, weight type: {type(probe.weight).__name__}, "
                f"ds attrs: {[a for a in vars(probe.weight) if a.startswith('ds_')][:5]}")


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"
