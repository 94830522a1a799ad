"""bench/portable_gpu.py keeps working between GPU leases: its one-rank part on the CPU (a gloo
group: the same calls against the reference, and the timing against a bare all-to-all); its gloo
ranks on device tensors are what tests/test_device_strict_group.py checks on the CPU."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_one_rank_part_matches_the_reference_on_the_cpu(tmp_path):
    out = tmp_path / "portable.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "portable_gpu.py"), "--device", "cpu", "--worlds", "",
                          "--tokens", "32", "--hidden", "128", "--experts", "4", "--topk", "2", "--iters", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    line = json.loads(out.read_text().splitlines()[0])
    assert line["part"] == "one_rank" and line["backend"] == "gloo" and line["failures"] == []
    assert line["portable_ms"] > 0 and line["bare_ms"] > 0 and line["wire_bytes"] > 0
