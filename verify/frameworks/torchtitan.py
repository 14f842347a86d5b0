"""torchtitan's own FSDP2 code under test: its models from its registry, its `ParallelDims` and
`parallelize_*` functions (so `apply_fsdp_to_decoder`, with its `[norm, lm_head]` unit and its
gradient division turned off), its loss, unchanged. The toolkit runs them as a user's engine
(`fsdp-verify check --framework torchtitan`: verify/frameworks/__init__.py), against its one-device
reference, with every record and contract.

What differs from a torchtitan run, and why, each a CPU substitute named in the verdict's case:

- attention: torchtitan's language models are registered with FlexAttention (its registry refuses
  `attn_backend="sdpa"`), which has no CPU backward; each block's `inner_attention` config is
  torchtitan's own `ScaledDotProductAttention` (`attention="sdpa"`, the factory's default).
- the device: torchtitan picks its device type once, at import, and without an accelerator it is
  "cuda" (`torchtitan.tools.utils.device_type`); `ParallelDims.build_mesh` is run with the mesh's
  own device type instead (the ranks' "cpu").
- gloo: with FSDP2's gradient division off torchtitan's reduce-scatter is a plain sum, which gloo
  takes only as `set_force_sum_reduction_for_comms(True)` (torchtitan sets it for symmetric memory
  only); it is set on every unit after torchtitan's parallelize.
- `n_layers` and `seq_len` shrink a flavor (its first blocks kept, RoPE's cache sized to the
  sequence) so that a case stays cheap on a CPU; the flavor's width, heads and vocabulary stay.

The loss is torchtitan's `cross_entropy_loss` (a sum over the valid tokens), normalised as its
trainer normalises it, by the step's global number of valid tokens, and the gradients summed over
the data-parallel ranks (`grad_reduction: sum`, as `disable_fsdp_gradient_division` makes FSDP2
do). The toolkit's loop applies that scale as it applies every scale (each micro-batch's sum times
dp / global tokens, then / dp for the sum: torchtitan's value to an ulp), so that the reference
emulates it bit for bit.

Under tp (`--tp N`) torchtitan applies its own sharding declarations (`model.parallelize`); the
reference emulates them as `tp_plan` translates them into torch's styles, which the knobs check
holds against the placements torchtitan built (docs/frameworks/torchtitan.md).

Its MoE (`qwen3`, `--model qwen3:debugmodel_moe`) runs with `parallelize_qwen3`; under ep (`--ep
N`) its `ExpertParallel`, all-to-all dispatch and per-parameter meshes, whose experts' weight
gradients the reference computes as their holder does (reference/grouped_gemm.py). Its load
balancing is its optimizers' pre-step hook, which the loop runs as the model's
`before_optimizer_step` (`load_balancing`).
"""

from __future__ import annotations

import tempfile
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from fsdp_verify.engines.capabilities import Capabilities
from fsdp_verify.engines.pipeline_engine import PipelineView
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.engines.view import EngineView
from fsdp_verify.integrations import require
from fsdp_verify.validation import CaseError

SPMD_BACKEND = "partial_dtensor"


def llama3(
    flavor: str = "debugmodel",
    n_layers: int | None = None,
    seq_len: int | None = None,
    attention: str = "sdpa",
    sequence_parallel: bool = True,
):
    """torchtitan's Llama 3 `flavor` from its registry, built as torchtitan builds it (its
    `param_init`s draw from the global generator, seeded by the toolkit), with the substitutes
    above. Its tensor-parallel declarations are set on the config as torchtitan's trainer sets
    them (`set_llama3_sharding_config`, sequence parallelism on by default, as its
    `enable_sequence_parallel`); they act only where `parallelize` gets a tp mesh."""
    require("torchtitan", "torchtitan")
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = _config(model_registry, flavor, n_layers, seq_len, attention)
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    model = config.build()
    model.sequence_parallel = sequence_parallel  # what `tp_plan` and `parallelize` read
    return model


