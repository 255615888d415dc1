"""Capacity planning from a measured step-cost model: calibrate, simulate a fleet, size it."""
