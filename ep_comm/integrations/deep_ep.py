"""``import deep_ep`` for code written against DeepEP's V1 API, served by ep_comm.

ep_comm ships a real top-level ``deep_ep`` package (and DeepEP V1's ``deep_ep_cpp`` module) in a
directory of its own, :data:`PATH_ENTRY`, that is on ``sys.path`` only when asked for. Because it is
an ordinary package on the path, ``importlib.util.find_spec("deep_ep")`` finds it (vLLM and other
engines test for DeepEP that way) and ``multiprocessing`` spawn workers, which inherit ``sys.path``,
import it too. Nothing is provided on ``import ep_comm``. Three ways to ask:

* **This process** (and the ``multiprocessing`` / ``torch.multiprocessing`` spawn workers it starts
  afterwards): :func:`install`; :func:`uninstall` undoes it. ep_comm's ``deep_ep`` goes first on
  ``sys.path``.
* **Every process of an environment**, including processes that an engine starts without running
  your code first: once per environment run ``python -m ep_comm.integrations.deep_ep enable``, which
  writes ``ep_comm_deep_ep.pth`` into site-packages (``disable`` removes it); then set
  ``EP_COMM_PROVIDE_DEEP_EP=1`` in the environment of the processes that should see it. With ``1``
  an installed DeepEP still wins (ep_comm's is appended to ``sys.path``); ``override`` puts
  ep_comm's first. Without the variable the ``.pth`` line does nothing.
* **Without writing anything**: ``PYTHONPATH=$(python -m ep_comm.integrations.deep_ep path)``
  (which puts ep_comm's ``deep_ep`` ahead of site-packages).

A real DeepEP is never hidden silently: :func:`install` refuses while another ``deep_ep`` is
imported (unless ``replace_existing``), and importing ep_comm's ``deep_ep`` while another DeepEP is
installed warns with :class:`ShadowedDeepEPWarning`, naming where that DeepEP is.

What ``deep_ep`` then offers: ``Buffer``, ``Config``, ``EventOverlap``, ``EventHandle``,
``topk_idx_t`` (``torch.int64``), ``get_physical_domain_size``, ``get_logical_domain_size``,
``__version__``, and ``deep_ep.utils`` with the submodules ``envs``, ``math``, ``testing`` and
``event`` (:mod:`ep_comm.integrations.deep_ep_utils`); ``deep_ep_cpp`` offers ``Config``,
``EventHandle`` and ``topk_idx_t``. DeepEP 2.x's ``ElasticBuffer`` and ``EPHandle`` (their
expert-parallel calls, :mod:`ep_comm.integrations.deep_ep_elastic`) and its module paths
``deep_ep.buffers.legacy`` (``Buffer``) and ``deep_ep.buffers.elastic`` are offered too.

``deep_ep.__version__`` is :data:`DEEP_EP_VERSION`, ``"2.1.0+epcomm.<ep_comm version>"``: the
DeepEP API level offered is 2.1.0 (V1's ``Buffer`` as 2.x keeps it, and 2.x's ``ElasticBuffer``),
and the local part names ep_comm and its version (a PEP 440 version).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import os
import sys
import sysconfig
import types
import warnings

import torch

from .. import __version__ as _ep_comm_version
from ..buffer import Buffer
from ..config import Config
from ..event import EventHandle, EventOverlap
from .deep_ep_elastic import ElasticBuffer, EPHandle
from .deep_ep_startup import ENV_VAR, PATH_ENTRY, PTH_LINE, mode
from .deep_ep_utils.envs import get_logical_domain_size, get_physical_domain_size

__all__ = ["DEEP_EP_VERSION", "ENV_VAR", "EXTENSION_NAME", "MODULE_NAME", "PATH_ENTRY", "PTH_NAME",
           "TOPK_IDX_DTYPE", "Buffer", "Config", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap",
           "ShadowedDeepEPWarning",
           "disable", "enable", "get_logical_domain_size", "get_physical_domain_size", "install",
           "installed_deep_ep", "is_provided", "uninstall", "warn_if_shadowing"]

MODULE_NAME = "deep_ep"
EXTENSION_NAME = "deep_ep_cpp"
TOPK_IDX_DTYPE = torch.int64
"""DeepEP's ``topk_idx_t``: the dtype of ``topk_idx`` tensors."""
DEEP_EP_API_LEVEL = "2.1.0"
DEEP_EP_VERSION = f"{DEEP_EP_API_LEVEL}+epcomm.{_ep_comm_version}"
"""``deep_ep.__version__``: the DeepEP API level offered, then ep_comm's version (PEP 440 local part)."""
PTH_NAME = "ep_comm_deep_ep.pth"

