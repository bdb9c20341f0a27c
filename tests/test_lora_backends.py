"""LoRA on FSDP2 and DeepSpeed (ZeRO-2, ZeRO-2 + CPU-offloaded optimizer, ZeRO-3; gloo, CPU) at
world size 1 and 2 (tests/dist/lora_equivalence.py): the adapters' update equals the one-pass
full-batch reference through the same adapters (SFT with SGD and AdamW; the RL policy losses),
the base weights never move, a checkpoint holds only the adapters, and the canary stops a lost
micro-batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from distributed_harness import layout_params, layout_results, over_bound
from old_deepspeed import ds_env

pytest.importorskip("peft")
SCRIPT = Path(__file__).parent / "dist" / "lora_equivalence.py"
MODES = {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}


# DeepSpeed at world size 1 under `slow` (~30 s): tests/test_deepspeed.py holds every stage at world size 1 to the
# full-batch update in CI, and this engine's world size 2 runs here
@pytest.fixture(scope="module", params=layout_params(slow=("deepspeed-world1",)))
def results(request, tmp_path_factory):
    return layout_results(request, tmp_path_factory, SCRIPT, "lora")


def test_adapter_update_matches_the_full_batch_reference_and_the_base_stays(results):
    backend, world, r = results
    assert {c["mode"] for c in r["cases"]} == (MODES if backend == "fsdp2" else {"token-mean"})
    assert {c["K"] for c in r["cases"]} == ({1, 2, 4, 8} if world == 1 else {1, 2, 4})
    assert len({c["config"] for c in r["cases"]}) == (1 if backend == "fsdp2" else 3)
    bad = over_bound(r["cases"]) + [c for c in r["cases"] if c["base_moved"]]
    assert not bad, bad


def test_policy_losses_on_adapters_match_the_one_pass_reference(results):
    """PPO's clipped ratio (with clip-higher, k3 KL and entropy), GSPO and REINFORCE, as tests/test_rl_backends.py
    checks them, on the LoRA model."""
    _, _, r = results
    assert {c["loss"] for c in r["rl"]} == {"ppo", "gspo", "reinforce"}
    bad = over_bound(r["rl"]) + [c for c in r["rl"] if c["base_moved"]]
    assert not bad, bad


def test_checkpoint_holds_only_the_adapters(results):
    _, _, r = results
    for c in r["checkpoints"]:
        assert c["keys"] == c["trainable"] and c["trainable"] and all("lora_" in k for k in c["trainable"]), c["config"]


def test_canary_stops_a_lost_micro_batch(results):
    backend, world, r = results
    for fault in r["faults"]:
        assert "canary failed at optimizer step 0" in fault and f"world size {world}" in fault, fault
        assert f"backend={backend}" in fault, fault


@pytest.mark.slow  # two torchrun runs: about a minute each layout on two cores
@pytest.mark.parametrize("layout", [["distributed.backend=fsdp2"], ["distributed.backend=deepspeed",
                                                                    "deepspeed.zero_stage=2",
                                                                     "deepspeed.offload_optimizer=cpu"]], ids=[
                                                                         "fsdp2", "zero2-offload"])
def test_lora_sft_on_two_ranks_resumes_to_the_same_adapter(tmp_path, layout):
    """Through the command line: stop after step 2 of 4, resume, reach the uninterrupted run's
    adapter bit for bit (AdamW with weight decay and warm-up: moments, schedule, data position
    and both ranks' RNG come back); the resumed run's final/merged/ is built from gathered shards."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    root = Path(__file__).resolve().parents[1]
    if "deepspeed" in layout[0]:
        pytest.importorskip("deepspeed")
    env = {**os.environ, "EXACTRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           **(ds_env() if len(layout) > 1 else {})}
    common = ["--config", "examples/sft_tiny.yaml", "data.eval=null", "train.max_steps=4", "train.global_batch_size=16",
              "train.micro_batch_size=4", "optim.warmup_steps=2", "optim.weight_decay=0.1", "optim.lr=1e-2",
              *layout, "distributed.nproc_per_node=2", "model.lora.rank=4"]

    def sft(*overrides):
        proc = subprocess.run([sys.executable, "-m", "exactrl.cli", "sft", *common, *overrides], cwd=root, env=env,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    full, resumed = tmp_path / "full", tmp_path / "resumed"
    sft("train.save_every=2", f"output_dir={full}")
    sft(f"train.resume_from={full / 'checkpoint-2'}", "model.lora.merge_on_save=true", f"output_dir={resumed}")
    adapter = lambda d: load_file(d / "adapter_model.safetensors")  # noqa: E731
    a, b, mid = adapter(full / "final"), adapter(resumed / "final"), adapter(full / "checkpoint-2")
    assert a.keys() == b.keys() == mid.keys() and all(a[k].equal(b[k]) for k in a)
    assert not all(a[k].equal(mid[k]) for k in a)
    assert (resumed / "final" / "merged" / "model.safetensors").is_file()
    # The checkpoint (DeepSpeed's own files included) holds the adapters and their optimizer state, not the frozen base.
    base = next((tmp_path / "cache").rglob("model-init/model.safetensors")).stat().st_size
    assert sum(f.stat().st_size for f in (full / "checkpoint-2").rglob("*") if f.is_file()) < base / 2
