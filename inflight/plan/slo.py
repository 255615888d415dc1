"""Service-level objectives: a TTFT and a TPOT bound, parsed from ``ttft:MS tpot:MS``.

The planner sizes fleets against them; the benchmarks count the requests that met them (goodput).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class Served(Protocol):
    """What ``SLO.met`` reads of a request's outcome (bench/results.py's RequestResult has it)."""

    @property
    def completed(self) -> bool: ...

    @property
    def ttft(self) -> float | None: ...

    @property
    def tpot(self) -> float | None: ...


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, r: Served) -> bool:
        if not r.completed:
            return False
        ttft, tpot = r.ttft, r.tpot
        if self.ttft_s is not None and (ttft is None or ttft > self.ttft_s):
            return False
        return not (self.tpot_s is not None and tpot is not None and tpot > self.tpot_s)

    def describe(self) -> str:
        parts = []
        if self.ttft_s is not None:
            parts.append(f"ttft:{self.ttft_s * 1e3:g}")
        if self.tpot_s is not None:
            parts.append(f"tpot:{self.tpot_s * 1e3:g}")
        return " ".join(parts) or "none"


_SLO_ITEM = re.compile(r"^(ttft|tpot):(\d+(?:\.\d+)?)(ms|s)?$")


def parse_slo(items: Iterable[str]) -> SLO:
    """``["ttft:2000", "tpot:300"]`` or ``["ttft:2000 tpot:300"]`` -> SLO (milliseconds; a trailing
    ``s`` means seconds)."""
    bounds: dict[str, float] = {}
    for item in " ".join(items).replace(",", " ").split():
        m = _SLO_ITEM.match(item.strip().lower())
        if m is None:
            raise ValueError(f"bad SLO item {item!r}: expected ttft:MS or tpot:MS")
        name, value, unit = m.group(1), float(m.group(2)), m.group(3) or "ms"
        if name in bounds:
            raise ValueError(f"SLO bound {name} given twice")
        bounds[name] = value if unit == "s" else value / 1e3
    return SLO(ttft_s=bounds.get("ttft"), tpot_s=bounds.get("tpot"))
