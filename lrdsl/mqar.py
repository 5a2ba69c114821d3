"""`lrdsl mqar`: multi-query associative recall (MQAR, the Zoology setting), one small model per spec.

A sequence of T tokens starts with `pairs` key-value pairs (keys drawn without replacement from the
lower half of the vocabulary, values from the upper half); every key is then queried once, in a
random order, at random even positions of the rest; token 0 fills everything else. At a query key
the model must predict the value bound to it earlier in the same sequence; accuracy is measured
over those positions only. The answer is never shown after its query (as in Zoology): with the
answers shown, a model can score without binding keys to values, by guessing among the values
not yet shown after a query ((1 + 1/2 + ... + 1/P) / P over P pairs: 0.52 at 4 pairs, 0.34 at 8),
and training stalled there. (Zoology spaces the queries by a power law; here the positions are
uniform, which makes long gaps more common.)

Model, per spec: embedding -> n_layers x [x + Layer(RMSNorm(x)), x + MLP(RMSNorm(x))] -> RMSNorm ->
linear head. Training: Adam, batches of one (T, pairs) setting in turn, linear warm-up then cosine
decay, bf16 autocast on a GPU. Every spec sees the same data and the same initial embeddings.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lrdsl.errors import LrdslError
from lrdsl.nn import Layer
from lrdsl.options import Config


def batch(n: int, T: int, pairs: int, vocab: int, gen: torch.Generator):
    """(tokens [n, T], targets [n, T]: the value at each query key, -100 elsewhere), on the CPU."""
    half = vocab // 2
    keys = torch.rand(n, half - 1, generator=gen).argsort(-1)[:, :pairs] + 1  # distinct, never 0
    values = torch.randint(half, vocab, (n, pairs), generator=gen)
    tokens = torch.zeros(n, T, dtype=torch.long)
    tokens[:, 0:2 * pairs:2], tokens[:, 1:2 * pairs:2] = keys, values
    slots = (T - 2 * pairs) // 2  # even positions after the pairs, each holding a query and its value
    pos = 2 * pairs + 2 * torch.rand(n, slots, generator=gen).argsort(-1)[:, :pairs]
    order = torch.rand(n, pairs, generator=gen).argsort(-1)
    asked, answer = keys.gather(1, order), values.gather(1, order)
    tokens.scatter_(1, pos, asked)  # pos + 1 stays 0: the answer appears only in its pair
    targets = torch.full_like(tokens, -100)
    targets.scatter_(1, pos, answer)
    return tokens, targets


class Model(nn.Module):
    def __init__(self, mixer, cfg: Config):
        super().__init__()
        d = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab, d)
        self.mixers = nn.ModuleList([Layer(mixer, d, cfg.heads, cfg.head_dim) for _ in range(cfg.n_layers)])
        self.mlps = nn.ModuleList([nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                   for _ in range(cfg.n_layers)])
        self.norms = nn.ModuleList([nn.RMSNorm(d) for _ in range(2 * cfg.n_layers + 1)])
        self.head = nn.Linear(d, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for i, (mix, mlp) in enumerate(zip(self.mixers, self.mlps)):
            x = x + mix(self.norms[2 * i](x))[0]
            x = x + mlp(self.norms[2 * i + 1](x))
        return self.head(self.norms[-1](x))


def schedule(opt, cfg: Config):
    """Linear warm-up over the first tenth of the steps to cfg.lr, then cosine decay to 0 by the
    last step (call .step() after each optimizer step)."""
    warm, sched = max(1, cfg.steps // 10), torch.optim.lr_scheduler
    return sched.SequentialLR(opt, [sched.LinearLR(opt, 1 / warm, 1.0, max(1, warm - 1)),
                                    sched.CosineAnnealingLR(opt, max(1, cfg.steps - warm))], [warm])


def _loss(model, tokens, targets, device):
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(tokens.to(device))
    return F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten(), ignore_index=-100), logits


def train(mixer, cfg: Config, device, progress=None) -> tuple:
    """Train one model on the spec's mixer; (losses per step, {(T, pairs): accuracy}).
    progress(done, total, loss) is called after each training step and then after each evaluation
    batch (loss None), total being cfg.steps + cfg.eval_batches()."""
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    model = Model(mixer, cfg).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    lr = schedule(opt, cfg)
    settings, gen, losses = cfg.settings(), torch.Generator().manual_seed(cfg.seed), []
    total = cfg.steps + cfg.eval_batches()
    for step in range(cfg.steps):
        T, pairs = settings[step % len(settings)]
        loss, _ = _loss(model, *batch(cfg.batch, T, pairs, cfg.vocab, gen), device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lr.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step + 1, total, losses[-1])
    accuracy, held_out, done = {}, torch.Generator().manual_seed(cfg.seed + 1), cfg.steps
    model.eval()
    with torch.no_grad():
        for T, pairs in settings:
            right = count = 0
            for start in range(0, cfg.eval_sequences, cfg.batch):
                n = min(cfg.batch, cfg.eval_sequences - start)
                tokens, targets = batch(n, T, pairs, cfg.vocab, held_out)
                _, logits = _loss(model, tokens, targets, device)
                mask = targets.to(device) != -100
                right += (logits.argmax(-1)[mask] == targets.to(device)[mask]).sum().item()
                count += mask.sum().item()
                done += 1
                if progress is not None:
                    progress(done, total, None)
            accuracy[(T, pairs)] = right / count
    return losses, accuracy


def table(results: dict, cfg: Config) -> str:
    """One line per spec and setting: accuracy, with the final training loss."""
    lines = [f"{'spec':<28} {'T':>5} {'pairs':>6} {'accuracy':>9}"]
    for name, (losses, acc) in results.items():
        for (T, pairs), a in acc.items():
            lines.append(f"{name:<28} {T:>5} {pairs:>6} {a:>9.3f}")
        tail = losses[-min(len(losses), 20):]
        lines.append(f"{name:<28} final training loss {sum(tail) / len(tail):.3f} after {cfg.steps} steps")
    return "\n".join(lines)


def plot_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def figure(results: dict, cfg: Config):
    """Accuracy against the number of pairs, one line per spec, one panel per sequence length, under
    a two-line title that fits a single panel's width."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lens = sorted({T for T, _ in cfg.settings()})
    fig, axes = plt.subplots(1, len(lens), figsize=(max(4.5, 4 * len(lens)), 3.8), squeeze=False, sharey=True,
                             layout="constrained")
    for ax, T in zip(axes[0], lens):
        for name, (_, acc) in results.items():
            xs = sorted(p for t, p in acc if t == T)
            ax.plot(xs, [acc[(T, p)] for p in xs], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ticks = sorted(p for t, p in cfg.settings() if t == T)
        ax.set_xticks(ticks, [str(p) for p in ticks])
        ax.minorticks_off()
        ax.set_title(f"T = {T}")
        ax.set_xlabel("key-value pairs")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("recall accuracy")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"MQAR after {_count(cfg.steps, 'step')}\nd_model {cfg.d_model}, {_count(cfg.n_layers, 'layer')}, "
                 f"{_count(cfg.heads, 'head')} of {cfg.head_dim}")
    return fig


def plot(results: dict, cfg: Config, path: str) -> None:
    """figure(results, cfg) saved to path (the format from its suffix)."""
    import matplotlib.pyplot as plt
    fig = figure(results, cfg)
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise LrdslError(f"cannot write the plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
