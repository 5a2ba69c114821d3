"""lrdsl bench's roofline (lrdsl/roofline.py) and tables, on the CPU: the FLOP and byte counts against
hand counts, the peaks by device name, the rates, and the rows' columns. The times they format are
made up here; the GPU ones come from `lrdsl bench` (benchmarks/device/decode.sh)."""
from __future__ import annotations

import pytest

import lrdsl
from lrdsl import bench, roofline
from lrdsl.bench import Shape

SMALL = Shape(B=1, T=128, H=2, K=16, V=32)  # two chunks of 64 tokens, 256 token-heads


@pytest.fixture(scope="module")
def deltanet():
    return lrdsl.compile("examples/deltanet.lr", load_kernels=False)


def test_deltanet_flop_by_hand(deltanet):
    # per token and head: 4KV + 64(K + V) + 2KV + 64(2K + V) = 2048 + 3072 + 1024 + 4096 = 10240
    assert roofline.chunk_size(deltanet) == 64
    assert roofline.flop(deltanet, SMALL) == 256 * 10240
    assert roofline.flop(deltanet, SMALL, backward=True) == 3 * 256 * 10240
    assert bench.nominal_flop(deltanet, SMALL) == 256 * 10240


def test_deltanet_bytes_by_hand(deltanet):
    # q, k: 256 x 16 bf16 each; v: 256 x 32; beta: 256; o: 256 x 32; two chunk states of 16 x 32 per
    # head, written and read
    inputs = 2 * 256 * 16 * 2 + 256 * 32 * 2 + 256 * 2  # 33280
    out = 256 * 32 * 2  # 16384
    states = 2 * 2 * 16 * 32 * 2  # 4096
    assert roofline.nbytes(deltanet, SMALL) == inputs + out + 2 * states == 57856
    # the backward: inputs again, do, the inputs' gradients, the states and their gradients
    assert roofline.nbytes(deltanet, SMALL, backward=True) == 57856 + inputs + out + inputs + 4 * states


def test_a_log_decay_counts_four_bytes():
    """bench.draw keeps log-decays fp32 (as FLA takes them): gated_deltanet's g is 4 bytes a token."""
    gdn = lrdsl.compile("examples/gated_deltanet.lr", load_kernels=False)
    assert roofline.nbytes(gdn, SMALL) == 57856 + 256 * 4


def test_peaks_by_device_name_and_overrides():
    h100 = roofline.peak_of("NVIDIA H100 80GB HBM3")
    assert (h100.tflops, h100.tbps) == (989.0, 3.35)
    assert roofline.peak_of("NVIDIA H100 PCIe").tbps == 2.0
    assert (roofline.peak_of("NVIDIA H200").tflops, roofline.peak_of("NVIDIA H200").tbps) == (989.0, 4.8)
    assert roofline.peak_of("NVIDIA H200", tbps=4.0).tbps == 4.0
    assert roofline.peak_of("NVIDIA GeForce RTX 4090") is None
    odd = roofline.peak_of("NVIDIA GeForce RTX 4090", 165.0, 1.0)
    assert (odd.tflops, odd.tbps) == (165.0, 1.0)


def test_rates_and_percentages():
    peak = roofline.Peak("H100", 989.0, 3.35)
    r = roofline.rates(989e9 / 2, 3.35e9, 1.0, peak)  # in 1 ms: half the FLOPs, all the bandwidth
    assert r["tflops"] == pytest.approx(494.5) and r["gbps"] == pytest.approx(3350.0)
    assert r["pct_flops"] == pytest.approx(50.0) and r["pct_bw"] == pytest.approx(100.0)
    assert roofline.cells(r) == ["494.5", "3350", "50.0%", "100.0%"]
    assert roofline.cells(roofline.rates(1e9, 1e9, 1.0, None))[2:] == ["-", "-"]


def _row(deltanet, backward=True):
    timed = {"fwd_ms": 0.5, "fwd_gpu_ms": 0.4, "fwd_mem": 0}
    if backward:
        timed.update(both_ms=2.0, both_gpu_ms=1.6, bwd_mem=2 ** 30)
    s = Shape(4, 4096, 16, 128, 128)
    return {"mixer": "deltanet", "shape": s, "flop": roofline.flop(deltanet, s), "bytes": roofline.nbytes(deltanet, s),
            "flop_both": roofline.flop(deltanet, s, True), "bytes_both": roofline.nbytes(deltanet, s, True),
            "lrdsl": timed}


