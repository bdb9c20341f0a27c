"""Models: loading from local Hugging Face directories, padding-free (packed) forwards, flash-attention, LoRA."""
