"""Tensor-parallel plans of a user's own (docs/tensor-parallel.md): a dict of module FQN to
ParallelStyle (`*` matches one name), and a function (model, tp_mesh) returning one."""

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

# The built-in Transformer's blocks split as Megatron splits them; the embedding and the head stay
# whole (replicated on every tp rank).
TRANSFORMER = {
    "layers.*.attention.wq": ColwiseParallel(),
    "layers.*.attention.wk": ColwiseParallel(),
    "layers.*.attention.wv": ColwiseParallel(),
    "layers.*.attention.wo": RowwiseParallel(),
    "layers.*.feed_forward.w1": ColwiseParallel(),
    "layers.*.feed_forward.w2": RowwiseParallel(),
    "layers.*.feed_forward.w3": ColwiseParallel(),
}


def user_lm_plan(model, tp_mesh):
    """tests/user/models.py's UserLM: each block's feed-forward pair, and the head gathered."""
    plan = {f"blocks.{i}.up": ColwiseParallel() for i in range(len(model.blocks))}
    plan.update({f"blocks.{i}.down": RowwiseParallel() for i in range(len(model.blocks))})
    plan["head"] = ColwiseParallel(output_layouts=Replicate())
    return plan
