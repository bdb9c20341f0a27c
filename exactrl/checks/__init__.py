"""Runtime verification that runs inside every training command (see DESIGN.md, "Verification
built in"): the canary (canary.py) and the packing self-check (packing.py)."""