class ShadowedDeepEPWarning(UserWarning):
    """ep_comm's ``deep_ep`` was imported while another DeepEP is installed, and hides it."""


def _under_path_entry(filename: str | None) -> bool:
    if not filename:
        return False
    root = os.path.realpath(PATH_ENTRY)
    return os.path.realpath(filename).startswith(root + os.sep)


def is_provided(module: types.ModuleType) -> bool:
    """Whether ``module`` (``deep_ep``, one of its submodules, or ``deep_ep_cpp``) is ep_comm's."""
    return _under_path_entry(getattr(module, "__file__", None))


def installed_deep_ep() -> str | None:
    """Where a DeepEP other than ep_comm's is installed (its package file or directory), or None.

    Looks along ``sys.path`` without ep_comm's entry and asks the other import finders (editable
    installs), importing nothing.
    """
    others = [p for p in sys.path if os.path.realpath(p or os.curdir) != os.path.realpath(PATH_ENTRY)]
    spec = importlib.machinery.PathFinder.find_spec(MODULE_NAME, others)
    if spec is not None and spec.origin not in (None, "namespace"):
        return spec.origin
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec(MODULE_NAME, None)
        except Exception:  # a third-party finder failing says nothing about DeepEP
            continue
        if spec is not None and spec.origin not in (None, "namespace") and not _under_path_entry(spec.origin):
            return spec.origin
    return None


def warn_if_shadowing() -> None:
    """Warns (:class:`ShadowedDeepEPWarning`) if another DeepEP is installed; called by ep_comm's ``deep_ep``."""
    location = installed_deep_ep()
    if location is not None:
        warnings.warn(f"ep_comm's deep_ep is in use and hides the DeepEP installed at {location}",
                      ShadowedDeepEPWarning, stacklevel=2)


def _deep_ep_module_names() -> list[str]:
    return [name for name in sys.modules
            if name in (MODULE_NAME, EXTENSION_NAME) or name.startswith(MODULE_NAME + ".")]


_path_index_before_install: int | None = None
"""Where :data:`PATH_ENTRY` was on ``sys.path`` before :func:`install` (-1: absent; None: not installed)."""


def install(replace_existing: bool = False) -> types.ModuleType:
    """Makes ``import deep_ep`` give ep_comm's implementation in this process; returns the module.

    Puts :data:`PATH_ENTRY` first on ``sys.path`` (inherited by ``multiprocessing`` spawn workers
    started afterwards) and imports ``deep_ep``. Idempotent.

    Args:
        replace_existing: also replace a ``deep_ep`` / ``deep_ep_cpp`` that another package already
            imported in this process (otherwise that raises ``ValueError``, since two
            implementations would be mixed).
    """
    global _path_index_before_install
    current = sys.modules.get(MODULE_NAME)
    if current is not None and is_provided(current):
        return current
    extension = sys.modules.get(EXTENSION_NAME)
    if extension is not None and is_provided(extension):
        extension = None
    if (current is not None or extension is not None) and not replace_existing:
        raise ValueError("a different deep_ep (or deep_ep_cpp) module is already imported; "
                         "pass replace_existing=True")
    for name in _deep_ep_module_names():
        del sys.modules[name]
    if _path_index_before_install is None:
        _path_index_before_install = sys.path.index(PATH_ENTRY) if PATH_ENTRY in sys.path else -1
    while PATH_ENTRY in sys.path:
        sys.path.remove(PATH_ENTRY)
    sys.path.insert(0, PATH_ENTRY)
    importlib.invalidate_caches()
    module = importlib.import_module(MODULE_NAME)
    if not is_provided(module):  # pragma: no cover - PATH_ENTRY is first, so only a meta-path finder gets here
        raise ValueError(f"import deep_ep gave {module!r}, not ep_comm's, although ep_comm's is first on sys.path")
    return module


