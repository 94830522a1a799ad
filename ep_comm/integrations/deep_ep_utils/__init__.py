"""ep_comm's implementation of DeepEP's helper modules ``deep_ep.utils.{envs, math, testing, event,
gate, refs}``.

DeepEP's own test scripts and client code import these helpers (``init_dist``, ``calc_diff``,
``per_token_cast_to_fp8``, ``bench``, ...; the V2 script ``tests/elastic/test_ep.py`` also
``gate.get_unbalanced_scores`` and the ``refs`` reference dispatch/combine). The names, signatures
and results follow DeepEP's (v2.1.0, whose ``tests/legacy`` scripts are its last V1 tests); where
DeepEP needs CUDA, these also work on the CPU, and each module says what differs there. The
importable ``deep_ep.utils`` (see :mod:`ep_comm.integrations.deep_ep`) re-exports these modules.
"""
