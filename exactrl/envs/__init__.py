"""Environments for multi-turn and agent RL: what the policy acts on between its turns.

base.py the interface (reset, step) and what crosses it; render.py how an observation becomes token ids;
process.py where a user's environment runs (a process of its own, with a hard timeout); tools.py the built-in
tool-calling environment over a module of plain functions; remote.py an environment served over HTTP.
"""
