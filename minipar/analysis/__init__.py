"""The cost model (formulas per dimension) and the planner that searches layouts."""
