"""The single-device reference trainer: the ground truth a sharded run is compared against."""

from fsdp_verify.reference.trainer import train_reference

__all__ = ["train_reference"]
