"""Where inflight writes on the local disk: one cache root for every file the project generates.

``$INFLIGHT_HOME`` first (the folder itself, e.g. a test's temporary directory), then
``$XDG_CACHE_HOME/inflight``, then ``~/.cache/inflight``. Containers set ``HOME=/tmp`` (a small scratch
volume) and ``XDG_CACHE_HOME=/cache`` (the volume sized for converted models and built kernels): a path
that ignored ``XDG_CACHE_HOME`` filled the scratch volume and got the pod evicted.

Torch-free: the gateway resolves GGUF checkpoints through it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

HOME_ENV = "INFLIGHT_HOME"
CPU_EXT_ENV = "INFLIGHT_CPU_EXT_DIR"


def user_cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/inflight``, else ``~/.cache/inflight`` (``INFLIGHT_HOME`` left aside)."""
    env = os.environ if environ is None else environ
    # The XDG base-directory spec: unset, empty or relative means "use the default".
    xdg = env.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "inflight"
    return Path.home() / ".cache" / "inflight"


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """Converted models and generated checkpoints: ``$INFLIGHT_HOME``, else :func:`user_cache_root`."""
    env = os.environ if environ is None else environ
    if env.get(HOME_ENV):
        return Path(env[HOME_ENV]).expanduser()
    return user_cache_root(env)


def models_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Converted (GGUF) and generated (tiny, bench) checkpoints."""
    return cache_root(environ) / "models"


def cpu_ext_root(environ: Mapping[str, str] | None = None) -> Path:
    """Build folders of the C++ CPU kernels: ``$INFLIGHT_CPU_EXT_DIR``, else ``<user cache>/cpu_ext``.

    Not under ``INFLIGHT_HOME``: tests point that at a temporary folder, and a fresh model cache must
    not cost a kernel rebuild.
    """
    env = os.environ if environ is None else environ
    if env.get(CPU_EXT_ENV):
        return Path(env[CPU_EXT_ENV]).expanduser()
    return user_cache_root(env) / "cpu_ext"
