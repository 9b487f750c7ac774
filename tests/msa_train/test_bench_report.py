"""The end-to-end report, the longest-sequence search and the benchmark's labels, on CPU with fake runs."""
import json
import math

import pytest

from msa_train import bench, bench_report
from msa_train.bench_report import ARMS, Point


def test_per_layer_fit_recovers_known_slopes():
    fit = bench_report.fit_per_layer([4, 8, 16], [0.3 + 0.05 * L for L in (4, 8, 16)])
    assert fit["fixed_s"] == pytest.approx(0.3) and fit["per_layer_s"] == pytest.approx(0.05)
    assert fit["relative_residual"] == pytest.approx(0, abs=1e-12)
    noisy = bench_report.fit_per_layer([4, 8, 16], [0.5, 0.68, 1.12])  # off the line: the residual says so
    assert noisy["relative_residual"] > 0.01
    with pytest.raises(ValueError, match="2 distinct depths"):
        bench_report.fit_per_layer([4, 4], [1.0, 1.1])


def _fake_run(calls):
    def run(pt: Point):
        calls.append(pt.key)
        if pt.layers == 32 and pt.attention == "full" and pt.seq_len == 2048:
            return {"ok": False, "error": "OOM"}  # that point falls back to the per-layer fit
        attn = {"full": 2e-6, "nsa": 0.8e-6, "fmsa": 0.6e-6}[pt.attention] * pt.seq_len
        return {"ok": True, "step_s": 0.1 + pt.layers * (0.01 + attn), "peak_memory_gb": 1.0 + pt.layers / 10,
                "phase_s": {"forward_backward": 0.2, "optimizer": 0.01}, "dense_kernel": "sdpa", "impl": "ref"}
    return run


def test_report_on_a_tiny_grid_writes_every_file_and_column_and_resumes(tmp_path):
    points = bench_report.grid(["llama3_8b"], [1024, 2048], depths=[2, 4, 32])
    calls = []
    results = tmp_path / "points.jsonl"
    first = bench_report.run_grid(points, results, _fake_run(calls), max_seconds=2.5,
                                  clock=iter(range(1000)).__next__)  # one tick a call: two points, then stop
    assert len(first) == 2 and len(calls) == 2
    rows = bench_report.run_grid(points, results, _fake_run(calls))  # the rerun skips the two done
    assert len(calls) == len(points) and len(set(calls)) == len(points) and len(rows) == len(points)
    shapes = {"llama3_8b": {"layers": 32, "heads": 32, "head_dim": 128, "n_matmul": 7_000_000_000,
                            "peak_tflops": 989.4}}
    table = bench_report.summarise_rows(rows, shapes)
    bench_report.write_report(table, tmp_path, {"device": "cpu"})
    for name in ("latest.json", "latest.md", "latest.png"):
        assert (tmp_path / name).stat().st_size > 0
    md = (tmp_path / "latest.md").read_text().splitlines()
    header = next(line for line in md if line.startswith("| model"))
    assert [c.strip() for c in header.strip("|").split("|")] == list(bench_report.COLUMNS)
    by = {(r["attention"], r["seq_len"], r["options"]): r for r in json.loads((tmp_path / "latest.json").read_text())["rows"]}
    fitted = by[("full", 2048, "same")]
    assert fitted["source"].startswith("fit over 2 depths") and fitted["step_s"] == pytest.approx(0.1 + 32 * (0.01 + 2e-6 * 2048))
    measured = by[("fmsa", 2048, "same")]
    assert measured["source"] == "measured"
    assert measured["speedup_over_full"] == pytest.approx(fitted["step_s"] / measured["step_s"])
    assert measured["speedup_over_nsa"] > 1
    assert measured["mfu"] == pytest.approx(bench_report.mfu(2048 / measured["step_s"], 7_000_000_000, 32, 32, 128,
                                                             2048, "fmsa", 989.4))
    assert fitted["mfu"]["actual"] == fitted["mfu"]["dense_equivalent"]  # dense: one count


def test_sparse_flops_follow_the_branch_formulas():
    T, HQ, D = 65536, 32, 128
    f = bench_report.sparse_attention_flops_per_token(T, HQ, D, kv_heads=8)
    attn = 4 * HQ * D * (T / 32 + 16 * 64 + 512)
    phi = 4 * 8 * 32 * D * D / 16
    assert f == pytest.approx(3 * (attn + phi))
    dense = 12 * HQ * D * T / 2  # metrics.model_flops_per_token's attention term
    assert 6 < dense / f < 16  # DESIGN.md: about 8x fewer at 64K, tending to 16x


