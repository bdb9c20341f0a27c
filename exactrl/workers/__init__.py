"""Roles as workers: each owns one model, its train engine and its device (see worker.py).
The policy and the frozen reference are plain workers; the critic (critic.py) adds a value head."""
