"""Broken engines for the ownership, RNG and shared-state checks' own tests (loaded by file path).
The named mutants of the bug zoo live in verify/zoo/mutants/; these are the extra ones the tests
need to prove each check can fail."""

import dataclasses

import torch
from torch.distributed.fsdp import fully_shard

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.models.transformer import rope_frequencies

_runs = 0


def skips_first_unit(model, mesh, spec):
    """Drops the first module of the wrap plan (an auto-wrap policy that missed a class): its
    parameters land in the parent unit. Numerically equivalent, so only ownership can see it."""
    return fully_shard_engine(model, mesh, dataclasses.replace(spec, wrap=spec.wrap[1:]))


def root_not_wrapped(model, mesh, spec):
    """Shards the blocks but never calls fully_shard on the root: the embedding, final norm and
    head stay plain replicated tensors whose gradients are never reduced."""
    for fqn in spec.wrap:
        if fqn:
            fully_shard(model.get_submodule(fqn), mesh=mesh, mp_policy=spec.mp_policy)
    return model


def buffers_reinitialised_with_other_defaults(model, mesh, spec):
    """Re-runs buffer init with the engine's own default config (RoPE theta 500000, Llama 3's)
    instead of the model's (10000): every rank agrees, the reference does not."""
    if hasattr(model, "freqs"):
        with torch.no_grad():
            model.freqs.copy_(rope_frequencies(model.head_dim, model.seq_len, theta=500000.0))
    return fully_shard_engine(model, mesh, spec)


def leaks_state_between_runs(model, mesh, spec):
    """Keeps a module-level counter across runs in one long-lived process (a warm-up schedule or
    cache keyed by call count) and nudges the initial weights by it: a rerun starts elsewhere."""
    global _runs
    _runs += 1
    with torch.no_grad():
        for p in model.parameters():
            p.add_(_runs * 1e-6)
    return fully_shard_engine(model, mesh, spec)
