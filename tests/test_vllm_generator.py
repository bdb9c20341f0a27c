"""The vLLM generator's client, engine process, weight channel and verified sync, with a stand-in
engine that runs the Hugging Face model in a process of its own (tests/fake_engine.py): what it
samples equals the in-process generator's, every sync is digested and probed through the process
boundary, and each injected fault is detected with an error naming the engine, within its
timeout. The real vLLM engine: tests/test_vllm_real.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from exactrl.algorithms import rl
from exactrl.checks.weight_sync import WeightSyncError, digest_of
from exactrl.config import RLConfig, SFTConfig, load_config
from exactrl.distributed.engine import build_engine
from exactrl.losses.token_losses import kept_logprobs
from exactrl.rollout import weight_channel
from exactrl.rollout.generator import GeneratorError, SamplingParams
from exactrl.rollout.hf import HFEngine
from exactrl.rollout.vllm_generator import VLLMGenerator, rank_gpu
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin
from exactrl.tasks.tiny_model import build_tiny_model, save_tiny_model
from exactrl.tasks.tokenizer import save_tokenizer
from exactrl.workers import placement
from exactrl.workers.worker import Worker

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64)
FAKE = "fake_engine:HFBackend"
TESTS = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-model")
    tok = save_tokenizer(path)
    save_tiny_model(path, tok, seed=11, **SMALL)  # the engine's base weights: not the trainer's
    return path, tok


def trainer(tok, seed=3) -> Worker:
    m = build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=seed, **SMALL)
    engine = build_engine(m, load_config(SFTConfig, None, []), total_steps=1)
    return Worker("policy", m, engine, pad_id=tok.pad_token_id)


def fake(model_dir, tmp_path, sync_timeout: float = 30, **faults) -> VLLMGenerator:
    """The client over the stand-in engine; ``faults``: its test-only faults (tests/fake_engine.py)."""
    path, tok = model_dir
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "EXACTRL_FAKE_ENGINE": json.dumps(faults)}
    return VLLMGenerator(str(path), tok, backend=FAKE, start_timeout=120, sync_timeout=sync_timeout,
                         request_timeout=60, log_dir=tmp_path, env=env)


@pytest.fixture(scope="module")
def shared(model_dir, tmp_path_factory):
    """One stand-in engine for the tests that leave it serving (each start costs seconds)."""
    gen = fake(model_dir, tmp_path_factory.mktemp("shared-engine"))
    yield gen
    gen.close()


def test_the_engine_samples_what_the_in_process_generator_samples_after_a_verified_sync(model_dir, shared):
    _, tok = model_dir
    policy, gen = trainer(tok), shared
    gen._request("rpc", "reload_weights")  # before any sync: allowed, the engine holds its base weights
    gen.bucket_bytes = 1000  # several buckets, one tensor larger than a bucket alone in its own
    report = policy.push_weights(gen)
    assert report.version == 1 and report.digest == digest_of(policy.export_weights()).value
    assert report.probe_error < 1e-5  # the same model code in fp32 on both sides
    prompts = [tok(t)["input_ids"] for t in ("12+3=", "7+40=", "5+5=")]
    params = SamplingParams(n=3, temperature=0.7, top_k=20, max_new_tokens=8, stop=("1",))
    seeds = [101, 202, 303]
    got = gen.generate(prompts, params, seeds)
    want = HFEngine(policy.model, tok, batch_size=4).generate(prompts, params, seeds)
    assert [(g.prompt_index, g.response_ids, g.text, g.finished) for g in got] == [
        (g.prompt_index, g.response_ids, g.text, g.finished) for g in want]
    # log-probs over the top-k kept set, as vLLM reports them: the trainer's replay of the set gives the same; the
    # decode loop's over the vocabulary are lower by the mass top-k cut
    for g, w in zip(got, want):
        ids = torch.tensor([prompts[g.prompt_index] + list(g.response_ids)])
        with torch.no_grad():
            replay = kept_logprobs(policy.model(input_ids=ids).logits.float(), ids, 0.7, 1.0, 20)
        torch.testing.assert_close(torch.tensor(g.logprobs), replay[0, len(prompts[g.prompt_index]) - 1 :], rtol=0,
                                   atol=1e-5)
        assert all(k >= v - 1e-6 for k, v in zip(g.logprobs, w.logprobs))
    assert {(g.weights_version, g.weights_digest) for g in got} == {(1, report.digest)}
    assert policy.push_weights(gen).version == 2  # the channel stays open between syncs


def test_a_parameter_skipped_on_the_way_is_named(model_dir, shared, monkeypatch):
    tok, gen = model_dir[1], shared
    send = weight_channel.send
    monkeypatch.setattr(weight_channel, "send", lambda group, named, *a: send(
        group, ((n, t) for n, t in named if n != "model.layers.0.mlp.up_proj.weight"), *a))
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"weight sync to vllm engine 0 \(pid \d+\), version \d+: the weights "
                                              r"it holds are not those the trainer sent: 'model.layers.0.mlp."
                                              r"up_proj.weight' has other bytes loaded than sent"):
        trainer(tok, seed=5).push_weights(gen)
    assert time.monotonic() - t0 < 10


def test_a_base_reload_after_a_sync_is_refused_in_the_engine(model_dir, shared):
    tok, gen = model_dir[1], shared
    trainer(tok).push_weights(gen)
    with pytest.raises(WeightSyncError, match=r"vllm engine 0 .*reload_weights from disk would load the base weights "
                                              r"over the synced weights of version \d+ .*TRL issue #5312"):
        gen._request("rpc", "reload_weights")
    assert gen.generate([[5, 6, 7]], SamplingParams(greedy=True, max_new_tokens=3))  # still synced, still serving


def test_an_engine_back_on_its_base_weights_is_refused_at_the_next_generate(model_dir, shared):
    tok, gen = model_dir[1], shared
    version = trainer(tok).push_weights(gen).version
    gen._request("rpc", "restart")  # now base(0) in the engine, synced(version) in the client
    with pytest.raises(WeightSyncError, match=rf"vllm engine 0 \(pid \d+\) holds weights base\(0, digest None\) "
                                              rf"but was synced to synced\({version}, digest [0-9a-f]{{12}}\)"):
        gen.generate([[5, 6, 7]], SamplingParams(greedy=True, max_new_tokens=3))


def test_an_engine_that_dies_mid_rollout_is_named_at_once(model_dir, tmp_path):
    tok = model_dir[1]
    gen = fake(model_dir, tmp_path, generate_seconds=30)
    try:
        trainer(tok).push_weights(gen)
        threading.Timer(1.0, os.kill, (gen.proc.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(GeneratorError, match=r"vllm engine 0 \(pid \d+\) died \(exit code -9\) during generate"):
            gen.generate([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4))
        assert time.monotonic() - t0 < 5
    finally:
        gen.close()


def test_a_sync_that_never_completes_times_out_naming_the_engine(model_dir, tmp_path):
    tok = model_dir[1]
    gen = fake(model_dir, tmp_path, sync_timeout=5, hang_on_load=True)
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=r"vllm engine 0 \(pid \d+\) did not (take the weights|answer) "
                                                  r"within 5 s \(rollout.vllm.sync_timeout"):
            trainer(tok).push_weights(gen)
        assert time.monotonic() - t0 < 5 + 10
    finally:
        gen.close()


def test_a_run_through_the_engine_ends_where_the_in_process_run_ends(tmp_path, monkeypatch):
    """`exactrl rl` with rollout.engine=vllm (the stand-in engine: the same decode loop and keyed draws
    in a process of its own) samples the same rollouts as rollout.engine=hf, so it ends with the same
    weights; each rollout's record carries the version and digest of the weights that sampled it, the
    first one the starting model's file."""
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # sleeping between rollouts (vLLM's sleep mode, level 1): each push wakes the engine first
    monkeypatch.setattr(placement, "vllm_generator", lambda cfg, path, tok, run_dir, index: VLLMGenerator(
        path, tok, backend=FAKE, start_timeout=120, sync_timeout=30, request_timeout=120, log_dir=run_dir, env=env,
        sleep_level=1))
    spec, runs = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10), {}
    for engine in ("hf", "vllm"):
        cfg = load_config(RLConfig, None, ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4",
                                           "algo.group_size=4", "train.max_steps=2", "train.log_every=1",
                                           "rollout.max_new_tokens=8", "optim.lr=1e-2", f"rollout.engine={engine}",
                                           "reward.fn=reward_fixtures:varied", f"output_dir={tmp_path / engine}"])
        result = rl.train_rl(cfg, spec=spec)
        runs[engine] = ([json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
                         if '"loss"' in line], load_file(result.final_model / "model.safetensors"))
    start = load_file(ensure_builtin(spec).model / "model.safetensors")
    for rows, _ in runs.values():
        assert [r["weights_version"] for r in rows] == [1, 2] and all(r["sync_probe_error"] < 1e-5 for r in rows)
        assert rows[0]["weights_digest"] == digest_of(start.items()).value != rows[1]["weights_digest"]
    assert [r["weights_digest"] for r in runs["hf"][0]] == [r["weights_digest"] for r in runs["vllm"][0]]
    hf, vllm = runs["hf"][1], runs["vllm"][1]
    assert max((hf[k] - vllm[k]).abs().max().item() for k in hf) < 1e-6 and any(not start[k].equal(hf[k]) for k in hf)
    log = next((tmp_path / "vllm").rglob("vllm-engine-0-*.log")).read_text().split()
    assert log.count("sleep(1)") == 2 and log.count("woke") == 1  # after each rollout; woken by the second push
    # what each sleep freed, as the engine measures it (on a GPU, its device's free memory; the stand-in: its weights)
    weights = sum(t.numel() * t.element_size() for t in start.values()) / 2**30
    assert [r["engine_sleep_freed_gb"] for r in runs["vllm"][0]] == [weights] * 2
    assert all("engine_sleep_freed_gb" not in r for r in runs["hf"][0])


