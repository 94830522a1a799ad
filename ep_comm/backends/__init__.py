"""Transports: they move planned bytes between ranks and nothing else."""
from .base import Transport, PendingExchange

__all__ = ["Transport", "PendingExchange"]
