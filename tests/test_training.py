"""Train a toy two-layer model through mixer.chunk (the generated chunked forward and backward) on a
synthetic associative-recall task, on the CPU through Triton's interpreter, and check that it learns.

Task. Keys are tokens 0-7, values tokens 8-15 (vocabulary 16). A sequence holds 4 (key, value)
pairs with distinct keys and distinct values, then 28 queries: a key drawn (with replacement) from
the 4 and its value, T = 2 * (4 + 28) = 64. At every query key the model predicts the next token,
the value bound to that key in this sequence; the loss is the cross-entropy over those positions.

Baselines (what a model that does not recall reaches). Uniform over the vocabulary: log 16 = 2.77;
"some value token": log 8 = 2.08; "one of the 4 values in this sequence", chosen without matching
the key: log 4 = 1.39 (the best possible without key matching: values are drawn at random per
sequence). The test asks for a final loss below half of that, 0.69, i.e. the model must bind
values to keys; and below 0.6 x the initial loss.

Model: embedding -> 2 x [pre-norm, a width-2 causal token shift (the short convolution that Gated
DeltaNet and KDA layers carry; without it two layers do not find the recall circuit in 200 steps),
linear projections to q, k, v, g (log-decay), beta -> gated_deltanet's mixer.chunk -> output
projection, residual] -> logits over the vocabulary.

Sizes are set by the interpreter's cost, which grows with (programs launched) x (operations per
program), not with T below the chunk size: gated_deltanet's chunk is 64 tokens, so one sequence of
T = 64 with one head costs the same as T = 16, and each extra sequence or head adds a program.
Measured on 2 cores: one layer's forward + backward takes ~0.2 s with keep_intermediates=True
(~0.4 s with the default recompute), so the loop trains on one sequence per step (B = 1, H = 1,
K = V = 16, d_model = 32) with keep_intermediates=True: 200 steps in ~95 s. (That the kept and the
recomputed backward agree is tested in tests/test_backward.py.)
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lrdsl

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if os.environ.get("LRDSL_TEST_DEVICE") == "cuda" else "cpu"

N_KEYS, N_VALUES, N_PAIRS, N_QUERIES = 8, 8, 4, 28
VOCAB = N_KEYS + N_VALUES
T = 2 * (N_PAIRS + N_QUERIES)
D_MODEL, H, K, V = 32, 1, 16, 16
STEPS, LR = 200, 1e-2


def recall_batch(batch: int, gen: torch.Generator):
    """(tokens [batch, T], targets [batch, T]; -100 where nothing is predicted)."""
    keys = torch.stack([torch.randperm(N_KEYS, generator=gen)[:N_PAIRS] for _ in range(batch)])
    values = torch.stack([torch.randperm(N_VALUES, generator=gen)[:N_PAIRS] for _ in range(batch)])
    which = torch.randint(0, N_PAIRS, (batch, N_QUERIES), generator=gen)
    q_keys, q_values = keys.gather(1, which), values.gather(1, which)
    context = torch.stack([keys, values + N_KEYS], -1).reshape(batch, -1)
    queries = torch.stack([q_keys, q_values + N_KEYS], -1).reshape(batch, -1)
    tokens = torch.cat([context, queries], 1)
    targets = torch.full_like(tokens, -100)
    targets[:, 2 * N_PAIRS::2] = q_values + N_KEYS  # at a query key: the next token, its value
    return tokens, targets


class MixerLayer(nn.Module):
    def __init__(self, mixer):
        super().__init__()
        self.mixer = mixer
        self.norm = nn.LayerNorm(D_MODEL)
        self.proj = nn.Linear(2 * D_MODEL, H * (2 * K + V + 2))  # q, k, v, g, beta per head
        self.out = nn.Linear(H * V, D_MODEL)

    def forward(self, x, impl="chunk"):
        B, L, _ = x.shape
        h = self.norm(x)
        h = torch.cat([h, F.pad(h, (0, 0, 1, 0))[:, :-1]], -1)  # token shift: [x_t, x_{t-1}]
        q, k, v, g, beta = self.proj(h).view(B, L, H, 2 * K + V + 2).split([K, K, V, 1, 1], -1)
        g = F.logsigmoid(g[..., 0] + 3.0)  # log-decay <= 0, starting near 0 (long memory)
        beta = torch.sigmoid(beta[..., 0])  # in (0, 1)
        o, _ = getattr(self.mixer, impl)(q.contiguous(), k.contiguous(), v.contiguous(),
                                         g=g.contiguous(), beta=beta.contiguous())
        return x + self.out(o.reshape(B, L, H * V))


class RecallModel(nn.Module):
    def __init__(self, mixer):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.layers = nn.ModuleList([MixerLayer(mixer), MixerLayer(mixer)])
        self.head = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens, impl="chunk"):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, impl)
        return self.head(x)


@pytest.mark.slow
def test_two_layer_model_learns_associative_recall_through_chunk():
    mixer = lrdsl.compile(ROOT / "examples" / "gated_deltanet.lr", keep_intermediates=True)
    torch.manual_seed(0)
    model = RecallModel(mixer).to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1)
    losses = []
    start = time.perf_counter()
    for _ in range(STEPS):
        tokens, targets = (t.to(DEVICE) for t in recall_batch(1, gen))
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    report = (f"{STEPS} steps in {seconds:.1f}s; mean loss of the first 20 steps {first:.3f}, of the "
              f"last 20 {last:.3f}; chance log {VOCAB} = {math.log(VOCAB):.2f}, no-recall baseline "
              f"log {N_PAIRS} = {math.log(N_PAIRS):.2f}")
    print(report)
    assert math.isfinite(last)
    assert first > math.log(N_VALUES), report  # it starts at chance (the task is not trivial)
    assert last < 0.6 * first, report
    assert last < 0.5 * math.log(N_PAIRS), report  # recalls: well below the best no-recall loss

    # Held out: the trained model recalls on fresh sequences, and the decode path (the fused
    # recurrent kernel, forward-only) gives the same logits as the chunked kernels.
    tokens, targets = (t.to(DEVICE) for t in recall_batch(4, torch.Generator().manual_seed(2)))
    with torch.no_grad():
        logits = model(tokens)
        logits_rec = model(tokens, impl="recurrent")
    mask = targets != -100
    accuracy = (logits.argmax(-1)[mask] == targets[mask]).float().mean().item()
    assert accuracy > 0.8, f"held-out recall accuracy {accuracy:.2f}; {report}"
    err = ((logits_rec - logits).pow(2).mean().sqrt() / logits.pow(2).mean().sqrt()).item()
    assert err < 1e-4, f"recurrent vs chunk logits: rms ratio {err:.3g}"
