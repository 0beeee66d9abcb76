"""Analytical models that the course compares its measurements against.

One function per formula, each citing its source. Chapters add their own modules here:
collectives (α-β), pipeline bubbles, activation memory, ZeRO memory, FLOPs.
"""
from .collectives import (OPS, alpha_beta_time, bus_bandwidth, collective_bytes,
                          collective_steps, fit_alpha_beta)

__all__ = ["OPS", "collective_bytes", "collective_steps", "alpha_beta_time", "fit_alpha_beta",
           "bus_bandwidth"]
