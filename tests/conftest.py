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


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"
