"""benchmarks/cp_scaling.py under torchrun on two CPU processes (gloo, the interpreter, float32, a
tiny shape): it runs to the end and its table holds the one-device row and the two-rank row of each
length, with positive times and the ranks' outputs equal to the one-device output. ~30 s: slow."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_cp_scaling_benchmark_on_two_cpu_ranks():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "benchmarks" / "cp_scaling.py"), str(ROOT / "examples" / "gated_deltanet.lr"),
           "--T", "96,128", "--H", "1", "--K", "16", "--V", "16", "--reps", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.strip("|").split("|") for line in run.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    got = {(int(r[0]), int(r[1])): [c.strip() for c in r[2:]] for r in rows}
    assert sorted(got) == [(96, 1), (96, 2), (128, 1), (128, 2)], run.stdout
    for (T, n), cells in got.items():
        fwd, tok, per, both = (float(c) for c in cells[:4])
        assert fwd > 0 and both > 0 and math.isclose(tok / n, per, rel_tol=0.02), (T, n, cells)
        assert math.isclose(tok, T / fwd / 1e3, rel_tol=0.02), (T, n, cells)
        if n == 2:
            assert float(cells[-1]) < 1e-5, f"T={T}: the ranks' o against one process: {cells[-1]}"
