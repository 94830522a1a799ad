"""``import deep_ep`` for code written against DeepEP's V1 API, served by ep_comm.

Call :func:`install` once (before ``import deep_ep``); afterwards ``deep_ep.Buffer``,
``deep_ep.Config``, ``deep_ep.EventOverlap``, ``deep_ep.topk_idx_t`` (``torch.int64``),
``deep_ep.utils.EventOverlap`` / ``deep_ep.utils.EventHandle`` and the extension module's names
that client code imports directly (``deep_ep_cpp.Config`` / ``EventHandle`` / ``topk_idx_t``) are
ep_comm's. Nothing is installed on import of ep_comm itself.
"""
from __future__ import annotations

import sys
import types

import torch

from ..buffer import Buffer
from ..config import Config
from ..event import EventHandle, EventOverlap

MODULE_NAME = "deep_ep"
EXTENSION_NAME = "deep_ep_cpp"
TOPK_IDX_DTYPE = torch.int64
"""DeepEP's ``topk_idx_t``: the dtype of ``topk_idx`` tensors."""


def _make_modules() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    utils = types.ModuleType(f"{MODULE_NAME}.utils", "ep_comm's stand-in for deep_ep.utils")
    utils.EventOverlap = EventOverlap  # type: ignore[attr-defined]
    utils.EventHandle = EventHandle  # type: ignore[attr-defined]
    extension = types.ModuleType(EXTENSION_NAME, "ep_comm's stand-in for DeepEP's extension module")
    extension.Config = Config  # type: ignore[attr-defined]
    extension.EventHandle = EventHandle  # type: ignore[attr-defined]
    extension.topk_idx_t = TOPK_IDX_DTYPE  # type: ignore[attr-defined]
    extension.__ep_comm__ = True  # type: ignore[attr-defined]
    package = types.ModuleType(MODULE_NAME, "ep_comm's stand-in for DeepEP (V1 API)")
    package.__path__ = []  # type: ignore[attr-defined]  # a package, so deep_ep.utils imports
    package.Buffer = Buffer  # type: ignore[attr-defined]
    package.Config = Config  # type: ignore[attr-defined]
    package.EventOverlap = EventOverlap  # type: ignore[attr-defined]
    package.topk_idx_t = TOPK_IDX_DTYPE  # type: ignore[attr-defined]
    package.utils = utils  # type: ignore[attr-defined]
    package.__ep_comm__ = True  # type: ignore[attr-defined]
    return package, utils, extension


def install(replace_existing: bool = False) -> types.ModuleType:
    """Makes ``import deep_ep`` give ep_comm's implementation; returns the module.

    Args:
        replace_existing: also replace a real ``deep_ep`` that was already imported (otherwise
            that raises ``ValueError``, since two implementations would be mixed).
    """
    current = sys.modules.get(MODULE_NAME)
    if current is not None and getattr(current, "__ep_comm__", False):
        return current
    real_extension = sys.modules.get(EXTENSION_NAME)
    if real_extension is not None and getattr(real_extension, "__ep_comm__", False):
        real_extension = None
    if (current is not None or real_extension is not None) and not replace_existing:
        raise ValueError("a different deep_ep (or deep_ep_cpp) module is already imported; "
                         "pass replace_existing=True")
    package, utils, extension = _make_modules()
    sys.modules[MODULE_NAME] = package
    sys.modules[f"{MODULE_NAME}.utils"] = utils
    sys.modules[EXTENSION_NAME] = extension
    return package


def uninstall() -> None:
    """Removes the ``deep_ep`` stand-in installed by :func:`install`."""
    current = sys.modules.get(MODULE_NAME)
    if current is not None and getattr(current, "__ep_comm__", False):
        del sys.modules[MODULE_NAME]
        sys.modules.pop(f"{MODULE_NAME}.utils", None)
    if getattr(sys.modules.get(EXTENSION_NAME), "__ep_comm__", False):
        del sys.modules[EXTENSION_NAME]