def qwen3(
    flavor: str = "debugmodel_moe",
    n_layers: int | None = None,
    seq_len: int | None = None,
    attention: str = "sdpa",
    sequence_parallel: bool = True,
    experts: int | None = 8,
    top_k: int | None = 2,
    moe_hidden_dim: int | None = 64,
):
    """torchtitan's Qwen3 `flavor` (its MoE debug model by default) from its registry, built as
    `llama3` builds Llama, with its sharding declarations for expert parallelism set as its
    trainer sets them (`set_qwen3_sharding_config(enable_ep=...)`: they act only where
    `parallelize` gets an ep mesh, so they are always set). A MoE flavor's experts are shrunk for
    a CPU (`experts`, `top_k`, `moe_hidden_dim`; None keeps the flavor's 64, 8, 768: 38M
    parameters a block), its router, dispatcher and grouped GEMM unchanged."""
    require("torchtitan", "torchtitan")
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    config = _config(model_registry, flavor, n_layers, seq_len, attention)
    for block in config.layers:
        if getattr(block, "moe", None) is not None:
            _shrink_experts(block.moe, experts, top_k, moe_hidden_dim)
    set_qwen3_sharding_config(config, enable_sp=sequence_parallel, enable_ep=True)
    return _moe_model(config, sequence_parallel)


def deepseek_v3(
    flavor: str = "debugmodel",
    n_layers: int | None = None,
    seq_len: int | None = None,
    attention: str = "sdpa",
    sequence_parallel: bool = True,
):
    """torchtitan's DeepSeek-V3 `flavor` (its debug model: a dense first block, then MoE blocks of
    8 experts, 3 a token, beside shared experts; MLA attention), built as `qwen3` builds its MoE."""
    require("torchtitan", "torchtitan")
    from torchtitan.models.deepseek_v3 import model_registry
    from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

    config = _config(model_registry, flavor, n_layers, seq_len, attention)
    set_deepseek_v3_sharding_config(config, enable_sp=sequence_parallel, enable_ep=True)
    return _moe_model(config, sequence_parallel)


def _moe_model(config, sequence_parallel: bool) -> nn.Module:
    """A MoE flavor's model built from its config: initialised as torchtitan's trainer does (its
    grouped experts are `torch.empty` until `init_weights`), its load balancing the model's step
    hook for one device (the ranks' engine sets its own: `_parallelize`)."""
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.before_optimizer_step = load_balancing([model], ONE_DEVICE)
    model.sequence_parallel = sequence_parallel  # what `tp_plan` and `parallelize` read
    return model


def _config(model_registry, flavor: str, n_layers: int | None, seq_len: int | None, attention: str):
    """A flavor's model config from torchtitan's registry, its first `n_layers` blocks kept, RoPE's
    cache sized to `seq_len`, each block's inner attention the CPU's (`_cpu_attention`)."""
    config = model_registry(flavor, attn_backend="flex").model
    if n_layers is not None:
        config.layers = config.layers[:n_layers]
    for block in config.layers:
        if seq_len is not None:
            block.attention.rope.max_seq_len = seq_len
        block.attention.inner_attention = _cpu_attention(block.attention.inner_attention, attention)
    return config


def load_balancing(parts: list[nn.Module], dims):
    """torchtitan's auxiliary-loss-free load balancing, its own code: the pre-step hook that its
    `register_moe_load_balancing_hook` puts on its optimizers (each MoE block's `expert_bias_E`
    moved by its `tokens_per_expert_E`, counted in forward and summed over the "loss" mesh, then
    zeroed), for the toolkit's loop to call before each optimizer step (a model's
    `before_optimizer_step`: verify/training/optim.py). None where its MoE blocks set no
    `load_balance_coeff`. `dims`: torchtitan's `ParallelDims` on the ranks; `ONE_DEVICE` in the
    reference, whose one model has counted every emulated rank's tokens (the sum a "loss" mesh
    all-reduces)."""
    from torchtitan.components.optimizer.optimizer import register_moe_load_balancing_hook

    hooks: list = []
    register_moe_load_balancing_hook(SimpleNamespace(register_step_pre_hook=hooks.append), parts, dims)
    return hooks[0] if hooks else None


# What torchtitan's load balancing asks of its `ParallelDims` on one device: no mesh to sum over.
ONE_DEVICE = SimpleNamespace(ep_enabled=False, tp=1, get_optional_mesh=lambda *_a, **_k: None)


def _shrink_experts(moe, experts: int | None, top_k: int | None, hidden: int | None) -> None:
    """A MoE block's config with `experts` experts, `top_k` of them a token, each `hidden` wide:
    every sub-config that holds the count (the router's gate, the dispatcher, the grouped GEMM)."""
    routed = moe.routed_experts
    if experts is not None:
        moe.num_experts = routed.inner_experts.num_experts = routed.token_dispatcher.num_experts = experts
        moe.router.num_experts = moe.router.gate.out_features = experts
    if top_k is not None:
        moe.router.top_k = routed.token_dispatcher.top_k = top_k
    if hidden is not None:
        routed.inner_experts.hidden_dim = hidden