def test_table_rows_carry_the_roofline_columns(deltanet):
    peak = roofline.peak_of("NVIDIA H200")
    head = bench.table_head().splitlines()[0]
    row = _row(deltanet)
    line = bench.table_row(row, peak)
    assert line.count("|") == head.count("|")
    cols = [c.strip() for c in line.strip("|").split("|")]
    names = [c.strip() for c in head.strip("|").split("|")]
    got = dict(zip(names, cols))
    fwd = roofline.rates(row["flop"], row["bytes"], 0.4, peak)
    both = roofline.rates(row["flop_both"], row["bytes_both"], 1.6, peak)
    assert [got[f"fwd {n}"] for n in ("TFLOP/s", "GB/s", "% bf16 peak", "% bandwidth")] == roofline.cells(fwd)
    assert [got[f"f+b {n}"] for n in ("TFLOP/s", "GB/s", "% bf16 peak", "% bandwidth")] == roofline.cells(both)
    forward_only = bench.table_row(_row(deltanet, backward=False), None)
    assert forward_only.count("|") == head.count("|") and forward_only.rstrip(" |").endswith("- | - | - | -")


def test_kernel_table_shares():
    text = roofline.kernel_table([("small", 0.25, 1), ("big", 0.75, 2)], 1.0)
    lines = text.splitlines()
    assert lines[2] == "| big | 2 | 0.750 | 75.0% |" and lines[3] == "| small | 1 | 0.250 | 25.0% |"
    assert lines[-1] == "| (all) | 3 | 1.000 | 100.0% |"


def test_decode_table_row():
    r = {"mixer": "kda", "B": 64, "H": 16, "K": 128, "V": 128, "lrdsl_ms": 0.02, "fla_ms": 0.03,
         "lrdsl_eager_ms": 0.05, "fla_eager_ms": 0.08, "lrdsl_verify_ms": 0.04, "twin": "kda.fused_recurrent_kda"}
    line = bench.decode_table_row(r)
    assert line == "| kda | 64 | 16,128,128 | 20.0 | 30.0 | 1.50 | 50.0 | 80.0 | 40.0 | kda.fused_recurrent_kda |"
    assert line.count("|") == bench.decode_table_head().splitlines()[0].count("|")


def test_bench_decode_without_a_gpu_says_so(capsys, monkeypatch):
    import torch

    from lrdsl.cli import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--decode", "examples/gated_deltanet.lr"]) == 1
    assert capsys.readouterr().err.strip() == "lrdsl: error: lrdsl bench times GPU kernels, and torch sees no CUDA device"


def test_decode_row_steps_verifies_and_rolls_back(monkeypatch):
    """decode_row's calls on the CPU (the graph and the timer replaced by plain calls): the one-token
    step and the verification step with its rollback run and move the state, each timed."""
    import torch
    import triton.testing

    calls = []
    monkeypatch.setattr(bench, "graphed", lambda f: f)
    monkeypatch.setattr(triton.testing, "do_bench", lambda f, **kw: calls.append(f() or 1) or 0.001 * len(calls))
    mixer = lrdsl.compile("examples/gated_deltanet.lr")
    steps = []
    real = mixer.step
    monkeypatch.setattr(mixer, "step", lambda *a, **kw: steps.append(kw["state"].clone()) or real(*a, **kw))
    r = bench.decode_row(mixer, 2, 2, 16, 16, with_twin=False, device="cpu")
    assert (r["lrdsl_eager_ms"], r["lrdsl_ms"], r["lrdsl_verify_ms"]) == (0.001, 0.002, 0.003)
    # the state each step found: zeros, then moved by the one-token step, then by the second one
    assert "fla_ms" not in r and len(steps) == 3 and not steps[0].any() and steps[1].any()
    assert not torch.equal(steps[1], steps[2])


def test_the_fla_column_says_when_fla_hands_its_op_to_flashqla(monkeypatch):
    """fla-core 0.6 runs chunk_gated_delta_rule as FlashQLA wherever flash_qla imports (its switch
    FLA_FLASH_QLA not "0"): the twin's label says so there, and only there."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "flash_qla" else real(n, *a))
    monkeypatch.setattr(bench, "_fla", lambda name: lambda **kw: (kw["v"],))
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    gdn = lrdsl.compile("examples/gated_deltanet.lr", load_kernels=False)
    name, _ = bench.twin(gdn)
    assert name == "gated_delta_rule.chunk_gated_delta_rule (FlashQLA via FLA; FLA_FLASH_QLA=0 for FLA's Triton kernels)"
    assert bench.twin(lrdsl.compile("examples/kda.lr", load_kernels=False))[0] == "kda.chunk_kda"
    monkeypatch.setenv("FLA_FLASH_QLA", "0")
    assert bench.twin(gdn)[0] == "gated_delta_rule.chunk_gated_delta_rule"
    monkeypatch.delenv("FLA_FLASH_QLA")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_qla" else real(n, *a))
    assert bench.twin(gdn)[0] == "gated_delta_rule.chunk_gated_delta_rule"
