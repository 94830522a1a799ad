"""bench/codec_bench.py. Its timing: runs of whole rounds whose faster part lasts about the least
run length within the memory caps, calibrated by untimed runs, each round on its own input copies,
per-round times, the codecs' turns rotated, every round trip checked (fake codecs with a known
cost per call, so nothing here depends on this machine's speed; a sleep may overshoot, never
undershoot). Its chunk-size sweep: the blobs' real sizes."""
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
    """Encode sleeps `enc` seconds, decode `dec` (its first decode `first_dec` more); the blob is a
    copy of the tensor (size: 1 byte a value); `inputs` records every encoded tensor."""

    def __init__(self, name: str, enc: float, dec: float, corrupt: bool = False, first_dec: float = 0.0):
        self.name, self.enc, self.dec, self.corrupt, self.first_dec = name, enc, dec, corrupt, first_dec
        self.inputs: list = []

    def encode(self, x, threads):
        self.inputs.append(x)
        time.sleep(self.enc)
        return x.clone()

    def decode(self, blob, threads):
        time.sleep(self.dec + self.first_dec)
        self.first_dec = 0.0
        return blob.view(torch.int16).bitwise_xor(1).view(torch.bfloat16) if self.corrupt else blob

    @staticmethod
    def size(blob):
        return blob.numel()


@pytest.fixture
def runs(bench, monkeypatch):
    """Every run measure() makes, as (codec name, rounds), in order."""
    made: list = []
    original = bench._run_without_gc

    def recording(timer, codec, tensors, threads, rounds):
        made.append((codec.name, rounds))
        return original(timer, codec, tensors, threads, rounds)

    monkeypatch.setattr(bench, "_run_without_gc", recording)
    return made


def test_rounds_for_fills_the_least_run_length(bench):
    assert bench.rounds_for(0.002, 0.05) == 25
    assert bench.rounds_for(0.03, 0.05) == 2
    assert bench.rounds_for(0.06, 0.05) == 1
    assert bench.rounds_for(0.001, 0.0) == 1
    assert bench.rounds_for(1e-7, 0.05, max_rounds=40) == 40


