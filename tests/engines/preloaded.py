"""An engine that fails unless its rank was forked with a model library already imported: the one
its pool's process had loaded (verify/sharded/zygote.py, WARM_WHEN_LOADED). Imported in the rank
after its fork, before any case of its needs that library (an MLP's does not)."""

import sys

from fsdp_verify.engines.fsdp2 import fully_shard_engine

LIBRARY = "transformers.models.llama.modeling_llama"
FOUND_AT_FORK = LIBRARY in sys.modules


def library_preloaded(model, mesh, spec):
    if not FOUND_AT_FORK:
        raise RuntimeError(f"{LIBRARY} was not imported when this rank started")
    return fully_shard_engine(model, mesh, spec)
