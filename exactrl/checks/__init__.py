"""Runtime verification that runs inside every training command (see DESIGN.md, "Verification
built in"): the packing self-check here; the canary lives with the audit (exactrl/audit/canary.py)."""
