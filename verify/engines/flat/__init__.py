"""A compact FlatParameter engine with an FSDP2-like API: the bundled `--engine flat`, and a
worked example for anyone writing their own FSDP. One concern per file, read in this order:

* flat_param.py: FlatParameter: a unit's parameters flattened, padded to a multiple of the world
  size, cut into rank-ordered chunks; per-parameter views of this rank's chunk for the optimizer.
* unit.py: FlatUnit: all-gather before forward and again before backward, reduce-scatter of the
  gradient (averaged, in reduce_dtype) after backward, param_dtype/output_dtype casts.
* api.py: `fully_shard(module, mesh=..., mp_policy=..., reshard_after_forward=...)`, children
  first, and the rule that keeps a parameter out of two FlatParameters (seed 004).
* meta_init.py: building on the meta device and materialising so the values equal an eager build.
* view.py: FlatView, how the toolkit reads any flat-buffer engine (FSDP1's too).
* engine.py: `flat_engine(model, mesh, spec)`, the engine function, and its view.

Known bugs of such engines live in verify/zoo/mutants/fsdp1_and_flat.py:
`flat_nested_double_ownership` (seed 004's `parameters(recurse=True)` on the root) and
`flat_meta_init_consumes_rng`.
"""

from fsdp_verify.engines.flat.api import fully_shard, shard_all, units
from fsdp_verify.engines.flat.engine import flat_engine
from fsdp_verify.engines.flat.flat_param import FlatParameter
from fsdp_verify.engines.flat.meta_init import construct_on_meta, materialize

__all__ = ["FlatParameter", "construct_on_meta", "flat_engine", "fully_shard", "materialize", "shard_all", "units"]