def _cpu_attention(config, attention: str):
    """The inner attention's config: torchtitan's SDPA module for `attention="sdpa"`. Set on the
    config, before the declarations, so that under tp torchtitan installs its `local_map` on it."""
    if attention == "flex":
        return config
    if attention != "sdpa":
        raise ValueError(f"attention: expected 'sdpa' or 'flex', got {attention!r}")
    from torchtitan.models.common.attention import ScaledDotProductAttention

    return ScaledDotProductAttention.Config()


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """torchtitan's own cross-entropy: the sum over the valid tokens (ignore index -100)."""
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(logits, targets)


def parallelize(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """torchtitan's `parallelize_llama` on a `ParallelDims` of the case's degrees, its world mesh
    built by torchtitan (`build_mesh`), then gloo's forced sum on every unit. With the case's
    `activation_checkpointing`, torchtitan's own default policy: `SelectiveAC` (per op: the
    matmuls, attention and reductions saved but every second matmul, the rest recomputed), as its
    trainer's config and the debug model's apply it."""
    return _parallelize(model, mesh, spec, full_ac=False)


def parallelize_full_ac(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """`parallelize` with torchtitan's `FullAC` where the case asks for activation checkpointing
    (each block recomputed whole in backward, as the larger Llama flavors configure it)."""
    return _parallelize(model, mesh, spec, full_ac=True)


def _ac_config(case, full_ac: bool):
    """torchtitan's activation-checkpointing config for the case: None without it (as
    `--activation_checkpoint none`). Applied by `parallelize_llama` to every block with
    `checkpoint_wrapper` (a `_checkpoint_wrapped_module.` segment in the parameters' names, read
    through: verify/module_names.py), before `fully_shard`."""
    if not case.activation_checkpointing:
        return None
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return FullAC.Config() if full_ac else SelectiveAC.Config()


def _parallelize(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec, full_ac: bool) -> nn.Module:
    require("torchtitan", "torchtitan")
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.distributed import parallel_dims as dims_module
    from torchtitan.distributed import utils as dist_utils

    case = spec.case
    replicate, shard = case.mesh if len(case.mesh) == 2 else (1, case.mesh[0])
    local_batch = case.data.batch_size // case.dp_size  # a data-parallel rank's block of the step
    training = TrainingConfig(
        mixed_precision_param=_dtype(case.precision.param_dtype),
        mixed_precision_reduce="float32",
        local_batch_size=local_batch,
    )
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=replicate,
        data_parallel_shard_degree=shard,
        fsdp_reshard_after_forward="default" if case.reshard_after_forward else "never",
        tensor_parallel_degree=case.tp,
        expert_parallel_degree=case.ep,
        enable_sequence_parallel=model.sequence_parallel,
        spmd_backend=SPMD_BACKEND,
        pipeline_parallel_degree=case.pp,
        pipeline_parallel_schedule=SCHEDULES[case.pp_schedule],
        pipeline_parallel_microbatch_size=max(1, local_batch // case.microbatches),
    )
    dims = dims_module.ParallelDims.from_config(parallelism, case.world_size)  # as torchtitan's trainer
    dims_module.device_type = mesh.device_type  # torchtitan's import-time guess: "cuda" without one
    dims.build_mesh()
    dist_utils.set_spmd_backend(parallelism.spmd_backend)  # torchtitan's trainer does, first
    if case.pp > 1:
        return _pipeline(model, mesh, case, dims, training, parallelism, _ac_config(case, full_ac))
    with tempfile.TemporaryDirectory() as dump:
        parallelize_fn(model)(
            model,
            parallel_dims=dims,
            training=training,
            parallelism=parallelism,
            compile_config=_compile_config(case),
            ac_config=_ac_config(case, full_ac),
            dump_folder=dump,
        )
    _force_sum(model)
    model.verify_view = lambda: TorchtitanView(model)
    model.before_optimizer_step = load_balancing([model], dims)
    return model


def refuse_experts_on_dim1(case) -> None:
    """torchtitan shards a block's experts Shard(1) where the ranks it counts outnumber them
    (`apply_fsdp_to_decoder`: efsdp x ep under ep, else its whole data-parallel mesh); the
    reference shards them as every parameter, Shard(0): not modelled, refused naming the field
    before any rank starts (the engine's `Capabilities.refuses`)."""
    from fsdp_verify.engines.expert_parallel import experts_of

    if not case.model.is_custom:
        return
    replicate, shard = case.mesh if len(case.mesh) == 2 else (1, case.mesh[0])
    ranks = shard if case.ep > 1 else replicate * shard
    for n in experts_of(case.model).values():
        if ranks > n:
            raise CaseError(
                "model.kwargs.experts",
                f"at least the {ranks} ranks torchtitan shards them over (fewer it shards on dim 1: not modelled)",
                n,
            )


def parallelize_fn(model: nn.Module):
    """torchtitan's own parallelize function of the model's family (`parallelize_llama`,
    `parallelize_qwen3`), as its model registry pairs them."""
    if type(model).__module__.startswith("torchtitan.models.qwen3"):
        from torchtitan.models.qwen3 import parallelize_qwen3

        return parallelize_qwen3
    if type(model).__module__.startswith("torchtitan.models.deepseek_v3"):
        from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3

        return parallelize_deepseekv3
    from torchtitan.models.llama3 import parallelize_llama

    return parallelize_llama


def _force_sum(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no AVG, and the division is off


def _pipeline(model: nn.Module, mesh: DeviceMesh, case, dims, training, parallelism, ac_config) -> nn.Module:
    """torchtitan's `pipeline_llm`: its split (`_split_module`: a copy of the model a stage, the
    other stages' modules deleted), `parallelize_llama` on each part (its FSDP over the
    data-parallel mesh, every unit kept unsharded after forward under pp), its `PipelineStage`s and
    its schedule (`scale_grads=False`). Its loss function is the loop's (`Pipeline.loss`, the
    micro-batch's share of the step's loss as torchtitan's trainer scales it). One stage a rank
    (GPipe, 1F1B): the part is the rank's copy of the model under the model's names; two
    (Interleaved1F1B): the two parts' modules gathered under those names (`_RankCopy`)."""
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    from fsdp_verify.engines.pipeline_engine import Pipeline

    held: dict[str, Pipeline] = {}
    with tempfile.TemporaryDirectory() as dump:
        schedule, parts, first, last = pipeline_llm(
            model,
            parallel_dims=dims,
            training=training,
            parallelism=parallelism,
            compile_config=_compile_config(case),
            ac_config=ac_config,
            dump_folder=dump,
            device=torch.device(mesh.device_type),
            model_config=model.config,
            parallelize_fn=parallelize_fn(model),
            loss_fn=lambda output, target: (held["pipe"].loss(output, target), None),  # its (loss, extra)
        )
    for part in parts:
        _force_sum(part)
    module = parts[0] if len(parts) == 1 else _RankCopy(parts)
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])  # torch's schedules keep them so
    pipe = held["pipe"] = Pipeline(case, module, parts, stages, schedule, first=first, last=last)
    module.pipeline, module.pp_mesh = pipe, dims.get_mesh("pp")
    module.before_optimizer_step = load_balancing(parts, dims)  # each part's MoE blocks, its "loss" mesh
    module.verify_view = lambda: TorchtitanPipelineView(module)
    return module


class _RankCopy(nn.Module):
    """A rank's parts under an interleaved schedule (two stages a rank, each a copy of the model
    with the others' modules deleted) as one module under the model's names: the parts' own
    blocks and ends, shared, for the loop's records. Never called: the schedule runs the parts."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.tok_embeddings, self.norm, self.lm_head = (
            next((getattr(p, name) for p in parts if getattr(p, name, None) is not None), None)
            for name in ("tok_embeddings", "norm", "lm_head")
        )
        self.layers = type(parts[0].layers)()
        for part in parts:
            for key, block in part.layers.items():
                self.layers[key] = block


def pp_split(model: nn.Module, n_stages: int) -> list[nn.Module]:
    """torchtitan's default stages of a Llama model (`_generate_llm_fqn_per_model_part`, the
    embedding and the norm and head each weighted as one block, its `ParallelismConfig`'s
    defaults), as views sharing the model's modules, for the reference: a stage's forward is the
    model's own on the modules it keeps (the others None, its blocks a subset under their keys),
    as `_split_module`'s copies run on the ranks."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    defaults = ParallelismConfig()
    names = _generate_llm_fqn_per_model_part(
        n_stages,
        len(model.layers),
        defaults.pipeline_parallel_first_stage_less_layers,
        defaults.pipeline_parallel_last_stage_less_layers,
    )
    return [_stage_view(model, set(keep)) for keep in names]