@pytest.mark.parametrize("steady", [False, True])
def test_runs_are_calibrated_timed_per_round_and_rotated(bench, runs, steady):
    # a and b decode 4x faster than they encode: their decodes set the rounds
    codecs = [SleepyCodec("a", 0.016, 0.004), SleepyCodec("b", 0.024, 0.006), SleepyCodec("c", 0.008, 0.008)]
    tensors = [torch.zeros(1000, dtype=torch.bfloat16), torch.ones(500, dtype=torch.bfloat16)]
    min_run = 0.08
    out = bench.measure(codecs, tensors, {c.name: 1 for c in codecs}, reps=3, steady=steady, min_run_s=min_run)
    rounds = {c.name: out[c.name]["rounds"] for c in codecs}
    # each codec's calibration (one round, then twice the rounds it suggests), then the repetitions
    # in rotated order, each codec with its calibrated rounds
    assert [name for name, _ in runs[:-9]] == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    assert [r for _, r in runs[:-9:3]] == [1, 1, 1]
    assert all(runs[k][1] == runs[k + 1][1] > 1 for k in (1, 4, 7))
    assert runs[-9:] == [(n, rounds[n]) for n in ("a", "b", "c", "b", "c", "a", "c", "a", "b")]
    for c in codecs:
        # a round's decodes take 2 dec (a sleep may overshoot: fewer rounds, never a shorter run):
        # the rounds make them last about min_run (encodes alone would give a and b a quarter)
        assert rounds[c.name] <= -(-min_run // (2 * c.dec))
        assert rounds[c.name] * 2 * c.dec * 1.5 >= min_run
        # per round: 3,000 raw bytes in 2 sleeps of enc (dec) at least
        for part, cost in (("enc_gbs", c.enc), ("dec_gbs", c.dec)):
            assert 3000 / (2 * cost) / 1e9 / 4 < out[c.name][part] <= 3000 / (2 * cost) / 1e9
        assert out[c.name]["ratio"] == 0.5


def test_calibration_does_not_stop_at_the_cold_first_round(bench):
    """A first decode 20 ms slow makes the first round's encodes its faster part (16 ms: 5 rounds);
    the runs of 5 rounds then give 10 (the decodes, 8 ms a round)."""
    cold = SleepyCodec("cold", 0.008, 0.004, first_dec=0.02)
    tensors = [torch.zeros(100, dtype=torch.bfloat16), torch.zeros(100, dtype=torch.bfloat16)]
    assert 8 <= bench.calibrate(bench._time_once, cold, tensors, 1, 0.08, most=1000) <= 10


@pytest.mark.parametrize("steady", [False, True])
def test_every_round_codes_its_own_copies(bench, steady):
    codec = SleepyCodec("c", 0.0, 0.0)
    tensors = [torch.randn(64, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16) for k in range(3)]
    bench.measure([codec], tensors, {"c": 1}, reps=2, steady=steady, min_run_s=0.0)
    # one untimed round and two timed runs of one round: 9 inputs, all distinct, equal to the tensors
    assert len(codec.inputs) == 9
    assert len({x.data_ptr() for x in codec.inputs}) == 9
    assert not {x.data_ptr() for x in codec.inputs} & {t.data_ptr() for t in tensors}
    for k, x in enumerate(codec.inputs):
        assert torch.equal(x.view(torch.int16), tensors[k % 3].view(torch.int16))


def test_rounds_stay_within_the_memory_caps(bench, monkeypatch):
    tensors = [torch.zeros(5000, dtype=torch.bfloat16)] * 4  # 40,000 raw bytes a round
    assert bench.most_rounds(tensors, steady=False) == min(1000, int(bench.KEPT_RUN_BYTES // 40_000),
                                                          bench.KEPT_RUN_TENSORS // 4)
    monkeypatch.setattr(bench, "KEPT_RUN_BYTES", 200_000)
    monkeypatch.setattr(bench, "STEADY_RUN_BYTES", 400_000)
    assert bench.most_rounds(tensors, steady=False) == 5 and bench.most_rounds(tensors, steady=True) == 10
    monkeypatch.setattr(bench, "KEPT_RUN_TENSORS", 8)
    assert bench.most_rounds(tensors, steady=False) == 2
    assert bench.most_rounds([torch.zeros(10**6, dtype=torch.bfloat16)], steady=False) == 1  # one round at least
    fast = SleepyCodec("fast", 0.0, 0.0)
    for steady, most in ((False, 2), (True, 10)):
        out = bench.measure([fast], tensors, {"fast": 1}, reps=1, steady=steady, min_run_s=10.0)
        assert out["fast"]["rounds"] == most


def test_measure_rejects_a_codec_whose_round_trip_is_not_exact(bench):
    bad = SleepyCodec("bad", 0.0, 0.0, corrupt=True)
    with pytest.raises(RuntimeError, match="bad: round trip is not bit-exact"):
        bench.measure([bad], [torch.zeros(64, dtype=torch.bfloat16)], {"bad": 1}, reps=1, min_run_s=0.0)


def test_chunk_sweep_sizes_are_the_blobs_sizes(bench):
    """--chunk-sweep's rows: per kind, layout and chunk size, the blobs' bytes over the raw bytes
    (None: encode's default chunking) and that over the layout's order-0 bound."""
    from ep_comm.codecs import lossless

    g = torch.Generator().manual_seed(3)
    data = {"activations": [(torch.randn(3, 40000, generator=g) * 0.1).bfloat16(),
                            torch.relu(torch.randn(7168 * 70, generator=g)).bfloat16()]}
    rows = bench.chunk_sweep(data, [None, 4096, 131072])
    assert [(r["layout"], r["chunk_values"]) for r in rows] == [
        (layout, cv) for layout in ("whole tensors", "64x7168 chunks") for cv in (None, 4096, 131072)]
    for r in rows:
        tensors = bench.layouts(data["activations"])[r["layout"]]
        size = sum(lossless.encode(t, chunk_values=r["chunk_values"]).numel() for t in tensors)
        raw = sum(2 * t.numel() for t in tensors)
        assert r["ratio"] == size / raw
        assert r["over_bound"] == pytest.approx(size / raw / bench.order0_bound(tensors), rel=1e-12)
    whole = {r["chunk_values"]: r["ratio"] for r in rows if r["layout"] == "whole tensors"}
    assert whole[4096] > whole[None]  # 32 states and a directory entry per 4,096 values
