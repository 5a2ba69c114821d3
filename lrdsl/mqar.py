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

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lrdsl.errors import LrdslError
from lrdsl.nn import Layer


@dataclass(frozen=True)
class Config:
    # Sized for a GPU run of a minute or two per spec. On a CPU (one seed, these settings but
    # batch 32) gated_deltanet's loss sat near log(128 values) for some hundreds of steps, then it
    # learnt recall: after 2000 steps 0.99 / 0.97 / 0.87 / 0.57 at T = 128 and 4 / 8 / 16 / 32
    # pairs. Zoology's main vocabulary, 8192, spreads the same steps over 32 times more tokens
    # (not tried here).
    seq_lens: tuple = (64, 128)
    pairs: tuple = (4, 8, 16, 32)
    vocab: int = 256
    d_model: int = 128
    n_layers: int = 2
    heads: int = 4
    head_dim: int = 32
    steps: int = 3000
    batch: int = 128
    lr: float = 3e-3
    eval_sequences: int = 256  # per setting
    seed: int = 0

    def settings(self) -> list:
        """Every (T, pairs) that fits: the pairs and their queries need 4 * pairs tokens."""
        return [(T, p) for T in self.seq_lens for p in self.pairs if 4 * p <= T]

    def validate(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "heads", "head_dim", "steps", "batch", "eval_sequences"):
            if getattr(self, name) < 1:
                raise LrdslError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise LrdslError(f"--lr must be a positive number, got {self.lr}")
        if not self.settings():
            raise LrdslError(f"no setting fits: a sequence of T tokens holds at most T / 4 pairs (pairs and "
                             f"their queries), and the largest T is {max(self.seq_lens)} while the fewest pairs "
                             f"asked for is {min(self.pairs)}; add longer --seq-lens or fewer --pairs")
        if self.vocab // 2 - 1 < max(p for _, p in self.settings()):
            raise LrdslError(f"--vocab {self.vocab} has {self.vocab // 2 - 1} key tokens, fewer than the "
                             f"{max(p for _, p in self.settings())} distinct keys a sequence needs; raise --vocab")


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


def _lr_at(step: int, cfg: Config) -> float:
    warm = max(1, cfg.steps // 10)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, cfg.steps - warm)))


def _loss(model, tokens, targets, device):
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(tokens.to(device))
    return F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten(), ignore_index=-100), logits


def train(mixer, cfg: Config, device, progress=None) -> tuple:
    """Train one model on the spec's mixer; (losses per step, {(T, pairs): accuracy})."""
    device = torch.device(device)
    torch.manual_seed(cfg.seed)
    model = Model(mixer, cfg).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    settings, gen, losses = cfg.settings(), torch.Generator().manual_seed(cfg.seed), []
    for step in range(cfg.steps):
        T, pairs = settings[step % len(settings)]
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss, _ = _loss(model, *batch(cfg.batch, T, pairs, cfg.vocab, gen), device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step + 1, cfg.steps, losses[-1])
    accuracy, held_out = {}, torch.Generator().manual_seed(cfg.seed + 1)
    model.eval()
    with torch.no_grad():
        for T, pairs in settings:
            right = total = 0
            for start in range(0, cfg.eval_sequences, cfg.batch):
                n = min(cfg.batch, cfg.eval_sequences - start)
                tokens, targets = batch(n, T, pairs, cfg.vocab, held_out)
                _, logits = _loss(model, tokens, targets, device)
                mask = targets.to(device) != -100
                right += (logits.argmax(-1)[mask] == targets.to(device)[mask]).sum().item()
                total += mask.sum().item()
            accuracy[(T, pairs)] = right / total
    return losses, accuracy


class Progress:
    """A text progress bar on stderr (tqdm's when it is installed), one per spec."""

    def __init__(self, label: str):
        self.label, self.bar = label, None
        try:
            from tqdm import tqdm
            self.bar = tqdm(desc=label, unit="step", file=sys.stderr, leave=True)
        except ImportError:
            pass

    def __call__(self, done: int, total: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.bar.update(done - self.bar.n)
            return
        if done % max(1, total // 100) and done != total:
            return  # a hundred redraws at most
        filled = 30 * done // total
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} loss {loss:.3f}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")


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


def plot(results: dict, cfg: Config, path: str) -> None:
    """Accuracy against the number of pairs, one line per spec, one panel per sequence length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lens = sorted({T for T, _ in cfg.settings()})
    fig, axes = plt.subplots(1, len(lens), figsize=(4 * len(lens), 3.4), squeeze=False, sharey=True)
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
    fig.suptitle(f"MQAR after {cfg.steps} steps (d_model {cfg.d_model}, {cfg.n_layers} "
                 f"layer{'s' if cfg.n_layers > 1 else ''}, {cfg.heads} heads of {cfg.head_dim})")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise LrdslError(f"cannot write the plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
