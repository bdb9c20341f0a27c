"""Provenance and the audit: the run manifest, the installed-stack probe (stack.py) and the
audit of past runs (runs.py)."""
