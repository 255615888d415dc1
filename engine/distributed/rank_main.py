"""Entry point of ranks 1..N-1 (``python -m engine.distributed.rank_main``, started by rank 0).

The rank reads a ``RankInit`` from stdin, builds its shard (the same ``ModelRunner`` as rank 0, so
both size, warm up and capture in the same order, collectives included), then runs one forward per
message until stdin ends. It keeps no request state: each message is the step's packed inputs.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import sys


def _die_with_parent() -> None:
    # Linux: SIGKILL this rank when rank 0's process dies, whatever it is doing (even inside a
    # collective, which would otherwise wait out its timeout).
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main() -> int:
    # Like the engine core: a terminal's Ctrl-C or a pod's SIGTERM reaches the whole process group,
    # and the engine drains for a grace period that needs every rank; rank 0 ends the ranks.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    import torch

    from engine.distributed.launcher import RankInit, join_group
    from engine.distributed.pipe import read_message
    from engine.runner.model_runner import ModelRunner

    stdin = sys.stdin.buffer
    init = read_message(stdin)
    if not isinstance(init, RankInit):
        return 2
    logging.basicConfig(
        level="INFO", format=f"%(asctime)s %(levelname)s tp-rank-{init.rank} %(name)s: %(message)s"
    )
    log = logging.getLogger("engine.distributed.rank_main")
    torch.set_num_threads(init.torch_threads)
    config = init.config
    device = config.device
    if device.type == "cuda":
        device = torch.device("cuda", init.rank)
        config = config.with_device(device)
    tp = join_group(device, init.rank, config.tensor_parallel_size, init.port, init.timeout_s)
    try:
        runner = ModelRunner(config, tp=tp)
        while (message := read_message(stdin)) is not None:
            runner.run_rank_step(message)
    except BaseException:
        log.exception("tensor-parallel rank %d failed", init.rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
