"""What the command line parses without importing torch: comma lists of integers, and the settings of
`lrdsl mqar` (its Config, whose field defaults are the CLI's defaults: one source for both)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from lrdsl.errors import LrdslError


def comma_ints(text: str, count: int | None = None) -> tuple:
    """'4, 8,16' -> (4, 8, 16): positive integers separated by commas (exactly count of them when
    given), in the order written; ValueError with the text otherwise."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isascii() and p.isdigit() and int(p) > 0 for p in parts) or count not in (None, len(parts)):
        raise ValueError(f"expected {'' if count is None else f'{count} '}positive integers separated by "
                         f"commas, got {text!r}")
    return tuple(int(p) for p in parts)


@dataclass(frozen=True)
class Config:
    """MQAR's model, data and training sizes (lrdsl.mqar). The CLI's flag for a field is its name
    with dashes (--n-layers is spelt --layers)."""
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

    def eval_batches(self) -> int:
        """Forward passes of the evaluation: eval_sequences per setting, batch at a time."""
        return len(self.settings()) * -(-self.eval_sequences // self.batch)

    def validate(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "heads", "head_dim", "steps", "batch", "eval_sequences"):
            if getattr(self, name) < 1:
                flag = "layers" if name == "n_layers" else name.replace("_", "-")
                raise LrdslError(f"--{flag} must be at least 1, got {getattr(self, name)}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise LrdslError(f"--lr must be a positive number, got {self.lr}")
        if not self.settings():
            raise LrdslError(f"no setting fits: a sequence of T tokens holds at most T / 4 pairs (pairs and "
                             f"their queries), and the largest T is {max(self.seq_lens)} while the fewest pairs "
                             f"asked for is {min(self.pairs)}; add longer --seq-lens or fewer --pairs")
        if self.vocab // 2 - 1 < max(p for _, p in self.settings()):
            raise LrdslError(f"--vocab {self.vocab} has {self.vocab // 2 - 1} key tokens, fewer than the "
                             f"{max(p for _, p in self.settings())} distinct keys a sequence needs; raise --vocab")
