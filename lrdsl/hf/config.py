"""LrdslConfig: the sizes of a causal LM of spec mixers, and the spec's text itself."""
from __future__ import annotations

import os

from transformers import PretrainedConfig

from lrdsl.errors import InputError


def spec_text(spec) -> str | None:
    """The text of a spec given as a path (os.PathLike, or one line ending in .lr) or as its text."""
    if spec is None:
        return None
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and "\n" not in spec and spec.strip().endswith(".lr")):
        from lrdsl.api import _read_spec
        return _read_spec(os.fspath(spec)).decode("utf-8")
    if isinstance(spec, bytes):
        return spec.decode("utf-8")
    if isinstance(spec, str):
        return spec
    raise InputError(f"spec must be a path to a .lr file or the spec's text, not {type(spec).__name__}")


class LrdslConfig(PretrainedConfig):
    """A stack of blocks (RMSNorm -> mixer -> residual, RMSNorm -> gated MLP -> residual) over token
    embeddings. spec: a .lr path or the spec text (stored as text, saved in config.json). The mixer
    layers are lrdsl.nn.Layer(spec, hidden_size, num_heads, head_dim, num_v_heads, head_v_dim, ...);
    attn_layers: indices of blocks that use causal softmax attention (RoPE, num_attention_heads)
    instead, as hybrid models do. intermediate_size: the MLP's width (default about 8/3 hidden_size,
    a multiple of 32)."""

    model_type = "lrdsl"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, spec=None, vocab_size: int = 32000, hidden_size: int = 256, num_hidden_layers: int = 2,
                 num_heads: int = 4, head_dim: int | None = None, num_v_heads: int | None = None,
                 head_v_dim: int | None = None, intermediate_size: int | None = None, norm_eps: float = 1e-6,
                 use_short_conv: bool = True, conv_size: int = 4, use_output_gate: bool = True,
                 attn_layers=(), num_attention_heads: int | None = None, rope_theta: float = 10000.0,
                 initializer_range: float = 0.02, tie_word_embeddings: bool = False, use_cache: bool = True,
                 **kwargs):
        self.spec = spec_text(spec)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads if head_dim is None else head_dim
        self.num_v_heads = num_v_heads
        self.head_v_dim = head_v_dim
        self.intermediate_size = 32 * -(-hidden_size * 8 // 96) if intermediate_size is None else intermediate_size
        self.norm_eps = norm_eps
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.use_output_gate = use_output_gate
        self.attn_layers = sorted(int(i) for i in attn_layers)
        bad = [i for i in self.attn_layers if not 0 <= i < num_hidden_layers]
        if bad:
            raise InputError(f"attn_layers {bad} are not block indices: there are {num_hidden_layers} blocks "
                             f"(0 to {num_hidden_layers - 1})")
        self.num_attention_heads = num_heads if num_attention_heads is None else num_attention_heads
        if self.attn_layers and hidden_size % self.num_attention_heads:
            raise InputError(f"hidden_size ({hidden_size}) must be a multiple of num_attention_heads "
                             f"({self.num_attention_heads}) for the attention layers")
        self.rope_theta = rope_theta
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
