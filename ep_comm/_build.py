"""What was built: the C++ host module and the CUDA extension."""
from __future__ import annotations

import importlib


def build_info() -> dict:
    """Reports which compiled parts of ep_comm are present, and why one is missing."""
    info: dict = {}
    for key, module in (("host", "ep_comm._host"), ("cuda", "ep_comm._cuda")):
        try:
            importlib.import_module(module)
            info[key] = True
        except ImportError as error:
            info[key] = False
            info[f"{key}_missing_reason"] = str(error)
    return info
