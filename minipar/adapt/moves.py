"""The plan of moves between two layouts: chapter 12's name for the mechanism every move of state
shares (:mod:`minipar.moves`: chapter 04's re-partitioning moves layers with it too)."""
from ..moves import Move, Plan, expand, move, plan, segments

__all__ = ["Move", "Plan", "plan", "segments", "expand", "move"]
