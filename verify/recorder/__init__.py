"""Your loop, recorded: `Recorder` writes a run (safetensors + JSON) around a user's own training
step; `fsdp-verify compare` reads two runs and says where they first part."""

from fsdp_verify.recorder.recorder import Recorder

__all__ = ["Recorder"]
