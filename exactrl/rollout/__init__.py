"""Generators (generator.py: the interface; hf.py: the KV-cached decode loop over the trainer's
model) and rollout collection (collect.py)."""
