"""LrdslModel and LrdslForCausalLM: blocks of a spec mixer (lrdsl.nn.Layer) or softmax attention, each
followed by a gated MLP; generation with the layers' recurrent states as the cache (LrdslCache).

attention_mask [B, S] (1: a token, 0: padding; S counts the cached tokens too, as transformers
passes it) is turned into packed sequences inside each mixer layer, so a left-padded batch gives
each prompt the outputs it has alone; attention layers mask the padded keys instead.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from lrdsl.errors import InputError
from lrdsl.hf.config import LrdslConfig
from lrdsl.nn import Cache, Layer


class LrdslCache:
    """What generate carries between steps: per block an lrdsl.nn.Cache (mixer layers: recurrent and
    convolution states) or (k, v) [B, heads, S, head_dim] (attention layers), and the number of tokens
    seen. Decoding updates the mixers' states in place. Beam search reorders it (reorder_cache); a
    recurrent state cannot be rolled back, so crop (assisted decoding) is refused."""

    is_compileable = False

    def __init__(self, num_layers: int):
        self.layers = [None] * num_layers
        self.seen = 0

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def __setitem__(self, i, entry) -> None:
        self.layers[i] = entry

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep the sequences at beam_idx, in that order (beam search, after each step)."""
        self.layers = [_select(e, beam_idx) for e in self.layers]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        B = next((_batch(e) for e in self.layers if e is not None), 0)
        self.reorder_cache(torch.arange(B).repeat_interleave(repeats))

    def crop(self, max_length: int) -> None:
        raise InputError("an lrdsl cache holds recurrent states, which cannot be rolled back to an earlier "
                         "token; generate without assisted decoding or prompt lookup")


def _select(entry, index: torch.Tensor):
    if entry is None:
        return None
    if isinstance(entry, Cache):
        return entry.select(index.to(entry.conv[0].device if entry.conv else _device(entry)))
    return tuple(t[index.to(t.device)] for t in entry)


def _device(c: Cache) -> torch.device:
    return (c.state.S if hasattr(c.state, "S") else c.state).device


def _batch(entry) -> int:
    if isinstance(entry, Cache):
        return (entry.state.S if hasattr(entry.state, "S") else entry.state).shape[0]
    return entry[0].shape[0]


class LrdslMLP(nn.Module):
    """down(SiLU(gate(x)) * up(x))."""

    def __init__(self, config: LrdslConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LrdslAttention(nn.Module):
    """Causal softmax attention with rotary positions counted over each row's tokens (padding skipped),
    for hybrid models; its cache is (k, v) [B, heads, S, head_dim], keys already rotated."""

    def __init__(self, config: LrdslConfig):
        super().__init__()
        D, self.heads = config.hidden_size, config.num_attention_heads
        self.head_dim = D // self.heads
        self.theta = config.rope_theta
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D, bias=False) for _ in range(4))

    def _rotate(self, x, pos):
        """RoPE: x [B, heads, T, d], pos [B, T]."""
        half = self.head_dim // 2
        freq = self.theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
        angle = pos.float()[:, None, :, None] * freq  # [B, 1, T, half]
        cos, sin = angle.cos(), angle.sin()
        a, b = x.float()[..., :half], x.float()[..., half:2 * half]
        return torch.cat([a * cos - b * sin, a * sin + b * cos, x.float()[..., 2 * half:]], -1).to(x.dtype)

    def forward(self, x, mask, past, use_cache):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.heads, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj,
                                                                                      self.v_proj))
        P = 0 if past is None else past[0].shape[2]
        S = P + T
        valid = torch.ones(B, S, dtype=torch.bool, device=x.device) if mask is None else mask.to(x.device) != 0
        if valid.shape[1] != S:
            raise InputError(f"attention_mask has {valid.shape[1]} columns but the cache and the new tokens are {S}: "
                             "pass the mask of every token seen so far")
        pos = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, P:]  # each row's token count: padding adds none
        q, k = self._rotate(q, pos), self._rotate(k, pos)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        t = torch.arange(P, S, device=x.device)
        allowed = valid[:, None, :] & (torch.arange(S, device=x.device) <= t[:, None])  # [B, T, S]
        allowed[:, torch.arange(T), t] = True  # a padding query sees itself: no row without a key (no nan)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), ((k, v) if use_cache else None)


