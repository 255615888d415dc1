"""The CPU engine's C++ kernels: paged attention and the KV store (read in place through block tables),
the layer's fused pointwise ops (RMSNorm with the residual add, rotary, SiLU-and-mul), the linear
layers on weights packed into column panels (gemm.cpp, AVX-512 hosts), bf16 linear layers at decode
sizes on AMX tiles over oneDNN's packed weights (amx_gemm.cpp), the linear layers on weights
kept in GGUF block formats (quant_gemm.cpp), and the sampler's random draw (sampling.cpp). The 8-bit
KV cache's attention and store (kv_quant.cpp) are a library of their own, built by ``load_kv_quant()``
the first time an engine keeps such a cache.

``load()`` builds them on first use (a torch extension compiled with the host's g++, cached per source
and torch version in ``engine.paths.cpu_ext_root()``; ``make setup`` builds it ahead of time, and a build
that died leaves no lock behind to wait on: ``build_lock.py``) and registers ``torch.ops.inflight_cpu``.
A finished build leaves a stamp; a build folder with it is loaded as it is, without the lock or ninja,
so kernels built into a worker image at build time load from its read-only filesystem. The kernels
check the CPU they run on (``__builtin_cpu_supports``) rather than being compiled for the build host's.
A host that cannot build them (no compiler, no ninja) keeps the torch path, with one warning.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

from engine import envs
from engine.kernels.cpu.build_lock import exclusive_build
from engine.paths import cpu_ext_root

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = [
    _HERE / "paged_attention.cpp",
    _HERE / "pointwise.cpp",
    _HERE / "gemm.cpp",
    _HERE / "amx_gemm.cpp",
    _HERE / "quant_gemm.cpp",
    _HERE / "sampling.cpp",
]
_HEADERS = [_HERE / "vec.h", _HERE / "argmax.h", _HERE / "quant_gemm_isa.h", _HERE / "quant_gemm_int8.h"]
_KV_QUANT_SOURCES = [_HERE / "kv_quant.cpp"]
_KV_QUANT_HEADERS = [_HERE / "vec.h", _HERE / "kv_quant_rows.h"]
_FLAGS = ["-O3", "-fopenmp", "-Wno-psabi"]
_LIBRARY = "inflight_cpu"
# Written last by a build that succeeded: the library beside it is complete and matches the folder's key.
BUILT_STAMP = "inflight-built"


def build_dir(sources: list[Path] | None = None, headers: list[Path] | None = None) -> Path:
    """Cache folder keyed by what the binary depends on: the source, the flags, torch's version, and
    the paths ninja's command names (two checkouts sharing one folder rebuilt it on every load)."""
    key = hashlib.sha256(" ".join(_FLAGS).encode() + torch.__version__.encode())
    key.update(f"{_HERE.resolve()}:{Path(torch.__file__).resolve()}".encode())
    for path in (sources or _SOURCES) + (headers or _HEADERS):
        key.update(path.read_bytes())
    return cpu_ext_root() / key.hexdigest()[:16]


def build(name: str, sources: list[Path], directory: Path) -> None:
    """Compiles ``sources`` into ``directory`` (or loads what is there) and registers their ops library
    ``name``; raises what the compiler or torch raise."""
    from torch.utils import cpp_extension

    # torch's own lock file outlives a builder that was killed; ours does not (build_lock.py).
    with exclusive_build(directory):
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in sources],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
        (directory / BUILT_STAMP).write_text(f"{name}.so\n")


def load_prebuilt(directory: Path) -> bool:
    """Load a finished build in ``directory`` as it is (no lock, no ninja: it may be read-only); False
    when there is none. The folder's name is the hash of everything the library depends on, so a
    stamped one is current."""
    library = directory / f"{_LIBRARY}.so"
    if not ((directory / BUILT_STAMP).is_file() and library.is_file()):
        return False
    torch.ops.load_library(str(library))
    return True


@functools.cache
def load() -> bool:
    """True when ``torch.ops.inflight_cpu`` is ready; False (after one warning) when it cannot be built."""
    if envs.cpu_kernels_disabled():
        return False
    directory = build_dir()
    try:
        if not load_prebuilt(directory):
            build(_LIBRARY, _SOURCES, directory)
    except Exception as exc:  # a compiler error, a missing ninja or g++: the torch path still works
        log.warning(
            "CPU attention kernels unavailable (%s: %s); using the slower torch path", type(exc).__name__, exc
        )
        return False
    return True


@functools.cache
def load_kv_quant() -> bool:
    """True when ``torch.ops.inflight_cpu.paged_attention_quant`` / ``store_kv_quant`` (the 8-bit KV
    cache's kernels) are ready; False (after one warning) when they cannot be built."""
    if envs.cpu_kernels_disabled():
        return False
    try:
        build("inflight_cpu_kv_quant", _KV_QUANT_SOURCES, build_dir(_KV_QUANT_SOURCES, _KV_QUANT_HEADERS))
    except Exception as exc:  # as load(): the torch path reads the same cache format
        log.warning(
            "CPU 8-bit KV cache kernels unavailable (%s: %s); using the slower torch path",
            type(exc).__name__,
            exc,
        )
        return False
    return True