def sleeping(model_dir, tmp_path, level: int, **faults) -> VLLMGenerator:
    path, tok = model_dir
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "EXACTRL_FAKE_ENGINE": json.dumps(faults)}
    return VLLMGenerator(str(path), tok, backend=FAKE, start_timeout=120, sync_timeout=30, request_timeout=60,
                         log_dir=tmp_path, env=env, sleep_level=level)


GREEDY = SamplingParams(greedy=True, max_new_tokens=6)


def test_sleep_keeps_the_synced_weights_and_a_wake_up_with_others_stops_the_rollout(model_dir, tmp_path):
    """Level 1: the weights wait in host memory while the engine sleeps and generation after it is what it
    was; an engine that wakes with its base weights (TRL issue #5312) is caught by its digest of what it
    woke with, before it samples, and serves nothing until the next sync."""
    tok, prompts = model_dir[1], [[5, 6, 7], [8, 9]]
    policy = trainer(tok)
    for fault in (False, True):
        gen = sleeping(model_dir, tmp_path, 1, wake_with_base=fault)
        try:
            report = policy.push_weights(gen)
            before = gen.generate(prompts, GREEDY)
            gen.sleep()
            assert gen._request("state")[3] == 1 and gen.weights_state.asleep == 1
            if not fault:
                after = gen.generate(prompts, GREEDY)
                assert [g.response_ids for g in after] == [g.response_ids for g in before]
                assert {(g.weights_version, g.weights_digest) for g in after} == {(1, report.digest)}
                gen.sleep()
                assert policy.push_weights(gen).version == 2  # the push wakes it
                continue
            with pytest.raises(WeightSyncError, match=r"vllm engine 0 \(pid \d+\): wake_up failed in the engine: .*"
                                                      r"after waking from sleep it holds other weights than the synced "
                                                      r"weights of version 1 it went to sleep with .*TRL issue #5312"):
                gen.generate(prompts, GREEDY)
            with pytest.raises(WeightSyncError, match=r"a rollout with its weights released"):
                gen.generate(prompts, GREEDY)
            assert policy.push_weights(gen).version == 2 and gen.generate(prompts, GREEDY)
        finally:
            gen.close()


