"""One builder at a time per build folder, and no wait on a builder that is dead.

torch's extension loader guards a build with a plain file, ``<build dir>/lock``, created with
O_EXCL and removed when the build ends; everyone else polls until the file is gone. A builder killed
mid-build (OOM, SIGKILL, a pod deleted during start-up) leaves the file behind, and every later start
on that host polls forever, silently.

So every build goes through :func:`exclusive_build` first: an ``flock`` on a file of our own in the same
folder, which the kernel drops when its holder dies. Whoever holds it is the only live builder, so a
torch ``lock`` file seen under it was left by a dead one and is removed, with a warning. The holder
writes its pid into our lock file, so a waiter can say whom it waits for and a breaker whose lock it
broke.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

# torch.utils.cpp_extension's baton (FileBaton) in the build directory.
TORCH_LOCK = "lock"
OWN_LOCK = "inflight-build.lock"


def _recorded_pid(handle: IO[str]) -> str:
    """The pid the last holder wrote, or '?' (an empty file: nobody has built here yet)."""
    handle.seek(0)
    text = handle.read().strip()
    return text if text.isdigit() else "?"


@contextlib.contextmanager
def exclusive_build(directory: Path) -> Iterator[None]:
    """Hold ``directory``'s build lock for the body; break torch's lock file if a dead builder left it.

    Blocks while another live process builds in ``directory`` (one info line says which pid).
    """
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / OWN_LOCK, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info(
                "waiting for process %s, which is building the CPU kernels in %s",
                _recorded_pid(handle),
                directory,
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        previous = _recorded_pid(handle)
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        stale = directory / TORCH_LOCK
        if stale.exists():
            log.warning(
                "removing %s: left by a CPU kernel build that died (pid %s) and would block every later "
                "start; building again",
                stale,
                previous,
            )
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