def _stage_view(model: nn.Module, keep: set[str]) -> nn.Module:
    from fsdp_verify.models.stages import module_view

    view = module_view(model)
    for name, child in model.named_children():
        if name == "layers":
            blocks = type(child)()
            for key, block in child.items():
                if f"layers.{key}" in keep:
                    blocks[key] = block
            view.layers = blocks
        elif name not in keep:
            setattr(view, name, None)
    return view


def tp_plan(model: nn.Module, tp_mesh) -> dict:
    """torchtitan's llama3 tensor-parallel declarations (`set_llama3_sharding_config`, with
    sequence parallelism) written as torch's ParallelStyles, for the reference's emulation (the
    engine applies torchtitan's own): the vocabulary-sharded embedding, its partial output reduce-
    scattered over the sequence; the norms on sequence shards; each attention's and feed-forward's
    input gathered; the fused `wqkv`, `w1`, `w3` colwise (`wqkv`'s rows are grouped by kv head,
    so a contiguous split keeps each rank's heads whole); `wo`, `w2` rowwise, reduce-scattered;
    the head colwise over the vocabulary, its output left sharded for torchtitan's vocabulary-
    parallel cross-entropy. The embedding's and the rowwise layers' outputs stay DTensors, as
    torchtitan's model-parallel DTensor backend keeps every activation: a residual's gradients
    then meet in the order they meet there (a norm's input takes no `from_local` of its own)."""
    from fsdp_verify.engines.tensor_parallel import transformer_plan

    sequence_parallel = getattr(model, "sequence_parallel", True)  # (a pin is checked on the built-in model too)
    if not sequence_parallel:
        # Without it torchtitan's activations are invariant over tp (`spmd.I`) and a replicated
        # activation's gradient stays partial (DTensor's Partial) down the residual stream until
        # a redistribution reduces it, where the reference's styles reduce it at each projection
        # (measured: every gradient within its bound, none bit-exact; 41x at the parameters after
        # Adam's first step): not modelled yet.
        raise CaseError(
            "model.kwargs", "sequence_parallel true under tp (torchtitan's default; without it: not modelled)", False
        )
    return transformer_plan(
        model,
        sequence_parallel,
        loss_parallel=True,
        projections=("attention.qkv_linear.wqkv",),
        head="lm_head",
        local_outputs=False,
    )


