"""The end-to-end benchmark's report: JSON + markdown table with speedups over attention=full."""
import json

import pytest
import torch

from msa_train.bench import phase_means, write_outputs


def test_bench_report_tables_speedup_and_failures(tmp_path):
    result = {"recipe": "tiny", "device": "cpu", "attention": ["full", "fmsa"], "seq_lens": [512, 1024],
              "points": [{"attention": "full", "seq_len": 512, "tokens_per_s": 1000.0, "ok": True,
                          "peak_memory_gb": 61.25},
                         {"attention": "fmsa", "seq_len": 512, "tokens_per_s": 2500.0, "ok": True},
                         {"attention": "full", "seq_len": 1024, "tokens_per_s": None, "ok": False, "error": "OOM"},
                         {"attention": "fmsa", "seq_len": 1024, "tokens_per_s": 2000.0, "ok": True}]}
    write_outputs(result, tmp_path / "e2e_tiny_cpu")
    assert json.loads((tmp_path / "e2e_tiny_cpu.json").read_text())["recipe"] == "tiny"
    md = (tmp_path / "e2e_tiny_cpu.md").read_text()
    assert "| 512 | 1,000 | 2,500 | 2.50x |" in md
    assert "| 1,024 | OOM | 2,000 | - |" in md
    assert "| 512 | 61.2 | - |" in md and "| 1,024 | - | - |" in md  # peak memory, where known


def test_oom_message_names_the_allocation():
    from msa_train.bench import _oom

    err = ("Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 GiB. GPU 0 has a "
           "total capacity of 139.81 GiB of which 3.52 GiB is free. Of the allocated memory ...")
    assert _oom(err) == "OOM (16.00 GiB asked, 3.52 GiB free)"
    assert _oom("RuntimeError: something else") is None


def test_bench_report_of_a_partial_run(tmp_path):
    """Written after every point: the points not yet run show as such."""
    result = {"recipe": "tiny", "device": "cpu", "attention": ["full", "fmsa"], "seq_lens": [512, 1024],
              "points": [{"attention": "full", "seq_len": 512, "tokens_per_s": 1000.0, "ok": True}]}
    write_outputs(result, tmp_path / "e2e_tiny_cpu")
    md = (tmp_path / "e2e_tiny_cpu.md").read_text()
    assert "| 512 | 1,000 | not run | - |" in md
    assert "| 1,024 | not run | not run | - |" in md


def test_failed_and_timed_out_points_are_recorded(tmp_path):
    from msa_train.bench import run_point

    bad = run_point("tiny", "sparse", 256, 2, [], tmp_path, timeout=120)  # an unknown attention option
    assert not bad["ok"] and isinstance(bad["error"], str) and "sparse" in bad["error"], bad
    slow = run_point("tiny", "full", 256, 2, [], tmp_path, timeout=1)  # killed before it trains
    assert slow == {"attention": "full", "seq_len": 256, "steps": 2, "ok": False, "error": "timeout after 1 s"}


def test_a_point_on_two_processes_with_sequence_parallelism(tmp_path):
    """--nproc 2: the point runs under torchrun (gloo on CPU), here one sequence over both ranks."""
    from msa_train.bench import run_point

    point = run_point("tiny", "full", 256, 2, ["parallel.sp_degree=2", "data.num_docs=8"], tmp_path, timeout=240,
                      nproc=2)
    assert point["ok"] and point["nproc"] == 2, point.get("error")
    assert point["summary"]["world_size"] == 2 and [r["step"] for r in point["records"]] == [1, 2]
    write_outputs({"recipe": "tiny", "device": "cpu", "attention": ["full"], "seq_lens": [256], "nproc": 2,
                   "points": [point | {"tokens_per_s": 1.0}]}, tmp_path / "e2e")
    md = (tmp_path / "e2e.md").read_text()
    assert "tokens/s of the whole run on 2 processes" in md
    # where the point's time went: the process outlives its startup and its training loop together
    startup = point["summary"]["startup_s"]
    assert point["process_s"] > sum(startup.values()) + point["summary"]["wall_time_s"]
    longest = max(startup, key=startup.get)
    assert f"| full | 256 | {point['process_s']:.1f} | {sum(startup.values()):.1f} | {longest} " in md


def test_phase_seconds_per_step_after_warmup(tmp_path):
    """Records of train.phase_times=true (sums since the last record) become seconds per step."""
    from msa_train.bench import phase_means

    rec = lambda step, f, b, s: {"step": step, "forward_s": f, "backward_s": b, "step_s": s}  # noqa: E731
    every_step = {"ok": True, "records": [rec(1, 9.0, 9.0, 9.0), rec(2, 1.0, 2.0, 3.0), rec(3, 3.0, 4.0, 5.0)]}
    assert phase_means(every_step, warmup=1) == {"forward_s": 2.0, "backward_s": 3.0, "step_s": 4.0}
    every_other = {"ok": True, "records": [rec(2, 9.0, 9.0, 9.0), rec(4, 2.0, 4.0, 6.0)]}  # log_every=2
    assert phase_means(every_other, warmup=2) == {"forward_s": 1.0, "backward_s": 2.0, "step_s": 3.0}
    assert phase_means({"ok": True, "records": [{"step": 1}]}, warmup=0) is None
    result = {"recipe": "tiny", "device": "cpu", "attention": ["full", "fmsa"], "seq_lens": [512],
              "points": [{"attention": "fmsa", "seq_len": 512, "tokens_per_s": 2.0, "ok": True,
                          "phase_s": phase_means(every_step, warmup=1)},
                         {"attention": "full", "seq_len": 512, "tokens_per_s": 1.0, "ok": True}]}
    write_outputs(result, tmp_path / "e2e")
    assert "| fmsa | 512 | 2.00 | 3.00 | 4.00 |" in (tmp_path / "e2e.md").read_text()


