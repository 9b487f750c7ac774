"""scripts/kernel_resources.py compiles kernels for sm_90 without a GPU and reads their resources."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernel_resources_reports_sm90_registers():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # ahead-of-time compilation for sm_90, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "kernels"), env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_resources.py"),
                        "--kernels", "fmsa_fwd G=4,fmsa_merge G=4"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in r.stdout.splitlines() if line.startswith("| fmsa")]
    assert [c[0].strip() for c in rows] == ["fmsa_fwd G=4", "fmsa_merge G=4"]
    for cells in rows:
        regs, shared, blocks = int(cells[1]), int(cells[4]), int(cells[5])
        # the forward stages its matmul operands in shared memory; the one-warp merge needs none
        assert 0 < regs <= 255 and blocks >= 1 and (shared > 0 if "fwd" in cells[0] else shared >= 0)
