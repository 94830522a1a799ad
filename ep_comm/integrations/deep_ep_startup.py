"""Interpreter-startup hook behind ``EP_COMM_PROVIDE_DEEP_EP``: puts ep_comm's ``deep_ep`` on ``sys.path``.

The line of ``ep_comm_deep_ep.pth`` (written by ``python -m ep_comm.integrations.deep_ep enable``)
runs :func:`activate` in every interpreter that starts with that file in its site-packages and the
variable set, so ``importlib.util.find_spec("deep_ep")`` and ``import deep_ep`` work in fresh
processes and in ``multiprocessing`` spawn workers alike. This file uses only the standard library
and imports nothing of ep_comm or torch: the ``deep_ep`` package is imported, like any other, only
when something imports it.

Values of ``EP_COMM_PROVIDE_DEEP_EP``:

* unset, ``""``, ``0``, ``false``, ``no``, ``off``: nothing is provided;
* ``1``, ``true``, ``yes``, ``on``, ``fallback``: ep_comm's ``deep_ep`` is appended to ``sys.path``,
  so an installed DeepEP, found earlier on the path, still wins;
* ``override``: ep_comm's ``deep_ep`` is put first, ahead of an installed DeepEP (importing it
  then warns that it hides that DeepEP, naming where it is).
"""
from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping

ENV_VAR = "EP_COMM_PROVIDE_DEEP_EP"
PATH_ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deep_ep_path")
"""The directory holding ep_comm's top-level ``deep_ep`` package and ``deep_ep_cpp`` module."""

_OFF = ("", "0", "false", "no", "off")
_FALLBACK = ("1", "true", "yes", "on", "fallback")
_OVERRIDE = ("override",)


def mode(environ: Mapping[str, str] | None = None) -> str | None:
    """``"fallback"``, ``"override"`` or None (not provided), from ``EP_COMM_PROVIDE_DEEP_EP``.

    An unknown value provides nothing and warns.
    """
    value = (os.environ if environ is None else environ).get(ENV_VAR, "").strip().lower()
    if value in _FALLBACK:
        return "fallback"
    if value in _OVERRIDE:
        return "override"
    if value not in _OFF:
        warnings.warn(f"{ENV_VAR}={value!r} is not one of {_FALLBACK + _OVERRIDE + _OFF}; "
                      "ep_comm does not provide deep_ep", stacklevel=2)
    return None


def activate(environ: Mapping[str, str] | None = None, path: list[str] | None = None) -> str | None:
    """Adds :data:`PATH_ENTRY` to ``path`` (default ``sys.path``) as :func:`mode` says; returns the mode."""
    chosen = mode(environ)
    if chosen is None:
        return None
    path = sys.path if path is None else path
    while PATH_ENTRY in path:
        path.remove(PATH_ENTRY)
    if chosen == "override":
        path.insert(0, PATH_ENTRY)
    else:
        path.append(PATH_ENTRY)
    return chosen


PTH_LINE = (
    "import os, importlib.util; "
    f"os.environ.get('{ENV_VAR}', '').strip() and "
    "(lambda s: s is not None and __import__('runpy').run_path(os.path.join("
    "s.submodule_search_locations[0], 'integrations', 'deep_ep_startup.py'))['activate']())"
    "(importlib.util.find_spec('ep_comm'))"
)
"""The one line of ``ep_comm_deep_ep.pth``: when the variable is set, finds the installed ep_comm
(without importing it) and runs this file's :func:`activate`; independent of where ep_comm is
installed, so the same file can be shipped by a package."""