def _compile_config(case):
    """torchtitan's compile config for the case: off without `compile`; with `compile: blocks`,
    its `apply_compile` on the model (each block of `model.layers`, fullgraph, the case's backend,
    after activation checkpointing and before FSDP), as `--compile.enable --compile.components
    model` runs it. Its loss compile (the "loss" component) stays off: the toolkit computes the
    loss, outside the engine."""
    from torchtitan.config import CompileConfig

    if case.compile is None:
        return CompileConfig(enable=False)
    return CompileConfig(enable=True, components=["model"], backend=case.compile_backend)


class TorchtitanView(EngineView):
    """FSDP2's view, with torchtitan's own clip: `torchtitan.distributed.utils.clip_grad_norm_`
    over the model's parameters, as its trainer calls it (foreach, no pp mesh, no ep); the
    total norm it returns, whole."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        from torchtitan.distributed.utils import clip_grad_norm_

        params = [p for p in self.module.parameters()]
        from fsdp_verify.engines.expert_parallel import on_ep_mesh

        ep = any(on_ep_mesh(p) for p in params)  # its experts' and the dense norms apart (`_clip_grad_norm_with_ep`)
        norm = clip_grad_norm_(params, max_norm, foreach=True, pp_mesh=None, ep_enabled=ep)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class TorchtitanPipelineView(PipelineView):
    """The pipeline's view, with torchtitan's own clip over the stages: its `clip_grad_norm_`
    with the pp mesh (each stage's norm, squared, all-reduced over "pp", its square root)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        from torchtitan.distributed.utils import clip_grad_norm_

        params = [p for part in self.module.pipeline.modules for p in part.parameters()]
        return clip_grad_norm_(params, max_norm, foreach=True, pp_mesh=self.module.pp_mesh, ep_enabled=False)


def _dtype(name: str | None) -> str:
    if name in (None, "fp32"):
        return "float32"
    if name == "bf16":
        return "bfloat16"
    raise ValueError(f"precision.param_dtype: torchtitan trains in float32 or bfloat16, got {name!r}")


# torchtitan decides each unit's reshard_after_forward (its "default" policy: the blocks reshard,
# [norm, lm_head] and the root do not); the case's True or False picks "default" or "never".
# It applies torchtitan's activation checkpointing itself (`checkpoints`), the toolkit's none.
# It compiles as torchtitan's `apply_compile` does (`_compile_config`): the blocks only, fullgraph,
# torch's automatic dynamic shapes, two Dynamo options set process-wide (the reference sets them too).
parallelize.capabilities = Capabilities(
    takes=("groups", "grad_reduction", "compile", "tp", "sequence_parallel", "loss_parallel", "pp", "ep"),
    reshard_per_unit=True,
    checkpoints=True,
    compile_scopes=("blocks",),
    compile_fullgraph=True,
    dynamo_config=(("capture_scalar_outputs", True), ("skip_fwd_side_effects_in_bwd_under_checkpoint", True)),
    compile_dynamic=None,
    pp_scale_grads=False,
    refuses=refuse_experts_on_dim1,
)
parallelize_full_ac.capabilities = parallelize.capabilities


FACTORIES = {
    "llama3": "fsdp_verify.frameworks.torchtitan:llama3",
    "qwen3": "fsdp_verify.frameworks.torchtitan:qwen3",
    "deepseek_v3": "fsdp_verify.frameworks.torchtitan:deepseek_v3",
}
# A case's default sequence length for torchtitan's models (its RoPE cache sized to it): short,
# as a CPU check wants; --seq-len sets another.
SEQ_LEN = 16


# What a torchtitan run with tp adds (`--framework torchtitan --tp N`): its declarations as the
# reference's plan, and its vocabulary-parallel loss (its lm_head's output is always sharded).
TP_FIELDS = {"tp_plan": "fsdp_verify.frameworks.torchtitan:tp_plan", "loss_parallel": True}

# What a torchtitan run with pp adds (`--framework torchtitan --pp N`): its stages for the
# reference, its schedule's gradient scaling (none), and each stage's one reduction a step.
PP_FIELDS = {
    "pp_split": "fsdp_verify.frameworks.torchtitan:pp_split",
    "pp_scale_grads": False,
    "sync_every_microbatch": False,
}
# the case's schedules by torchtitan's names (`get_schedule_class`)
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B"}

# `--framework torchtitan` without `--model`
DEFAULT_MODEL = "llama3:debugmodel"


def preset(model: str, kwargs: dict[str, Any], seq_len: int | None = None) -> dict[str, Any]:
    """The case fields of a torchtitan run of `model` ("llama3:debugmodel"): its factory with
    the flavor (and `kwargs`: `n_layers`, ...), torchtitan's units for that model, this engine,
    its loss, division off (a sum over the data-parallel ranks), and its MixedPrecisionPolicy's
    `cast_forward_inputs=False` and fp32 reduction."""
    from fsdp_verify.models import ModelSpec
    from fsdp_verify.models.custom import info

    name, _, flavor = model.partition(":")
    if name not in FACTORIES or not flavor:
        raise CaseError("model", f"MODEL:FLAVOR with --framework torchtitan, MODEL one of {sorted(FACTORIES)}", model)
    seq_len = seq_len or SEQ_LEN  # the data's length, and RoPE's cache sized to it
    spec = ModelSpec(
        kind="custom", factory=FACTORIES[name], kwargs={"flavor": flavor, "seq_len": seq_len, **kwargs}, seq_len=seq_len
    )
    return {
        "model": spec,
        "wrap": plan_of(info(spec).classes, tied=bool(info(spec).tied)),
        "engine": "fsdp_verify.frameworks.torchtitan:parallelize",
        "loss": "fsdp_verify.frameworks.torchtitan:loss",
        "grad_reduction": "sum",
        "precision.cast_forward_inputs": False,
        "precision.reduce_dtype": "fp32",  # its TrainingConfig's mixed_precision_reduce, whatever the parameters'
    }


def plan_of(modules: dict[str, str], tied: bool = False) -> tuple[str, ...]:
    """The units `apply_fsdp_to_decoder` makes (torchtitan 0.3.0), from the model's module names
    (a meta-device build's: verify/models/custom.py), children first: the token embeddings (or,
    tied, one unit of embeddings, norm and head), each block, `[norm, lm_head]`, the root."""
    blocks = tuple(n for n in modules if n.startswith("layers.") and n.count(".") == 1)
    if tied:
        return ("tok_embeddings+norm+lm_head", *blocks, "")
    return ("tok_embeddings", *blocks, "norm+lm_head", "")
