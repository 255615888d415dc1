"""Iteration-level scheduling: one token budget a step, running requests first."""

from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerOutput"]
