"""Hand-written CPU kernels, compiled once per machine on first use.

``skinny()`` returns the compiled module: the skinny GEMM of ``skinny.cpp`` (decode-sized linears, 1-32
rows, fp32 or bf16 weights; ``dot_bf16`` says when bf16 ones take bf16 arithmetic), the decode attention
of ``attention.cpp``, a draft head's whole sampled chain of ``draft.cpp``, and the training forward's
logits-block passes and the one-call sampler of ``logprobs.cpp`` (see the files for why), or
None where it cannot run: not an x86 CPU with AVX2 + FMA, no C++ compiler, or ``SPECROLL_KERNELS=0``.
Callers fall back to oneDNN and SDPA, so a missing compiler costs speed, not function.

The build (``torch.utils.cpp_extension``, 45 s to about 2 min of CPU) lands in
``$SPECROLL_HOME/kernels/torch<version>-py<version>/<build key>``, a directory named by a hash of the sources,
headers and flags, which holds a copy of the sources it was built from. Any checkout, clone or installed copy
with the same sources therefore loads the same build without recompiling (ninja would otherwise rebuild for a
new source path or a newer file time, as every fresh clone has), and checkouts with different sources no longer
rebuild over each other. A changed source or flag gets a directory of its own; directories unused for a week,
past the newest ``KEEP_BUILDS``, are removed when a new one is built.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

SRCS = [Path(__file__).with_name(n)
        for n in ("skinny.cpp", "attention.cpp", "draft.cpp", "layers.cpp", "logprobs.cpp")]
HEADERS = [Path(__file__).with_name("kernels.h")]  # included by the sources; their hash is in CFLAGS (below)
# the build flags (benchmarks/ab_build.py builds other revisions alike). torch's extension loader rebuilds when a
# source or a flag changes, not a header: the headers' hash goes in as a define, so a header edit rebuilds too.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp",
          "-DSPECROLL_HEADERS=0x" + hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]]
LDFLAGS = ["-fopenmp"]
MAX_ROWS = 32  # AVX2: up to here the kernel beat oneDNN on every SmolLM2 shape (1.0-2.2x); at 64 not always (BENCHMARKS.md)
# AVX-512 (two panels at a time): all linears of a SmolLM2 forward from DRAM, kernel vs oneDNN's prepacked
# linear, 32 / 64 / 96 / 128 / 256 rows: 1.16-1.32x / 1.24-1.25x / 1.10-1.11x / 1.01-1.03x / 0.95-0.96x (2026-11-24, Xeon)
MAX_ROWS_AVX512 = 96


@functools.cache
def source_hash() -> str:
    """A short hash of the kernels' sources and headers: what a measured latency curve (``engine.profiler``)
    depends on beyond the machine, so a changed kernel gets a new profile instead of a stale C_peak."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in SRCS + HEADERS)).hexdigest()[:12]


KEEP_BUILDS = 4  # build directories kept beside the current one, newest first (older than a week otherwise go)


@functools.cache
def build_key() -> str:
    """A hash of everything a build depends on besides torch and Python (which name the parent directory):
    the sources and headers as bytes, and the flags. Not their paths or file times."""
    h = hashlib.sha256()
    for p in SRCS + HEADERS:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update("\0".join(CFLAGS + LDFLAGS).encode())
    return h.hexdigest()[:16]


def _build_root() -> Path:
    from ..models.hub import home

    return home() / "kernels" / f"torch{torch.__version__.split('+')[0]}-py{sys.version_info[0]}{sys.version_info[1]}"


def _build_dir() -> Path:
    """This source tree's build directory, with the sources staged in it: a file already there has the same
    bytes (the name says so), so it is left as it is and keeps its time, which is what lets ninja skip the
    build; a missing one is written whole and then renamed into place, so a concurrent process never reads
    half a file."""
    d = _build_root() / build_key()
    d.mkdir(parents=True, exist_ok=True)
    d = d.resolve()  # one spelling of the path (the tests reach it through a symlink): ninja's commands name it
    for p in SRCS + HEADERS:
        dst = d / p.name
        if not dst.exists():
            tmp = d / f".{p.name}.{os.getpid()}.tmp"
            tmp.write_bytes(p.read_bytes())
            os.replace(tmp, dst)
    return d


