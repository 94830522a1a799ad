"""Transports: they move planned bytes between ranks and nothing else."""
from .base import PendingExchange, Transport

__all__ = ["Transport", "PendingExchange"]
