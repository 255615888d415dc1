"""``python -m engine.kernels.cpu``: build the CPU kernels now (``make setup`` does), say where."""

from __future__ import annotations

import logging
import sys

from engine.kernels import cpu

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok = cpu.load()
    print(
        f"CPU attention kernels: {'built in ' + str(cpu.build_dir()) if ok else 'unavailable (torch path)'}"
    )
    # The 8-bit KV cache's kernels too, so that no engine start builds them.
    print(f"CPU 8-bit KV cache kernels: {'built' if cpu.load_kv_quant() else 'unavailable (torch path)'}")
    # Never fail setup: a host without a compiler still runs the engine on the torch path.
    sys.exit(0)
