"""A user's `transformers` GPT-2, built from its config as a user's factory would: the config's
defaults kept (`use_cache=True`, dropout 0.1), tiny for speed."""

from __future__ import annotations

import os

from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config is all this reads: never the network


def tiny_gpt2(**overrides) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        **{"vocab_size": 97, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4, "tie_word_embeddings": True}
        | overrides
    )
    return GPT2LMHeadModel(config)
