"""Accelerate's FSDP2 preparation (verify/frameworks/accelerate.py) with one assertion added before
it: on every rank but 0 each parameter is on the meta device and each non-persistent buffer holds
values, as transformers' `from_pretrained` leaves them under `cpu_ram_efficient_loading`. An
equivalent run of this engine then shows that those ranks trained from what Accelerate's
`fsdp2_load_full_state_dict` broadcast, and nothing else."""

from fsdp_verify.frameworks import accelerate as accel


def prepare_from_meta(model, mesh, spec):
    def laid_out_as_loaded(accelerator, module):
        from accelerate.utils.modeling import get_non_persistent_buffers

        if accelerator.is_main_process:
            return
        real = [n for n, p in module.named_parameters() if not p.is_meta]
        assert not real, f"rank {accelerator.process_index}: parameters off the meta device before the load: {real}"
        computed = get_non_persistent_buffers(module, recurse=True, fqns=True)
        assert computed and not any(b.is_meta for n, b in module.named_buffers() if n in computed)

    return accel._prepare(model, mesh, spec, before=laid_out_as_loaded)


prepare_from_meta.capabilities = accel.prepare.capabilities
