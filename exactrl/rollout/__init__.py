"""Generators (generator.py: the interface; hf.py: the KV-cached decode loop over the trainer's
model), rollout collection (collect.py) and the generation self-check on the decoders
(generation_check.py)."""
