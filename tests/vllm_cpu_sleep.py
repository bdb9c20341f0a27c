"""The real vLLM engine process with sleep mode on the CPU, for tests/test_vllm_real.py: vLLM's CPU
platform refuses enable_sleep_mode (it has no allocator to release), so this backend says the platform
has it before the engine starts. The CPU worker's sleep and wake-up then do nothing to the memory, but
every call exactrl makes goes through vLLM's real API (LLM.sleep, LLM.wake_up, the worker extension's
state and its digest of what it woke with). Runs in .venv-vllm; imports only what the server does."""

from __future__ import annotations

from exactrl.rollout.vllm_server import VLLMBackend


class SleepOnCPU(VLLMBackend):
    def __init__(self, *args, **kwargs):
        from vllm.platforms import current_platform

        type(current_platform).is_sleep_mode_available = lambda self: True
        super().__init__(*args, **kwargs)
