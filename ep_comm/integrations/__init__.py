"""Integrations: the ``deep_ep`` import shim and trainer adapters (Megatron-core)."""