def test_bench_report_of_full_attention_alone(tmp_path):
    result = {"recipe": "tiny", "device": "cpu", "attention": ["full"], "seq_lens": [512],
              "points": [{"attention": "full", "seq_len": 512, "tokens_per_s": 1000.0, "ok": True}]}
    write_outputs(result, tmp_path / "e2e")
    md = (tmp_path / "e2e.md").read_text()
    assert "| seq_len | full tok/s |\n|---|---|\n| 512 | 1,000 |\n" in md


def test_a_profiled_step_is_written_and_left_out_of_the_means(tmp_path):
    """train.profile_step=2: step 2 runs under torch.profiler (CPU here: no device kernels), its
    record is flagged, and the benchmark averages the other steps and keeps the profile."""
    from msa_train.bench import run_point, summarise

    point = run_point("tiny", "full", 256, 3, ["train.profile_step=2", "train.phase_times=true"], tmp_path,
                      timeout=240)
    assert point["ok"], point.get("error")
    assert [r.get("profiled", False) for r in point["records"]] == [False, True, False]
    assert point["profile"]["step"] == 2 and point["profile"]["wall_s"] > 0
    assert (tmp_path / "full_256" / "profile_step2.md").is_file()
    assert summarise(point, warmup=1) == point["records"][2]["tokens_per_s"]
    assert phase_means(point, warmup=1)["forward_s"] == point["records"][2]["forward_s"]


def test_profile_summary_sorts_device_time_by_kind():
    from types import SimpleNamespace

    from msa_train.metrics import kernel_kind, profile_summary, profile_table

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ev = lambda key, us, n=1, dev=cuda: SimpleNamespace(key=key, device_type=dev, device_time_total=us, count=n)  # noqa: E731
    events = [ev("fmsa_fwd_kernel", 5000.0, 4), ev("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 9000.0, 10),
              ev("Memcpy DtoH (Device -> Pinned)", 1000.0, 2), ev("Memset (Device)", 10.0),
              ev("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0", 3000.0),
              ev("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float> >", 500.0, 7),
              ev("aten::mm", 9000.0, 10, dev=cpu),  # a CPU op: left out (its kernels are counted)
              SimpleNamespace(key="Optimizer.step#AdamW.step", device_type=cuda, device_time_total=43000.0,
                              count=1, is_user_annotation=True)]  # a GPU-side annotation: left out
    prof = SimpleNamespace(key_averages=lambda: events)
    s = profile_summary(prof, step=3, wall_s=1.5)
    assert s["device_ms"] == pytest.approx(18.51)
    assert list(s["kinds_ms"].items()) == [("matmul (cuBLAS)", 9.0), ("flash_msa (Triton)", 5.0),
                                           ("dense attention (cuDNN / flash SDPA)", 3.0),
                                           ("copy device<->host", 1.0),
                                           ("other PyTorch kernels (elementwise, reductions, ...)", 0.5),
                                           ("copy/fill on device", 0.01)]
    assert s["kernels"][0] == {"name": "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "ms": 9.0, "calls": 10,
                               "kind": "matmul (cuBLAS)"}
    assert kernel_kind("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "collectives (NCCL)"
    assert kernel_kind("_ce_rows_kernel") == "cross-entropy rows (Triton)"
    assert "| flash_msa (Triton) | 5.0 | 27.0% |" in profile_table(s)


def test_plan_check_repredicts_measured_peaks_and_reads_bench_files(tmp_path):
    """plan-check without a GPU: the measured peaks stay, the current planner predicts them again,
    and a bench result file's points join the table; a point that did not run shows its error."""
    from msa_train.bench_points import _killed
    from msa_train.bench_report import _predicted_gb, _short_override, plan_check

    lora = ["model.lora.r=16", "model.lora.alpha=32"]
    pred = _predicted_gb([*lora, "train.seq_len=65536", "attention=full"])["predicted_gb"]
    (tmp_path / "bench.json").write_text(json.dumps({
        "recipe": "llama3_8b_64k", "device": "gpu", "extra_overrides": [*lora, "train.phase_times=true"],
        "points": [{"attention": "full", "seq_len": 65536, "peak_memory_gb": pred * 1.25, "ok": True},
                   {"attention": "fmsa", "seq_len": 65536, "ok": False, "error": "OOM"}]}))
    row = {"key": "4 layers 64K full", "overrides": ["model.hf_config.num_hidden_layers=4", "train.seq_len=65536",
           "attention=full"], "measured_gb": 44.44, "error": None, "predicted_gb": 1.0, "device": "gpu"}
    failed = {"key": "failed", "overrides": ["train.seq_len=65536", "attention=fmsa"], "measured_gb": None,
              "error": _killed(-9), "device": "gpu"}
    (tmp_path / "points.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(failed) + "\n")
    table = {r["key"]: r for r in plan_check(["--out", str(tmp_path), "--repredict",
                                              "--add-bench", str(tmp_path / "bench.json")])}
    assert table["4 layers 64K full"]["predicted_gb"] != 1.0  # predicted again, measured kept
    assert table["4 layers 64K full"]["measured_gb"] == 44.44
    added = table["llama3_8b_64k full 64K r=16 alpha=32"]
    assert added["relative_error"] == pytest.approx(-0.2) and len(table) == 3  # the OOM point has no peak
    md = (tmp_path / "latest.md").read_text()
    assert "killed by SIGKILL" in md and "1 of 2 measured configurations within 10%" in md
    assert _killed(0) is None
    assert _short_override("parallel.offload_ratio=0.8") == "offload_ratio=0.8"  # the value's dot stays
