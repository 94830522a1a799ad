"""The host lossless coders' SIMD paths under AddressSanitizer and UBSan: tests/native/lossless_fuzz.cpp
decodes real-data blobs and ~4,000 mutations of them from exact-size heap copies on every path
the CPU has (portable, AVX2, AVX-512: same status, same values; a read past the blob aborts), and
checks the rANS encoding passes against the portable one on random chunks (the AVX-512 one also
with two chunks in lockstep)."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_codec_lossless_v5 import _layout

from ep_comm.codecs import lossless

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "native" / "lossless_fuzz.cpp"

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
                                reason="needs g++ on x86-64")


def write_blobs(directory: Path, count: int) -> tuple[int, int, int]:
    """`count` blobs of varied chunk sizes and contents: dense values, +0.0 runs and scatter, all
    +0.0, random bit patterns (raw chunks), lengths that end mid-step and mid-chunk; returns the
    number of format version 5 extra tables, of format version 6 chunks with coded fields, and of
    those with one state (mode 5) among them."""
    g = torch.Generator().manual_seed(17)
    extra_tables = coded_fields = one_state_fields = 0
    for i in range(count):
        cv = [32, 64, 96, 128, 1024, 4096][i % 6]
        n = int(torch.randint(1, 5 * cv + 40, (1,), generator=g))
        x = (torch.randn(n, generator=g) * [0.02, 1.0, 30.0][i % 3]).bfloat16()
        style = i % 5
        if style == 1:
            a = int(torch.randint(0, n, (1,), generator=g))
            x[a: a + int(torch.randint(0, n, (1,), generator=g))] = 0
        elif style == 2:
            x[torch.rand(n, generator=g) < 0.3] = 0
        elif style == 3:
            x = torch.zeros(n, dtype=torch.bfloat16)
        elif style == 4 and i % 2 == 0:
            x = torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        # every fourth blob in format version 3 and every fourth in 2, which the decoders still read,
        # every fourth in 5: those of 4,096-value chunks made of chunks of different scales, so
        # that they carry tables of their own; and every fourth in 7 or 6 (alternately: their
        # checksums differ): those of values, 1,024 or more a chunk (two more chunks of them
        # appended; 3,000 values to a one-state blob) with 3 mantissa bits kept, so that their
        # fields are coded
        version = [7, 5, 3, 2][i % 4]
        if version == 7 and (i // 4) % 2 == 1:
            version = 6
        if version >= 6 and style not in (3, 4):
            # every other one a blob's only chunk of at most 16,384 values: one state (mode 5)
            one_state = i % 8 == 0
            cv = 65536 if one_state else max(cv, 1024)
            x = torch.cat([x, (torch.randn(3000 if one_state else 2 * cv, generator=g) * 0.02).bfloat16()])
            m, e = torch.frexp(x.float())
            x = torch.ldexp(torch.round(m * 16) / 16, e).bfloat16()
        if version == 5 and cv == 4096 and style != 3:
            x = torch.cat([x, (torch.randn(3 * cv, generator=g) * 1e3).bfloat16(),
                           (torch.randn(cv, generator=g) * 1e-4).bfloat16()])
        blob = lossless.encode(x, chunk_values=cv, version=version)
        if version == 5:
            extra_tables += int(blob[17])
        if version >= 6:
            coded_fields += sum(e["mode"] in (4, 5) for e in _layout(blob)["entries"])
            one_state_fields += sum(e["mode"] == 5 for e in _layout(blob)["entries"])
        (directory / f"{i}.blob").write_bytes(blob.numpy().tobytes())
        (directory / f"{i}.raw").write_bytes(x.view(torch.int16).numpy().tobytes())
    return extra_tables, coded_fields, one_state_fields


def test_simd_paths_are_memory_safe_and_agree(tmp_path):
    binary = tmp_path / "lossless_fuzz"
    build = subprocess.run(
        ["g++", "-O1", "-g", "-std=c++17", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
         "-fno-omit-frame-pointer", f"-I{ROOT / 'csrc'}", str(SOURCE), "-o", str(binary)],
        capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "asan" in build.stderr.lower():
        pytest.skip(f"no AddressSanitizer runtime: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-2000:]
    blobs = 40
    extra_tables, coded_fields, one_state_fields = write_blobs(tmp_path, blobs)
    # format 5's extra tables and 6's coded fields (32 states and one) are fuzzed too
    assert extra_tables >= 3 and coded_fields >= 3 and one_state_fields >= 2
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    run = subprocess.run([str(binary), str(tmp_path), str(blobs), "100", "1500", "7"],
                         capture_output=True, text=True, timeout=600, env=env)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-4000:]
    assert "decoders: 4040 trials" in report and "encoders: 1500 trials (" in report, report
    # chunks without +0.0 also went through the AVX2 pass's staged-entry loop (where AVX2 runs)
    staged = int(re.search(r"encoders: 1500 trials \((\d+) without", report).group(1))
    assert staged > 300 or "avx2" not in report.splitlines()[0], report
    # every random chunk was also coded by the AVX-512 pass beside another in lockstep (where it runs)
    lockstep = int(re.search(r"encoders: 1500 trials \(\d+ without \+0\.0, (\d+) in lockstep", report).group(1))
    assert lockstep == (1500 if "avx512" in report.splitlines()[0] else 0), report
    # the table choices over the present symbols, with 11- and 12-bit frequencies among them
    lists = re.search(r"symbol lists: 1500 trials \((\d+) with 12-bit frequencies\), 0 mismatches", report)
    assert lists and 100 < int(lists.group(1)) < 1400, report
    # about half the random chunks were coded with 12-bit frequencies (format version 3's finer table)
    wide = int(re.search(r"in lockstep pairs, (\d+) with 12-bit", report).group(1))
    assert wide > 300, report
    # the chunks without +0.0 had their raw fields packed by the AVX-512 pass too (where it runs)
    fused = int(re.search(r"(\d+) with fields packed by the AVX-512 pass", report).group(1))
    assert fused == (staged if "avx512" in report.splitlines()[0] else 0), report
    assert "division: " in report and "mismatch" not in report.replace(" 0 mismatches", ""), report
    # format 6's AVX-512 field stream was checked against a plain loop (where AVX-512 runs)
    assert ("field values: 150 trials, 0 mismatches" in report) == ("avx512" in report.splitlines()[0]), report
    # the paths the module runs are the ones checked
    assert ("avx512" in report.splitlines()[0]) == ("avx512" in lossless.simd_paths()), report