class LrdslBlock(GradientCheckpointingLayer):
    """x + mixer(RMSNorm(x)), then x + MLP(RMSNorm(x)); the mixer is an lrdsl.nn.Layer or attention."""

    def __init__(self, config: LrdslConfig, layer_idx: int, mixer):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_attention = layer_idx in config.attn_layers
        self.mixer_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        if self.is_attention:
            self.mixer = LrdslAttention(config)
        else:
            self.mixer = Layer(mixer, config.hidden_size, config.num_heads, config.head_dim, config.num_v_heads,
                               config.head_v_dim, use_short_conv=config.use_short_conv, conv_size=config.conv_size,
                               use_output_gate=config.use_output_gate, norm_eps=config.norm_eps)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = LrdslMLP(config)

    def forward(self, hidden_states, attention_mask=None, token_mask=None, past_key_values=None, use_cache=False):
        """attention_mask [B, S] over every token seen (attention layers), token_mask [B, T] over the
        new ones (mixer layers); None where there is no padding. past_key_values: this block's entry."""
        h = self.mixer_norm(hidden_states)
        if self.is_attention:
            y, state = self.mixer(h, attention_mask, past_key_values, use_cache)
        else:
            y, state = self.mixer(h, past_key_values, use_cache, attention_mask=token_mask)
        x = hidden_states + y
        return x + self.mlp(self.mlp_norm(x)), state


class LrdslPreTrainedModel(PreTrainedModel):
    config_class = LrdslConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LrdslBlock"]
    _is_stateful = True  # generate leaves the cache to the model (no DynamicCache), no assisted decoding

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Layer):  # its own params: Mamba-2's decays, the spec's inits, the norm
            module.reset_decays()
            module.reset_params()
            nn.init.ones_(module.o_norm_weight)


class LrdslModel(LrdslPreTrainedModel):
    def __init__(self, config: LrdslConfig):
        super().__init__(config)
        if not config.spec:
            raise InputError("LrdslConfig has no spec: pass spec= (a path to a .lr file or the spec's text)")
        import lrdsl
        mixer = lrdsl.compile(text=config.spec)  # one Mixer for every layer: its kernels load once
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LrdslBlock(config, i, mixer) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, output_hidden_states=None, return_dict=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise InputError("pass exactly one of input_ids and inputs_embeds")
        x = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = (self.config.use_cache if use_cache is None else use_cache) or past_key_values is not None
        if self.gradient_checkpointing and self.training:
            use_cache = False  # checkpointed blocks run twice: a cache would see every token twice
        if past_key_values is not None and not isinstance(past_key_values, LrdslCache):
            raise InputError(f"past_key_values must be the LrdslCache this model returned, not "
                             f"{type(past_key_values).__name__}")
        if use_cache and past_key_values is None:
            past_key_values = LrdslCache(len(self.layers))
        T = x.shape[1]
        full_mask = token_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != x.shape[0] or attention_mask.shape[1] < T:
                raise InputError(f"attention_mask must be [B, S] with B = {x.shape[0]} and S >= T = {T} (1: token, "
                                 f"0: padding), got {list(attention_mask.shape)}")
            if not bool(attention_mask.all()):  # one host read per forward, not one per layer
                full_mask, token_mask = attention_mask, attention_mask[:, -T:]
                if bool(token_mask.all()):
                    token_mask = None
        states = () if output_hidden_states else None
        for i, block in enumerate(self.layers):
            if output_hidden_states:
                states += (x,)
            entry = past_key_values[i] if past_key_values is not None else None
            x, new = block(x, attention_mask=full_mask, token_mask=token_mask, past_key_values=entry,
                           use_cache=use_cache)
            if use_cache:
                past_key_values[i] = new
        x = self.norm(x)
        if output_hidden_states:
            states += (x,)
        if use_cache:
            past_key_values.seen += T
        return BaseModelOutputWithPast(last_hidden_state=x, past_key_values=past_key_values if use_cache else None,
                                       hidden_states=states)


class LrdslForCausalLM(LrdslPreTrainedModel, GenerationMixin):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config: LrdslConfig):
        super().__init__(config)
        self.model = LrdslModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def get_decoder(self):
        return self.model

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None, labels=None,
                use_cache=None, output_hidden_states=None, return_dict=None, logits_to_keep: int = 0, **kwargs):
        """labels [B, T]: next-token targets aligned with input_ids (shifted inside), -100 ignored."""
        out = self.model(input_ids, attention_mask, past_key_values, inputs_embeds, use_cache, output_hidden_states)
        h = out.last_hidden_state
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values,
                                      hidden_states=out.hidden_states)
