"""Pipelines of several training phases: the demo (SFT then RL on the built-in task)."""