def _prune(keep: Path, now: float | None = None, max_age_s: float = 7 * 86400) -> list[Path]:
    """Remove build directories other than ``keep`` that are past the newest ``KEEP_BUILDS`` and unused for
    ``max_age_s`` (each load touches its directory). Returns what it removed."""
    now = time.time() if now is None else now
    others = sorted((d for d in keep.parent.iterdir() if d.is_dir() and d != keep),
                    key=lambda d: d.stat().st_mtime, reverse=True)
    gone = [d for d in others[KEEP_BUILDS:] if now - d.stat().st_mtime > max_age_s]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone


def enabled() -> bool:
    return os.environ.get("SPECROLL_KERNELS", "1") not in ("0", "false", "off")


@functools.cache
def _build():
    """Compile (when a source or flag changed) and load the extension, once per process: a second ``load`` of
    the same name in one process builds a ``_v1`` copy, which the next process then rebuilds over."""
    from torch.utils.cpp_extension import load

    d = _build_dir()
    if not any(d.glob("*.so")):
        print("specroll: compiling the CPU kernels for this machine (once, up to ~2 min) ...", file=sys.stderr, flush=True)
        _prune(d)
    os.utime(d)  # "used now", for _prune
    return load("specroll_skinny", [str(d / p.name) for p in SRCS], build_directory=str(d),
                extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), verbose=False)  # copies: load appends to them


@functools.cache
def skinny():
    """The compiled skinny-GEMM module, or None (with one warning saying why) if it cannot be used."""
    if not enabled():
        return None
    avx2 = getattr(torch.cpu, "_is_avx2_supported", lambda: False)
    if not (platform.machine() in ("x86_64", "AMD64") and avx2()):
        return None
    try:
        return _build()
    except Exception as e:  # no compiler / headers / ninja: oneDNN still works
        warnings.warn(f"specroll: the CPU kernels could not be built ({type(e).__name__}: {str(e)[:200]}); "
                      "using oneDNN and SDPA instead (set SPECROLL_KERNELS=0 to silence)", stacklevel=2)
        return None


def max_rows() -> int:
    """The most rows the skinny kernel takes (more go to oneDNN) for the instruction set it runs; 0 without it."""
    ext = skinny()
    if ext is None:
        return 0
    isa = getattr(ext, "isa", None)
    return MAX_ROWS_AVX512 if isa is not None and isa() == "avx512" else MAX_ROWS


def int8_ok() -> bool:
    """Whether int8 weight panels (``pack_int8``, ``decoder.int8_weights``) run here: wherever the kernels do (AVX2
    and AVX-512 loops; an extension built before the AVX2 loop existed takes them only on AVX-512)."""
    ext = skinny()
    return ext is not None and (ext.isa() == "avx512" or getattr(ext, "INT8_AVX2", False))


@functools.cache
def dot_bf16() -> bool:
    """Whether bf16 panels are packed for ``vdpbf16ps`` (``pack(..., pairs=True)``: bf16 x bf16 products, fp32
    sums, the input rows rounded to bf16 as oneDNN's bf16 matmuls round them) rather than for fp32 FMA over
    widened weights. True on a CPU with AVX-512 BF16 where bf16 is fast (``device.fast_bf16``) without AMX: there
    vdpbf16ps does twice FMA's flops per cycle (Zen 5: 500 against 268 GFLOP/s per core, 2026-11-26) and all
    linears of a SmolLM2 forward took 0.66x the FMA loop's time at 16-96 rows (benchmarks/skinny_dot_bf16.py,
    BENCHMARKS.md session 29). Elsewhere it buys no flops (an AVX-512 BF16 Xeon: the same 64 per cycle as FMA)
    and would only round the activations. ``SPECROLL_DOT_BF16=0`` / ``1`` overrides (1 needs AVX-512 BF16)."""
    ext = skinny()
    if ext is None or not ext.has_dot_bf16():
        if os.environ.get("SPECROLL_DOT_BF16", "").strip() == "1":
            warnings.warn("specroll: SPECROLL_DOT_BF16=1 ignored: this CPU has no AVX-512 BF16 (or no kernels)",
                          stacklevel=2)
        return False
    env = os.environ.get("SPECROLL_DOT_BF16", "").strip()
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise ValueError(f"SPECROLL_DOT_BF16 must be 0 or 1 (or unset to decide by the CPU), got {env!r}")
    from ..device import fast_bf16

    return fast_bf16() and not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
