"""The fault-tolerant training run: the one training command, faults, the flight recorder, checkpoints."""