@pytest.mark.parametrize("threshold,start", [(300_000, 65536), (300_000, 1 << 20), (5000, 1 << 16), (40, 64)])
def test_longest_finds_the_threshold_in_logarithmic_trials(threshold, start):
    multiple = 64
    best, tried = bench_report.longest(lambda T: T <= threshold, start, multiple)
    assert best == (threshold // multiple) * multiple
    assert tried[0] == start  # from the planner's estimate
    assert len(tried) <= 2 * math.log2(max(threshold, start) / multiple) + 3


@pytest.mark.parametrize("threshold", [70_000, 131_072, 200_000, 300_000])
def test_a_refine_limit_stops_within_an_eighth_in_few_trials(threshold):
    """``refine=3``: after bracketing between powers of two, three bisections: the answer fits, and
    is within an eighth of the power of two below it of the true threshold (a trial at full depth
    takes minutes, so the finder does not bisect down to 64 tokens)."""
    best, tried = bench_report.longest(lambda T: T <= threshold, 65536, 64, refine=3)
    lo = 1 << (threshold.bit_length() - 1)
    assert best <= threshold and threshold - best < lo / 8
    assert len(tried) <= math.log2(threshold / 65536) + 2 + 3


def test_the_benchmark_writes_under_runs_and_labels_what_ran(tmp_path, monkeypatch):
    stem = bench.default_stem("tiny", "cpu")
    assert stem.parts[0] == "runs" and not stem.is_absolute()  # relative to the working dir, never the source tree
    labels = bench.what_ran("fmsa", "cpu")
    assert "PyTorch reference" in labels["impl"] and labels["device"] == "cpu"
    assert "Triton" in bench.what_ran("fmsa", "NVIDIA H200")["impl"]
    assert "sdpa_cudnn" in bench.what_ran("full", "NVIDIA H200")["impl"]
    result = {"recipe": "tiny", "device": "cpu", "attention": ["full", "fmsa"], "seq_lens": [512], "points": [
        {"attention": "full", "seq_len": 512, "tokens_per_s": 100.0, "peak_memory_gb": 1.0},
        {"attention": "fmsa", "seq_len": 512, "tokens_per_s": 10.0, "peak_memory_gb": 1.0}]}
    bench.write_outputs(result, tmp_path / "e2e")
    md = (tmp_path / "e2e.md").read_text()
    assert "max RSS" in md and "max_memory_allocated" not in md and "PyTorch reference" in md


def test_fastest_options_are_the_first_the_planner_fits_at_full_depth():
    seen = []

    def fits(overrides):  # a fake planner: only with the optimizer state on the host
        seen.append(overrides)
        return "parallel.offload_optimizer=true" in overrides

    point = Point("llama3_8b", "fmsa", 65536, 4, "fastest")
    over = bench_report.point_overrides(point, fits)
    assert over[:2] == ["model=llama3_8b", "model.hf_config.num_hidden_layers=4"]
    assert "parallel.activation_checkpointing=false" in over and "parallel.offload_optimizer=true" in over
    assert all("model.hf_config.num_hidden_layers=32" in o for o in seen)  # chosen at full depth
    same = bench_report.point_overrides(Point("llama3_8b", "full", 65536, 4, "same"), fits)
    assert set(bench_report.SAME_OPTIONS) <= set(same)


def test_the_breakdown_splits_a_profiled_step_by_kernel_kind():
    """Shares of the profiled step's kernel time: flash_msa's and cuDNN's kernels are attention, the
    fused loss's kernels the loss, AdamW's the optimizer, NCCL's communication; the rest (matmuls,
    the fused norm / RoPE / SwiGLU, elementwise) the rest of the layers."""
    from msa_train.metrics import kernel_kind

    names = {"fmsa_fwd_kernel": 30.0, "cudnn_generated_fort_native_sdpa_sm90": 10.0,
             "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT": 40.0, "_rms_norm_fwd_kernel": 3.0, "_swiglu_kernel": 2.0,
             "_ce_rows_kernel": 5.0, "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<AdamW>": 6.0,
             "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": 4.0}
    kinds = {}
    for name, ms in names.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    assert kernel_kind("_rope_kernel") == "fused layer ops (Triton)" and kernel_kind("select_blocks_kernel") == \
        "flash_msa (Triton)"
    b = bench_report.breakdown({"kinds_ms": kinds})
    assert b == pytest.approx({"attention": 0.4, "rest_of_layers": 0.45, "loss": 0.05, "optimizer": 0.06,
                               "communication": 0.04})
    assert bench_report.breakdown({"kinds_ms": {}}) is None and bench_report.breakdown(None) is None


def test_a_point_profiles_its_last_step_and_times_the_others(tmp_path, monkeypatch):
    from msa_train import bench_points

    seen = {}

    def fake_run_point(recipe, attention, seq_len, steps, extra, workdir, timeout):
        seen["extra"] = extra
        records = [{"step": s, "tokens_per_s": 100.0 if s < steps else 1.0, "forward_s": 0.1, "backward_s": 0.2,
                    "step_s": 0.05, **({"profiled": True} if s == steps else {})} for s in range(1, steps + 1)]
        return {"ok": True, "records": records, "peak_memory_gb": 2.0, "process_s": 30.0,
                "summary": {"startup_s": {"model": 4.0, "optimizer": 2.5}, "wall_time_s": 20.0},
                "profile": {"kinds_ms": {"flash_msa (Triton)": 1.0, "matmul (cuBLAS)": 3.0}}}

    monkeypatch.setattr(bench_points, "run_point", fake_run_point)
    point = bench_report.grid(["llama3_8b"], [1024], depths=[4])[0]
    row = bench_report.measure_point(point, steps=4, warmup=1, timeout=10, workdir=tmp_path, device="cpu",
                                     verdict=lambda overrides: None)
    assert "train.profile_step=4" in seen["extra"]
    assert row["step_s"] == pytest.approx(1024 / 100.0)  # the profiled step is not timed
    assert row["breakdown"]["attention"] == pytest.approx(0.25) and row["breakdown"]["rest_of_layers"] == 0.75
    assert row["seconds"] == {"process": 30.0, "startup": 6.5, "training_loop": 20.0}


def test_a_point_the_planner_rules_out_is_recorded_with_the_prediction_and_not_run(tmp_path, monkeypatch):
    from msa_train import bench_points

    monkeypatch.setattr(bench_points, "run_point", lambda *a, **k: pytest.fail("ran a point predicted not to fit"))
    asked = []

    def verdict(overrides):
        asked.append(overrides)
        return "predicted not to fit: 1 of 2 GiB"

    point = Point("llama3_8b", "fmsa", 65536, 32, "same")
    row = bench_report.measure_point(point, steps=4, warmup=1, timeout=10, workdir=tmp_path, device="cpu",
                                     verdict=verdict)
    assert row["ok"] is False and row["skipped"] and row["error"] == "predicted not to fit: 1 of 2 GiB"
    assert {"attention=fmsa", "train.seq_len=65536", "model.hf_config.num_hidden_layers=32"} <= set(asked[-1])


def test_a_host_too_small_for_the_optimizer_state_gets_a_share_that_fits_every_arm():
    """A fake planner: the whole optimizer state on the host does not fit; a host share r fits when
    r <= 0.8 for fmsa (more parameters) and r <= 0.9 for the other arms. Under ``same`` every arm gets
    0.8 under ZeRO-3; under ``fastest`` each arm its own."""
    def verdict(overrides):
        ratio = next((float(o.split("=")[1]) for o in overrides if o.startswith("parallel.offload_ratio=")), 1.0)
        limit = 0.8 if "attention=fmsa" in overrides else 0.9
        return None if ratio <= limit + 1e-9 else "predicted not to fit: host"

    for att in ARMS:
        over = bench_report.point_overrides(Point("llama3_8b", att, 65536, 32, "same"), verdict=verdict)
        assert "parallel=zero3" in over and "parallel=zero2" not in over and "parallel.offload_ratio=0.8" in over
        assert set(bench_report.SAME_OPTIONS) - {"parallel=zero2"} <= set(over)
    fast = bench_report.point_overrides(Point("llama3_8b", "full", 65536, 32, "fastest"), fits=lambda o: True,
                                        verdict=verdict)
    assert not any("offload_ratio" in o for o in fast)  # the first candidate keeps no optimizer state on the host

    def gpu_verdict(overrides):  # and the GPU takes at most 60% of the state (r >= 0.4)
        ratio = next((float(o.split("=")[1]) for o in overrides if o.startswith("parallel.offload_ratio=")), 1.0)
        return None if 0.4 - 1e-9 <= ratio <= 0.9 + 1e-9 else "predicted not to fit"

    fast = bench_report.point_overrides(Point("llama3_8b", "fmsa", 65536, 32, "fastest"),
                                        fits=lambda o: "parallel.offload_optimizer=true" in o, verdict=gpu_verdict)
    assert "parallel.offload_ratio=0.5" in fast  # the smallest host share that fits, 0.4, plus the margin
    same = bench_report.point_overrides(Point("llama3_8b", "fmsa", 65536, 32, "same"), verdict=gpu_verdict)
    assert "parallel.offload_ratio=0.9" in same  # the largest
    assert bench_report.point_overrides(Point("llama3_8b", "full", 65536, 32, "same"),
                                        verdict=lambda o: None) == bench_report.point_overrides(
        Point("llama3_8b", "full", 65536, 32, "same"))  # fits as it is: unchanged


def test_the_host_share_the_real_planner_picks_fits_llama3_8b_at_full_depth(monkeypatch):
    """With 124 GiB of host and an 80 GB GPU, the same options at 32 layers and 64K need a part of
    the optimizer state on the GPU; the share picked fits both for all three arms."""
    from msa_train.parallel import planner

    monkeypatch.setattr(planner, "host_available_gb", lambda: 124.0)
    point = Point("llama3_8b", "fmsa", 65536, 32, "same")
    extra = ["train.plan_gpu_gb=79.2"]
    assert bench_report.planner_verdict([*bench_report.point_overrides(point), *extra, "attention=fmsa",
                                         "train.seq_len=65536"]) is not None
    over = bench_report.point_overrides(point, verdict=lambda o: bench_report.planner_verdict([*o, *extra]))
    ratio = float(next(o for o in over if o.startswith("parallel.offload_ratio=")).split("=")[1])
    assert 0.5 <= ratio < 0.9, ratio
    for att in ARMS:
        assert bench_report.planner_verdict([*over, *extra, f"attention={att}", "train.seq_len=65536"]) is None


def test_the_report_keeps_host_memory_free_beyond_the_prediction():
    """The 128K fmsa point at 32 layers with 85% of the optimizer state on the host (124.1 GiB
    predicted, about 124.3 available) was killed by the host's out-of-memory killer; with the report's
    margin the same options take 80% (117.4 predicted), which ran. The report takes the largest share
    that fits every arm (the fake planner's test above); the real planner is asked here only at the
    shares around that one, not at all nineteen."""
    point = Point("llama3_8b", "fmsa", 131072, 32, "same")
    chosen = bench_report.point_overrides(point, verdict=lambda o: None if "parallel.offload_ratio=0.8" in o else "no")
    assert "parallel.offload_ratio=0.8" in chosen

    def fits_every_arm(ratio, host_gb):
        over = [f"parallel.offload_ratio={ratio}" if o.startswith("parallel.offload_ratio=") else o for o in chosen]
        return all(bench_report.planner_verdict([*over, f"attention={att}", "train.seq_len=131072"],
                                                host_gb=host_gb) is None for att in ARMS)

    assert fits_every_arm(0.85, 124.3) and not fits_every_arm(0.9, 124.3)
    with_margin = 124.3 - bench_report.REPORT_HOST_MARGIN_GB
    assert fits_every_arm(0.8, with_margin) and not fits_every_arm(0.85, with_margin)


def test_a_point_the_shallower_depths_predict_to_outlast_the_timeout_is_skipped_not_run(tmp_path):
    """4 and 8 layers took 10 and 20 s a step (2.5 s a layer) after a 60 s startup, with 10 s of the
    process outside its startup and loop: 32 layers would take (4 + 1) x 80 + 60 + 10 = 470 s, more
    than a 300 s timeout (skipped, its row a fit) and less than 600 s (run)."""
    measured = [{"key": f"llama3_8b/full/262144/{L}/same", "model": "llama3_8b", "attention": "full",
                 "seq_len": 262144, "layers": L, "options": "same", "ok": True, "step_s": s,
                 "seconds": {"startup": 60.0, "process": 160.0, "training_loop": 90.0}} for L, s in ((4, 10.0), (8, 20.0))]
    deep = Point("llama3_8b", "full", 262144, 32, "same")
    assert bench_report.predicted_seconds(deep, {r["key"]: r for r in measured}, 4) == pytest.approx(470.0)
    assert bench_report.predicted_seconds(Point("llama3_8b", "fmsa", 262144, 32, "same"),
                                          {r["key"]: r for r in measured}, 4) is None  # no depths of its own
    for timeout, runs in ((300, False), (600, True)):
        results = tmp_path / f"points_{timeout}.jsonl"
        results.write_text("".join(json.dumps(r) + "\n" for r in measured))
        calls = []
        rows = bench_report.run_grid([deep], results, lambda pt: calls.append(pt.key) or {"ok": True},
                                     timeout=timeout, steps=4)
        assert (calls == [deep.key]) is runs
        if not runs:
            assert rows[deep.key]["skipped"] and "predicted to take 470 s" in rows[deep.key]["error"]


def test_the_planner_verdict_weighs_the_host_memory_available_now(monkeypatch):
    """Llama-3-8B's 32 layers with the optimizer state on the host need about 120 GiB of it (124 for fmsa), which a
    host of 125 GiB did not have; 16 layers need about half."""
    from msa_train.parallel import planner

    def verdict(layers, host_gb):
        monkeypatch.setattr(planner, "host_available_gb", lambda: host_gb)
        point = Point("llama3_8b", "full", 65536, layers, "same")
        return bench_report.planner_verdict([*bench_report.point_overrides(point), "attention=full",
                                             "train.seq_len=65536", "train.plan_gpu_gb=141"])

    assert verdict(16, 110.0) is None
    point = Point("llama3_8b", "full", 65536, 32, "same")  # a host figure given (the report's, read once) wins
    assert bench_report.planner_verdict([*bench_report.point_overrides(point), "attention=full", "train.seq_len=65536",
                                         "train.plan_gpu_gb=141"], host_gb=500.0) is None
    why = verdict(32, 110.0)
    assert why.startswith("predicted not to fit") and "of 110 GiB of host memory" in why
    assert verdict(32, 500.0) is None


def test_the_grid_puts_the_options_outermost_and_refuses_unknown_ones():
    points = bench_report.grid(["llama3_8b"], [1024, 2048], depths=[4, 8])
    opts = [p.options for p in points]
    assert opts == sorted(opts, key=["same", "fastest"].index) and set(opts) == {"same", "fastest"}
    assert {p.layers for p in points} == {4, 8, 32}
    assert {p.options for p in bench_report.grid(["llama3_8b"], [1024], [4], ["same"])} == {"same"}
    with pytest.raises(ValueError, match="options: expected 'same' or 'fastest', got 'fast'"):
        bench_report.grid(["llama3_8b"], [1024], [4], ["fast"])
    some = bench_report.grid(["llama3_8b"], [1024], [4], ["same"], arms=["fmsa", "full"])
    assert [(p.attention, p.layers) for p in some] == [("fmsa", 4), ("full", 4), ("fmsa", 32), ("full", 32)]
    with pytest.raises(ValueError, match="arms: expected some of full, nsa, fmsa, got dense"):
        bench_report.grid(["llama3_8b"], [1024], [4], ["same"], arms=["dense"])


def test_one_measured_depth_is_not_a_fit_and_the_failed_points_are_listed(tmp_path):
    ok = {"key": "llama3_8b/fmsa/131072/4/same", "model": "llama3_8b", "attention": "fmsa", "seq_len": 131072,
          "layers": 4, "options": "same", "ok": True, "step_s": 4.0}
    killed = {**ok, "key": "llama3_8b/fmsa/131072/32/same", "layers": 32, "ok": False, "step_s": None,
              "error": "killed by SIGKILL"}
    rows = {r["key"]: r for r in (ok, killed)}
    table = bench_report.summarise_rows(rows, {})
    assert table[0]["source"] == "measured at one depth [4] only: no fit" and table[0]["tokens_per_s"] is None
    full = {**ok, "key": "llama3_8b/full/131072/4/same", "attention": "full", "step_s": 10.0, "peak_memory_gb": 23.6}
    bench_report.write_report(table, tmp_path, {"device": "cpu", "failed": [(killed["key"], killed["error"])],
                                                "measured": [ok, killed, full]})
    md = (tmp_path / "latest.md").read_text()
    assert "- `llama3_8b/fmsa/131072/32/same`: killed by SIGKILL" in md
    assert "| llama3_8b | same | 131,072 | 4 | full | 10 | 13,107 | 1.00x | 23.6 |" in md
    assert "| llama3_8b | same | 131,072 | 4 | fmsa | 4 | 32,768 | 2.50x | - |" in md


def test_the_finder_runs_no_trial_where_no_length_fits_the_host(tmp_path, monkeypatch):
    """Llama-3-8B at full depth with AdamW's state on the host needs about 126 GiB of host memory
    whatever the length; on a host with less the finder says so instead of trying lengths."""
    from msa_train import bench_points
    from msa_train.parallel import planner

    monkeypatch.setattr(planner, "host_available_gb", lambda: 100.0)
    monkeypatch.setattr(bench_points, "run_point", lambda *a, **k: pytest.fail("ran a trial"))
    table = bench_report.longest_cmd(["--attention", "full", "--out", str(tmp_path), "--",
                                      "parallel=zero2", "parallel.offload_optimizer=true", "parallel.optimizer=deepspeed"])
    assert table["full"]["longest"] == 0 and table["full"]["tried"] == []
    assert table["full"]["reason"].startswith("predicted not to fit at any length") and "100 available" in table["full"]["reason"]
    assert "predicted not to fit at any length" in (tmp_path / "latest.md").read_text()


def test_a_finder_trial_that_times_out_stops_the_search_without_calling_it_too_big(tmp_path, monkeypatch):
    from msa_train import bench_points
    from msa_train.parallel import planner

    monkeypatch.setattr(planner, "host_available_gb", lambda: 64.0)  # whatever this machine has free
    tried = []

    def run_point(recipe, attention, seq_len, steps, extra, workdir, timeout):
        tried.append(seq_len)  # the planner's start trains; the next length is too slow to tell
        return {"ok": True} if len(tried) == 1 else {"ok": False, "error": f"timeout after {timeout} s"}

    monkeypatch.setattr(bench_points, "run_point", run_point)
    table = bench_report.longest_cmd(["--recipe", "tiny", "--attention", "full", "--timeout", "7", "--out", str(tmp_path),
                                      "--", "train.seq_len=1024"])
    row = table["full"]
    assert len(tried) == 2 and row["longest"] == tried[0] and row["tried"] == tried
    assert row["reason"].startswith(f"stopped: the trial at {tried[-1]:,} ended on a timeout after 7 s")


def test_the_report_starts_from_the_committed_points_of_the_same_gpu_and_retries_skips_and_failures(tmp_path):
    ran = {"key": "llama3_8b/full/65536/4/same", "model": "llama3_8b", "attention": "full", "seq_len": 65536,
           "layers": 4, "options": "same", "ok": True, "step_s": 3.8}
    killed = {**ran, "key": "llama3_8b/full/65536/32/same", "layers": 32, "ok": False, "error": "killed by SIGKILL"}
    skipped = {**ran, "key": "llama3_8b/fmsa/65536/32/same", "attention": "fmsa", "layers": 32, "ok": False,
               "skipped": True, "error": "predicted not to fit"}
    (tmp_path / "latest.json").write_text(json.dumps({"meta": {"device": "H100", "steps": 4, "warmup": 1,
                                                               "measured": [ran, killed, skipped]}}))
    assert "not starting" in bench_report.seed_points(tmp_path, "H200", 4, 1)  # another GPU
    assert "not starting" in bench_report.seed_points(tmp_path, "H100", 5, 2)  # other steps
    assert not (tmp_path / "points.jsonl").exists()
    assert "starting from 1 points" in bench_report.seed_points(tmp_path, "H100", 4, 1)
    assert set(bench_report.load_points(tmp_path / "points.jsonl")) == {ran["key"]}
    assert "continuing" in bench_report.seed_points(tmp_path, "H100", 4, 1)
    (tmp_path / "points.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (ran, killed, skipped)))
    calls = []
    points = [Point("llama3_8b", "full", 65536, 4, "same"), Point("llama3_8b", "full", 65536, 32, "same"),
              Point("llama3_8b", "fmsa", 65536, 32, "same")]
    rows = bench_report.run_grid(points, tmp_path / "points.jsonl", lambda pt: calls.append(pt.key) or {"ok": True})
    assert calls == [skipped["key"]] and rows[skipped["key"]]["ok"]  # only the skipped point runs again