def uninstall() -> None:
    """Undoes :func:`install`: forgets ep_comm's ``deep_ep`` modules and restores ``sys.path``."""
    global _path_index_before_install
    for name in _deep_ep_module_names():
        if is_provided(sys.modules[name]):
            del sys.modules[name]
    if _path_index_before_install is not None:
        while PATH_ENTRY in sys.path:
            sys.path.remove(PATH_ENTRY)
        if _path_index_before_install >= 0:
            sys.path.insert(min(_path_index_before_install, len(sys.path)), PATH_ENTRY)
        _path_index_before_install = None
    importlib.invalidate_caches()


def _site_dir(site_dir: str | None) -> str:
    return site_dir if site_dir is not None else sysconfig.get_paths()["purelib"]


def enable(site_dir: str | None = None) -> str:
    """Writes ``ep_comm_deep_ep.pth`` into ``site_dir`` (default: this environment's site-packages).

    From then on, every interpreter of that environment started with ``EP_COMM_PROVIDE_DEEP_EP``
    set provides ep_comm's ``deep_ep`` (see :mod:`ep_comm.integrations.deep_ep_startup`). Returns
    the file's path.
    """
    path = os.path.join(_site_dir(site_dir), PTH_NAME)
    with open(path, "w") as f:
        f.write(PTH_LINE + "\n")
    return path


def disable(site_dir: str | None = None) -> bool:
    """Removes the file :func:`enable` wrote; returns whether there was one."""
    path = os.path.join(_site_dir(site_dir), PTH_NAME)
    if not os.path.exists(path):
        return False
    os.remove(path)
    return True


def _status() -> str:
    pth = os.path.join(_site_dir(None), PTH_NAME)
    spec = importlib.machinery.PathFinder.find_spec(MODULE_NAME, sys.path)
    lines = [f"startup file {pth}: {'present' if os.path.exists(pth) else 'absent'}",
             f"{ENV_VAR}={os.environ.get(ENV_VAR, '')!r} -> {mode() or 'not provided'}",
             f"ep_comm's deep_ep directory: {PATH_ENTRY}",
             f"installed DeepEP: {installed_deep_ep() or 'none'}",
             f"import deep_ep here would load: {spec.origin if spec is not None else 'nothing'}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m ep_comm.integrations.deep_ep {path,enable,disable,status}``."""
    parser = argparse.ArgumentParser(prog="python -m ep_comm.integrations.deep_ep",
                                     description="Provide ep_comm's deep_ep to processes of this environment.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("path", help="print the directory to put on PYTHONPATH for ep_comm's deep_ep")
    for name, text in (("enable", f"write {PTH_NAME} (then set {ENV_VAR}=1 to provide deep_ep)"),
                       ("disable", f"remove {PTH_NAME}")):
        command = sub.add_parser(name, help=text)
        command.add_argument("--site-dir", default=None, help="directory for the file (default: site-packages)")
    sub.add_parser("status", help="say what import deep_ep would load and why")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(PATH_ENTRY)
    elif args.command == "enable":
        print(f"wrote {enable(args.site_dir)}; set {ENV_VAR}=1 (or override) to provide deep_ep")
    elif args.command == "disable":
        print("removed" if disable(args.site_dir) else "nothing to remove")
    else:
        print(_status())
    return 0


if __name__ == "__main__":
    sys.exit(main())
