"""The single-device reference trainer: the ground truth a sharded run is compared against."""

from fsdp_verify.reference.trainer import train_reference
from fsdp_verify.reference.user_step import train_reference_step

__all__ = ["train_reference", "train_reference_step"]
