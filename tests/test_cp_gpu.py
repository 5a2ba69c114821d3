"""Context parallelism on GPUs (NCCL), one process per GPU: tests/test_cp.py's check at longer
sequences and K = V = 64, every example and test_cp's fallback spec, packed sequences straddling
ranks and a batch. Needs two GPUs (four for the world-4 cases, skipped on fewer); run on a
multi-GPU machine with
    LRDSL_TEST_DEVICE=cuda python3 -m pytest -m gpu tests/test_cp_gpu.py -q -n 0
fp32 inputs with tf32 products: test_gpu's tolerances against the single-process chunk and the
float64 reference, both on the GPU (o and states 5e-3; dq, dk, dv, dh0 8e-3; other inputs 2e-2).
"""
from __future__ import annotations

import pytest
import torch
from test_cp import SPECS, Split, check

from lrdsl.testing import Case

pytestmark = pytest.mark.gpu

GPU_SPLITS = {
    "w2-varlen": Split(Case(B=1, T=3000, H=2, HV=4, K=64, V=64, cu_seqlens=(0, 700, 2100, 2100, 3000),
                            initial_state=True, seed=21), (1500, 1500)),
    "w2-batched": Split(Case(B=2, T=2900, H=2, HV=4, K=64, V=64, initial_state=True, seed=22), (1400, 1500)),
    "w4-varlen": Split(Case(B=1, T=4000, H=2, HV=4, K=64, V=64, cu_seqlens=(0, 300, 3500, 3500, 4000),
                            initial_state=True, seed=23), (1000, 1000, 1000, 1000)),
}


@pytest.mark.parametrize("split_name", list(GPU_SPLITS))
@pytest.mark.parametrize("name", list(SPECS))
def test_cp_nccl(name, split_name, compiled):
    split = GPU_SPLITS[split_name]
    if torch.cuda.device_count() < len(split.lengths):
        pytest.skip(f"needs {len(split.lengths)} GPUs, this machine has {torch.cuda.device_count()}")
    check(name, split, compiled, backend="nccl")
