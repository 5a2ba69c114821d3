"""Hugging Face models around lrdsl.nn.Layer: `pip install 'lrdsl[hf]'`, then `import lrdsl.hf` registers
model_type "lrdsl" with AutoConfig, AutoModel and AutoModelForCausalLM.

    config = lrdsl.hf.LrdslConfig(spec="examples/gated_deltanet.lr", vocab_size=..., hidden_size=...,
                                  num_hidden_layers=..., num_heads=...)
    model = AutoModelForCausalLM.from_config(config)   # train; save_pretrained; from_pretrained; generate

The config carries the spec's text, so a saved folder needs no .lr file beside it. See docs/hf.md.
"""
try:
    import transformers  # noqa: F401
except ImportError:  # pragma: no cover - the message is the point
    raise ImportError("lrdsl.hf needs transformers: pip install 'lrdsl[hf]'") from None

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from lrdsl.hf.config import LrdslConfig
from lrdsl.hf.fla import fla_state_dict, load_fla_state_dict
from lrdsl.hf.model import LrdslCache, LrdslForCausalLM, LrdslModel, LrdslPreTrainedModel

AutoConfig.register(LrdslConfig.model_type, LrdslConfig, exist_ok=True)
AutoModel.register(LrdslConfig, LrdslModel, exist_ok=True)
AutoModelForCausalLM.register(LrdslConfig, LrdslForCausalLM, exist_ok=True)

__all__ = ["LrdslCache", "LrdslConfig", "LrdslForCausalLM", "LrdslModel", "LrdslPreTrainedModel", "fla_state_dict",
           "load_fla_state_dict"]
