"""bench/codec_bench.py's timing: runs of whole rounds lasting at least the least run length, per-round
times, the codecs' turns rotated, every round trip checked (a fake codec with a known cost per
call, so nothing here depends on this machine's speed)."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("codec_bench_under_test", ROOT / "bench" / "codec_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SleepyCodec:
    """Encode and decode each sleep `cost` seconds; the blob is the tensor itself (size: 1 byte a
    value); `log` records (name, call) in order."""

    def __init__(self, name: str, cost: float, log: list, corrupt: bool = False):
        self.name, self.cost, self.log, self.corrupt = name, cost, log, corrupt

    def encode(self, x, threads):
        self.log.append((self.name, "encode"))
        time.sleep(self.cost)
        return x.clone()

    def decode(self, blob, threads):
        self.log.append((self.name, "decode"))
        time.sleep(self.cost)
        return blob.view(torch.int16).bitwise_xor(1).view(torch.bfloat16) if self.corrupt else blob

    @staticmethod
    def size(blob):
        return blob.numel()


def test_rounds_for_fills_the_least_run_length(bench):
    assert bench.rounds_for(0.002, 0.05) == 25
    assert bench.rounds_for(0.03, 0.05) == 2
    assert bench.rounds_for(0.06, 0.05) == 1
    assert bench.rounds_for(0.001, 0.0) == 1
    assert bench.rounds_for(1e-7, 0.05, max_rounds=40) == 40


@pytest.mark.parametrize("steady", [False, True])
def test_measure_times_whole_rounds_and_rotates_the_turns(bench, steady):
    log: list = []
    fast, slow = SleepyCodec("fast", 0.001, log), SleepyCodec("slow", 0.004, log)
    tensors = [torch.zeros(1000, dtype=torch.bfloat16), torch.ones(500, dtype=torch.bfloat16)]
    out = bench.measure([fast, slow], tensors, {"fast": 1, "slow": 1}, reps=3, steady=steady, min_run_s=0.04)
    # an untimed round each (2 tensors, encode + decode: at least 4 ms and 16 ms; a sleep may
    # overshoot), then runs of >= 40 ms: at most 10 and 3 rounds
    fast_rounds, slow_rounds = out["fast"]["rounds"], out["slow"]["rounds"]
    assert 5 <= fast_rounds <= 10 and 2 <= slow_rounds <= 3
    calls = {name: sum(1 for n, _ in log if n == name) for name in ("fast", "slow")}
    assert calls == {"fast": 2 * 2 * (1 + 3 * fast_rounds), "slow": 2 * 2 * (1 + 3 * slow_rounds)}
    # GB/s of raw bytes per round: 3,000 bytes in at least 2 sleeps of `cost` per direction
    for name, cost in (("fast", 0.001), ("slow", 0.004)):
        assert 3000 / (2 * cost) / 1e9 / 2 < out[name]["enc_gbs"] <= 3000 / (2 * cost) / 1e9
        assert 3000 / (2 * cost) / 1e9 / 2 < out[name]["dec_gbs"] <= 3000 / (2 * cost) / 1e9
        assert out[name]["ratio"] == 0.5
    # the runs in order (a warm-up run: 4 calls; a timed one: 4 calls a round): after the warm-ups
    # (fast, then slow) the repetitions alternate who goes first
    runs, i = [], 0
    for warm_up in (True, True, False, False, False, False, False, False):
        name = log[i][0]
        runs.append(name)
        i += 4 * (1 if warm_up else out[name]["rounds"])
    assert i == len(log)
    assert runs == ["fast", "slow", "fast", "slow", "slow", "fast", "fast", "slow"]


def test_measure_rejects_a_codec_whose_round_trip_is_not_exact(bench):
    log: list = []
    bad = SleepyCodec("bad", 0.0, log, corrupt=True)
    with pytest.raises(RuntimeError, match="bad: round trip is not bit-exact"):
        bench.measure([bad], [torch.zeros(64, dtype=torch.bfloat16)], {"bad": 1}, reps=1, min_run_s=0.0)