def test_a_level_2_sleep_drops_the_weights_until_the_next_verified_sync(model_dir, tmp_path):
    tok = model_dir[1]
    policy, gen = trainer(tok), sleeping(model_dir, tmp_path, 2)
    try:
        policy.push_weights(gen)
        want = gen.generate([[5, 6, 7]], GREEDY)
        gen.sleep()
        with pytest.raises(WeightSyncError, match=r"vllm engine 0 \(pid \d+\): a rollout with its weights released "
                                                  r"\(dropped\(sleep\(level=2\)\), sleep\(2\), wake\); sync the "
                                                  r"weights first"):
            gen.generate([[5, 6, 7]], GREEDY)
        report = policy.push_weights(gen)  # wakes it, then the usual digest and probe
        assert report.version == 2 and report.probe_error < 1e-5
        assert [g.response_ids for g in gen.generate([[5, 6, 7]], GREEDY)] == [g.response_ids for g in want]
    finally:
        gen.close()


def test_sleep_level_auto_and_its_refusals(monkeypatch):
    from exactrl.rollout.vllm_generator import sleep_level

    def cfg(*overrides):
        return load_config(RLConfig, None, ["rollout.engine=vllm", *overrides])

    for cuda, extra, want in [(True, [], 1), (False, [], 0),
                              (True, ["ray.enabled=true", "ray.placement=split"], 0),
                              (True, ["ray.enabled=true", "ray.placement=colocated"], 1),
                              (True, ["ray.enabled=true", "ray.async_rollouts=true", "algo.rollout_correction=tis"], 0),
                              (True, ["rollout.vllm.sleep_level=2"], 2), (True, ["rollout.vllm.sleep_level=0"], 0)]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert sleep_level(cfg(*extra)) == want, (cuda, extra)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"rollout.vllm.sleep_level=1: vLLM's sleep mode needs a GPU"):
        sleep_level(cfg("rollout.vllm.sleep_level=1"))
    with pytest.raises(Exception, match=r"rollout.vllm.sleep_level=1 with ray.async_rollouts=true"):
        cfg("rollout.vllm.sleep_level=1", "ray.async_rollouts=true", "algo.rollout_correction=tis")



def test_a_plain_runs_engine_takes_its_ranks_gpu(monkeypatch):
    """vLLM starts on the first GPU it sees: each rank's engine is shown only its rank's GPU (else every rank's
    engine would share GPU 0), counted within CUDA_VISIBLE_DEVICES when that is set."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [rank_gpu(torch.device("cuda", i)) for i in (0, 3)] == [{"CUDA_VISIBLE_DEVICES": "0"},
                                                                   {"CUDA_VISIBLE_DEVICES": "3"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert rank_gpu(torch.device("cuda", 1)) == {"CUDA_VISIBLE_DEVICES": "6"}
    assert rank_gpu(torch.device("cpu")) == {}
