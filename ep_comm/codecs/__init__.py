"""Payload codecs: each transforms bytes and reports their size; Buffer applies them per call."""
from . import fp8, lossless, nvfp4

__all__ = ["fp8", "lossless", "nvfp4"]
