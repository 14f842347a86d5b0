"""Ready factories for tiny `transformers` models, built offline from a config (no weights are
downloaded): `--model fsdp_verify.models.hf:tiny_llama` or `...:tiny_qwen2` (tied embeddings).
Needs the `hf` extra (`pip install 'fsdp-verify[hf]'`).

Every knob that would make the two sides differ for reasons other than sharding is fixed:
dropout off (attention_dropout 0), no KV cache, `eager` attention (a plain matmul and softmax,
deterministic on CPU; pass attn_implementation="sdpa" to test that path). transformers draws
initial values from the global generator in `post_init`, which the toolkit seeds before it calls
the factory, so every rank and the reference build the same weights."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config is all these factories read: never the network

TINY = {
    "vocab_size": 61,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
}


def _config(config_cls: type, overrides: dict[str, Any]) -> Any:
    # A config takes any keyword and keeps it as an attribute nobody reads: a misspelt field
    # (`num_hiden_layers`) would silently build the default model. Refuse what the config lacks.
    known = set(config_cls().to_dict()) | {"attn_implementation"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"{config_cls.__name__} has no field {unknown[0]!r} (a misspelt kwarg?)")
    values = {**TINY, "attention_dropout": 0.0, "use_cache": False, "attn_implementation": "eager", **overrides}
    return config_cls(**values)


def tiny_llama(**overrides: Any) -> nn.Module:
    """`LlamaForCausalLM`, 2 decoder layers of width 16, grouped-query attention (2 heads, 1 KV
    head), untied embeddings. Wrap plan: `--wrap LlamaDecoderLayer`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(_config(LlamaConfig, overrides))


def tiny_qwen2(**overrides: Any) -> nn.Module:
    """`Qwen2ForCausalLM` with `tie_word_embeddings=True` (lm_head shares the input embedding:
    both must sit in one shard unit, the root). Wrap plan: `--wrap Qwen2DecoderLayer`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(_config(Qwen2Config, {"tie_word_embeddings": True, **overrides}))
