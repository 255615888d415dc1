"""How fast the host runs now, next to the cost model the slo policy plans with.

A cost model is measured once (``inflight plan calibrate``) and then trusted for hours, but a host's
speed moves: on a shared 2-core VM a fixed bf16 matmul loop ran 0.67x to 1.87x its median speed in
half-second windows, in spells of seconds to a minute, and its one-minute means ranged 0.76-1.20.
Planned with the calibrated model alone, the policy cuts prefill chunks for a host slower than the one
it is on and rejects requests that a faster host serves in time, or, on a slow spell, lets steps run
past the TPOT deadlines it planned them within. (In one real policy benchmark planned that way,
slo_reject rejected 57 requests of a cell where plain slo served 189 of its 229 in time.)

So every served step is compared with what the model said it would take, and the policy plans with
the model scaled by a moving mean of log(measured / modelled) over the last ``window`` seconds:

    level <- level + w * (log(t / modelled) - level),   w = 1 - exp(-t / window)

where t is the measured time clipped to within 2x of what the current level expects: weighted by time,
so the window is in seconds whatever the step length, and clipped, so one stall (a page-fault storm, a
collector pass) moves the plan by a few percent instead of doubling it, while a host that really slowed
down is followed in a few windows however far it went. A one-second window follows spells of a few
seconds and averages the step-to-step noise (std of log about 0.2 a step here) to about 0.04.
"""

from __future__ import annotations

import math

# A step counts as at most twice as slow (or fast) as the current level expects.
_CLIP = math.log(2.0)
# The plan is rebuilt when the level moved this much (in log) since it last was: 1%.
_REPLAN = 0.01


class HostSpeed:
    """The moving level of measured / modelled step time (see the module docstring)."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.log_level = 0.0
        self._applied = 0.0

    @property
    def factor(self) -> float:
        """The factor the plan uses now: steps take ``factor`` times the model's time."""
        return math.exp(self._applied)

    def observe(self, modelled_s: float, measured_s: float) -> bool:
        """One step (or a run of steps, summed) measured against the model; True when the level moved
        far enough that the plan should be rebuilt with the new ``factor``."""
        if modelled_s <= 0 or measured_s <= 0 or not math.isfinite(measured_s):
            return False
        sample = min(max(math.log(measured_s / modelled_s), self.log_level - _CLIP), self.log_level + _CLIP)
        weight = 1.0 - math.exp(-modelled_s * math.exp(sample) / self.window_s)
        self.log_level += weight * (sample - self.log_level)
        if abs(self.log_level - self._applied) < _REPLAN:
            return False
        self._applied = self.log_level
        return True
