"""codec="auto"'s rule as one shared function: its threshold, the policy's use of it, and the
codec measurement it relies on."""
from __future__ import annotations

import math

import pytest
import torch

from ep_comm.codecs import auto


def test_break_even_is_where_the_rule_flips():
    # NVLink 450 GB/s, rho 0.67: encode = decode must exceed 2 * 450 / 0.33 ~ 2.7 TB/s
    even = auto.break_even_gbps(450.0, 0.67)
    assert even == pytest.approx(2 * 450.0 / 0.33)
    assert auto.compression_pays(450.0, 0.67, even * 1.01, even * 1.01)
    assert not auto.compression_pays(450.0, 0.67, even * 0.99, even * 0.99)
    # unequal speeds: their harmonic mean decides
    assert auto.compression_pays(50.0, 0.7, 400.0, 1e9) == (1 / 400.0 < 0.3 / 50.0)
    assert auto.compression_pays(1.0, 0.7, math.inf, math.inf)  # a free codec pays for any saving


def test_nothing_saved_never_pays():
    assert auto.break_even_gbps(50.0, 1.0) == math.inf
    assert auto.break_even_gbps(50.0, 1.2) == math.inf
    assert not auto.compression_pays(50.0, 1.0, math.inf, math.inf)


def test_the_policy_decides_with_the_shared_rule(monkeypatch):
    calls = []

    def rule(link, ratio, enc, dec):
        calls.append((link, ratio, enc, dec))
        return True

    monkeypatch.setattr(auto, "compression_pays", rule)
    policy = auto.AutoCodecPolicy(encode_gbps=3.0, decode_gbps=4.0, expected_ratio=0.6)
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert auto.choose_codec(x, policy, "nccl") == "lossless"
    assert calls == [(auto.DEFAULT_LINK_GBPS["nccl"], 0.6, 3.0, 4.0)]
    assert auto.choose_codec(x.float(), policy, "nccl") == "none"  # only bf16 is coded
    assert len(calls) == 1


def test_measure_codec_gbps_times_the_host_codec():
    sample = torch.randn(64, 1024).to(torch.bfloat16)
    enc, dec = auto.measure_codec_gbps(sample, threads=1, repeats=2)
    assert enc > 0 and dec > 0 and math.isfinite(enc) and math.isfinite(dec)
    with pytest.raises(ValueError, match="bf16"):
        auto.measure_codec_gbps(sample.float())
    with pytest.raises(ValueError, match="repeats"):
        auto.measure_codec_gbps(sample, repeats=0)
    assert auto.codec_place("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device must be a torch.device"):
        auto.codec_place(3.5)


def test_policy_inputs_are_checked_where_they_are_set():
    """A bad speed or ratio raises ValueError naming the field when it is set, not inside a call on
    one rank (which left its peers waiting in the vote)."""
    import math

    from ep_comm.codecs.auto import AutoCodecPolicy, compression_pays

    policy = AutoCodecPolicy()
    for name, bad in (("encode_gbps", 0.0), ("decode_gbps", -1), ("link_gbps", 0), ("link_gbps", "2"),
                      ("encode_gbps", True), ("link_gbps", math.nan), ("expected_ratio", math.nan),
                      ("expected_ratio", -0.1), ("observed_ratio", math.inf)):
        with pytest.raises(ValueError, match=name):
            setattr(policy, name, bad)
    with pytest.raises(ValueError, match="link_gbps"):
        AutoCodecPolicy(link_gbps=0.0)
    policy.encode_gbps, policy.decode_gbps, policy.link_gbps = math.inf, 10, 2
    assert policy.throughputs() == (math.inf, 10.0)
    assert policy.pays("gloo")  # (1 - 0.7) / 2 > 1 / inf + 1 / 10
    for args in ((0.0, 0.7, 1.0, 1.0), (2.0, 0.7, 0.0, 1.0), (2.0, 0.7, 1.0, -1.0)):
        with pytest.raises(ValueError, match="must be a positive number of GB/s"):
            compression_pays(*args)
