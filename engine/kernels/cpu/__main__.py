"""``python -m engine.kernels.cpu``: build the CPU kernels now (``make setup`` does), say where."""

from __future__ import annotations

import logging
import sys
from concurrent.futures import ThreadPoolExecutor

from engine.kernels import cpu

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Both libraries at once: they compile independently (ninja runs each one's sources side by side,
    # and the 8-bit cache's library alone took as long as the rest), so two cores build them in about
    # the time of the longest source file rather than of the two builds in turn. Either may load first.
    with ThreadPoolExecutor(max_workers=2) as pool:
        main_build, kv_quant_build = pool.submit(cpu.load), pool.submit(cpu.load_kv_quant)
        ok, kv_quant_ok = main_build.result(), kv_quant_build.result()
    print(
        f"CPU attention kernels: {'built in ' + str(cpu.build_dir()) if ok else 'unavailable (torch path)'}"
    )
    # The 8-bit KV cache's kernels too, so that no engine start builds them.
    print(f"CPU 8-bit KV cache kernels: {'built' if kv_quant_ok else 'unavailable (torch path)'}")
    # Never fail setup: a host without a compiler still runs the engine on the torch path.
    sys.exit(0)
