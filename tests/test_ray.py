"""`exactrl rl` as Ray actor groups (ray.enabled) on a local CPU cluster, one per module (ray.init
costs ~3 s; every actor runs one thread). Placement cannot change the maths: sampling is keyed per
prompt and sample, the trainer ranks split each step by its plan, so the same seeded run ends with
the same weights as the plain one-process run, to 1e-5 (fp32, max abs difference), whatever the
placement (colocated, split), the trainer world size (1, 2) and the number of rollout engines (1,
2). PPO's critic and the reference run as groups of their own. A rollout engine that dies stops the
run at once, naming it, and the run's actors and bundles are released."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
from safetensors.torch import load_file

from exactrl.algorithms.rl import train_rl
from exactrl.config import ConfigError, RLConfig, load_config
from exactrl.distributed.ray_cluster import RoleDied
from exactrl.rollout.generator import WeightSyncError
from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin
from exactrl.workers.groups import RayRoles
from own_audit import assert_verdicts

SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)
TOL = 1e-5
CPUS = 8  # a scheduling count: the largest placement here (split, 2 ranks of 3 roles, 2 engines) takes 8 bundles
COMMON = ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=2", "algo.group_size=4",
          "train.max_steps=2", "train.log_every=1", "rollout.max_new_tokens=8", "model.dtype=fp32",
          # SGD: Adam's first step moves an element with a near-zero gradient by a whole lr in its sign, so a rounding
          # difference between summation orders (FSDP2 vs one process) could flip it
          "optim.name=sgd", "optim.lr=0.05",
          "reward.fn=reward_fixtures:varied"]
ALGOS = {"grpo": ["algo.name=grpo"],
         "ppo": ["algo.name=ppo", "algo.kl_coef=0.05", "critic.warmup_rollouts=0", "critic.optim.name=sgd",
                 "critic.optim.lr=0.05"]}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    """The module's cluster and built-in task cache."""
    root = tmp_path_factory.mktemp("ray")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXACTRL_CACHE", str(root / "cache"))
        ray.init(num_cpus=CPUS, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        try:
            yield root
        finally:
            ray.shutdown()


def layout(placement: str, ranks: int, engines: int) -> list[str]:
    backend = "fsdp2" if ranks > 1 else "single"
    return ["ray.enabled=true", f"ray.placement={placement}", f"ray.ranks={ranks}", f"ray.engines={engines}",
            f"distributed.backend={backend}"]


def run(tmp: Path, algo: str, *extra: str) -> dict:
    """One run (cached by its settings); its rollouts' statistics per step and its final weights (and critic's)."""
    out = tmp / "-".join([algo, *extra]).replace("=", "_")
    if not (out / "final").exists():
        train_rl(load_config(RLConfig, None, [*COMMON, *ALGOS[algo], *extra, f"output_dir={out}"]), spec=SPEC)
    keys = ("reward_mean", "reward_std", "response_length", "generated_tokens")
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
    weights = {f"policy.{k}": v for k, v in load_file(out / "final" / "model.safetensors").items()}
    if (out / "final-critic").exists():
        weights |= {f"critic.{k}": v for k, v in load_file(out / "final-critic" / "model.safetensors").items()}
    return {"rollouts": [{k: r.get(k) for k in keys} for r in rows], "weights": weights, "dir": out}


def max_diff(a: dict, b: dict) -> float:
    """Over the tensors both saved (FSDP2 writes a tied lm_head.weight that the single engine leaves out)."""
    common = a.keys() & b.keys()
    assert len(common) >= len(a) - 1 and len(common) >= len(b) - 1, (a.keys() ^ b.keys())
    return max((a[k].double() - b[k].double()).abs().max().item() for k in common)


def check(tmp: Path, algo: str, placement: str, ranks: int, engines: int) -> float:
    plain, placed = run(tmp, algo), run(tmp, algo, *layout(placement, ranks, engines))
    assert placed["rollouts"] == plain["rollouts"]  # the same responses, so the same rewards and lengths
    diff = max_diff(placed["weights"], plain["weights"])
    start = load_file(ensure_builtin(SPEC).model / "model.safetensors")
    moved = max((placed["weights"][f"policy.{k}"] - v).abs().max().item() for k, v in start.items())
    print(f"{algo} ray {placement} ranks={ranks} engines={engines} vs plain: max |weight difference| {diff:.3g} "
          f"(the policy moved {moved:.3g})")
    assert moved > 1e-4 and diff <= TOL
    manifest = json.loads((placed["dir"] / "manifest.json").read_text())
    assert manifest["ray"]["placement"] == placement and manifest["ray"]["engines"] == engines
    assert (manifest["ray"]["async_rollouts"], manifest["ray"]["max_staleness"]) == (False, 0)
    assert {f"generation/rl/engine{j}" for j in range(engines)} <= set(manifest["checks"])  # each engine self-checked
    assert_verdicts(placed["dir"], facts={"world_size": [ranks], "effective_k": [4 // ranks]})  # the Ray ranks'
    return diff


# Each placement once, both world sizes, one and two engines; PPO's critic and reference as groups of their own.
CI = [("grpo", "colocated", 2, 2), ("ppo", "split", 1, 1)]


@pytest.mark.parametrize("algo,placement,ranks,engines", CI, ids=["-".join(map(str, c)) for c in CI])
def test_a_ray_run_ends_with_the_plain_runs_weights(tmp, algo, placement, ranks, engines):
    check(tmp, algo, placement, ranks, engines)
    deadline = time.monotonic() + 30  # every actor and bundle of the runs released (Ray's view lags a little)
    while ray.available_resources().get("CPU") != CPUS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == CPUS


MATRIX = [(algo, placement, ranks, engines) for algo in ALGOS for placement in ("colocated", "split")
          for ranks in (1, 2) for engines in (1, 2)]


@pytest.mark.slow
def test_the_whole_placement_matrix(tmp):
    rows = [(*case, check(tmp, *case)) for case in MATRIX]
    print("\n| algorithm | placement | trainer ranks | engines | max weight diff vs plain |\n|---|---|---|---|---|")
    for algo, placement, ranks, engines, diff in rows:
        print(f"| {algo} | {placement} | {ranks} | {engines} | {diff:.2e} |")


@pytest.mark.filterwarnings("ignore:ray.async_rollouts=true without ray.enabled")
def test_asynchronous_rollouts_under_ray_are_the_schedule_run_in_sequence(tmp):
    """ray.async_rollouts: under Ray rollout n+1 is sampled by the engine actor while the trainer's rank trains on
    rollout n; in one process the same schedule runs in sequence. Same samples, same weights, to 1e-5."""
    lagged = ["ray.async_rollouts=true", "algo.rollout_correction=tis", "train.max_steps=3"]
    plain, placed = run(tmp, "grpo", *lagged), run(tmp, "grpo", *lagged, *layout("split", 1, 1))
    assert placed["rollouts"] == plain["rollouts"]
    diff = max_diff(placed["weights"], plain["weights"])
    rows = [json.loads(line) for line in (placed["dir"] / "metrics.jsonl").read_text().splitlines()]
    stale = [r["staleness"] for r in rows if "staleness" in r]
    print(f"async grpo ray split 1/1 vs in sequence: max |weight difference| {diff:.3g}; staleness {stale}; waited "
          f"{[round(r['rollout_wait_seconds'], 3) for r in rows if 'staleness' in r]} s for each rollout")
    assert stale == [0, 1, 1] and diff <= TOL
    fact = json.loads((placed["dir"] / "manifest.json").read_text())["ray"]
    assert (fact["async_rollouts"], fact["max_staleness"]) == (True, 1)


# PPO (its critic and reference groups resumed too) under `slow` (~75 s); GRPO in CI
@pytest.mark.parametrize("algo", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)])
def test_a_ray_run_resumes_from_its_checkpoint_to_the_uninterrupted_weights(tmp, algo):
    """Two FSDP2 ranks (SGD: an optimizer without state tensors): resumed from the checkpoint after step 1, the
    run ends at the uninterrupted Ray run's weights (policy and critic), and both at the plain run's, to 1e-5."""
    def config(out, *extra):
        return load_config(RLConfig, None, [*COMMON, *ALGOS[algo], *layout("colocated", 2, 1), "train.save_every=1",
                                             *extra, f"output_dir={out}"])

    full, resumed = tmp / f"resume-full-{algo}", tmp / f"resume-resumed-{algo}"
    train_rl(config(full), spec=SPEC)
    train_rl(config(resumed, f"train.resume_from={full / 'checkpoint-1'}"), spec=SPEC)
    rows = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in rows] == [2]  # only the step after the checkpoint ran again
    a, b = ({f"{role}.{k}": v for role, d in (("policy", "final"), ("critic", "final-critic"))
             if (out / d).exists() for k, v in load_file(out / d / "model.safetensors").items()}
            for out in (full, resumed))
    diff, plain = max_diff(a, b), max_diff(b, run(tmp, algo)["weights"])
    print(f"{algo} ray colocated 2 ranks: resumed vs uninterrupted {diff:.3g}, vs the plain run {plain:.3g}")
    assert diff <= TOL and plain <= TOL


def test_an_engine_that_dies_mid_rollout_stops_the_run_naming_it(tmp, monkeypatch):
    """Engine 1 of 2 exits in the middle of the first rollout (its generate ends the process): the run
    stops with RoleDied naming it within seconds, and releases every actor and bundle."""
    made = RayRoles.generator

    def with_a_dying_engine(self, policy, tokenizer):
        group = made(self, policy, tokenizer)
        group.wait()

        def install(actor):  # runs in the engine's process: pickled by value with what it needs
            import os as os_

            class Dying:
                def __init__(self, engine):
                    self.engine = engine

                def __getattr__(self, name):
                    return getattr(self.engine, name)

                def generate(self, *args, **kwargs):
                    os_._exit(1)

            actor.held["engine"] = Dying(actor.held["engine"])

        ray.get(group.actors[1].__ray_call__.remote(install))
        return group

    monkeypatch.setattr(RayRoles, "generator", with_a_dying_engine)
    t0 = time.perf_counter()
    with pytest.raises(RoleDied, match=r"rollout engine 1 of 2 died during a rollout") as died:
        run(tmp, "grpo", *layout("colocated", 1, 2), "train.seed=7")
    print(f"{died.value} ({time.perf_counter() - t0:.1f}s after the run started)")
    deadline = time.monotonic() + 30  # ray.kill and the bundles' release are asynchronous
    while ray.available_resources().get("CPU") != CPUS and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU") == CPUS


def stand_in_engines(monkeypatch, **faults) -> None:
    """rollout.engine=vllm under Ray with the stand-in engine process (tests/fake_engine.py: exactrl's decode loop
    behind vLLM's protocol, so it samples what the plain run samples), installed in each engine actor before it
    builds its engine; ``faults``: EXACTRL_FAKE_ENGINE of engine j, by "e{j}"."""
    start, tests = RayRoles._start, str(Path(__file__).parent)

    def use_stand_in(actor, index: int, fault: dict) -> None:  # runs in the engine's actor: pickled by value
        import exactrl.workers.groups as groups
        from exactrl.rollout.vllm_generator import VLLMGenerator

        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": tests, "EXACTRL_FAKE_ENGINE": json.dumps(fault)}
        groups.vllm_generator = lambda cfg, path, tok, run_dir, i: VLLMGenerator(
            path, tok, backend="fake_engine:HFBackend", index=i, start_timeout=120, request_timeout=120,
            sync_timeout=cfg.rollout.vllm.sync_timeout, log_dir=run_dir, env=env)

    def starting(self, what, count, size=1):
        actors = start(self, what, count, size)
        if what == "rollout engines":
            ray.get([a.__ray_call__.remote(use_stand_in, j, faults.get(f"e{j}", {})) for j, a in enumerate(actors)])
        return actors

    monkeypatch.setattr(RayRoles, "_start", starting)


def test_vllm_engines_take_the_weights_over_one_channel_from_the_policys_rank_0(tmp, monkeypatch):
    """rollout.engine=vllm under Ray: the policy's rank 0 broadcasts each sync once, over one weight channel, to every
    engine's workers (members 1 and 2 of 3 here), each engine verifying what it loaded; the run ends where the plain
    run ends (the stand-in engines sample what the decode loop samples)."""
    stand_in_engines(monkeypatch)
    plain, placed = run(tmp, "grpo"), run(tmp, "grpo", *layout("split", 1, 2), "rollout.engine=vllm")
    assert placed["rollouts"] == plain["rollouts"]
    diff = max_diff(placed["weights"], plain["weights"])
    rows = [json.loads(line) for line in (placed["dir"] / "metrics.jsonl").read_text().splitlines()]
    print(f"grpo ray split, 1 rank, 2 stand-in vLLM engines on one channel vs plain: max |weight diff| {diff:.3g}; "
          f"probe errors {[r['sync_probe_error'] for r in rows if 'sync_probe_error' in r]}")
    assert diff <= TOL and [r["weights_version"] for r in rows if "weights_version" in r] == [1, 2]
    logs = {j: next(placed["dir"].rglob(f"vllm-engine-{j}-*.log")).read_text() for j in range(2)}
    assert [logs[j].count(f"weight channel: member {j + 1} of 3 (gloo)") for j in range(2)] == [1, 1]


@pytest.mark.parametrize("fault,seen", [
    ("hang_on_load", r"did not answer within 5 s \(rollout.vllm.sync_timeout\)"),
    pytest.param("die_in_load", r"died \(exit code 3\) during the weight sync to version 1", marks=pytest.mark.slow)],
    ids=["hangs", "dies"])
def test_an_engine_that_fails_a_sync_is_named_and_nothing_hangs(tmp, monkeypatch, fault, seen):
    """Engine 1 of 2 never takes the first sync, or dies on its first bucket (rollout.vllm.sync_timeout=5): the
    broadcast breaks off, each engine's own end of the sync is waited for (bounded by the same timeout) and the error
    names what each one saw."""
    stand_in_engines(monkeypatch, e1={fault: True})
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match=r"the weight push to the 2 Ray rollout engines broke off .*"
                                              rf"rollout engine 1 of 2: vllm engine 1 \(pid \d+\) {seen}") as failed:
        run(tmp, "grpo", *layout("split", 1, 2), "rollout.engine=vllm", "rollout.vllm.sync_timeout=5",
            f"train.seed={len(fault)}")  # a run directory of its own
    print(f"{failed.value} ({time.perf_counter() - t0:.1f}s after the run started)")


def test_the_weight_channel_is_nccl_only_where_every_member_has_a_gpu_of_its_own():
    """rollout.vllm.weight_channel: auto is NCCL under split placement on GPUs, gloo otherwise (NCCL refuses two
    members on one GPU, as when the engine shares the trainer's); nccl is refused where it cannot run."""
    def resolved(gpu: bool, *overrides: str) -> str:
        cfg = load_config(RLConfig, None, ["ray.enabled=true", "rollout.engine=vllm", *overrides])
        return RayRoles.channel_backend(SimpleNamespace(cfg=cfg, gpu=gpu))

    assert [resolved(gpu, f"ray.placement={p}") for gpu in (False, True) for p in ("split", "colocated")] == [
        "gloo", "gloo", "nccl", "gloo"]
    assert resolved(True, "ray.placement=split", "rollout.vllm.weight_channel=gloo") == "gloo"
    with pytest.raises(ConfigError, match="rollout.vllm.weight_channel=nccl: NCCL moves tensors between GPUs and this "
                                          "run's actors have none"):
        resolved(False, "ray.placement=split", "rollout.vllm.weight_channel=nccl")
    for overrides in (["ray.enabled=false"], ["ray.placement=colocated"]):
        with pytest.raises(ConfigError, match="rollout.vllm.weight_channel=nccl: NCCL refuses two members of a group "
                                              "on one GPU"):
            load_config(RLConfig, None, ["ray.enabled=true", "rollout.engine=vllm", "rollout.vllm.weight_channel=nccl",
                                         *overrides])


def test_what_a_ray_run_cannot_honour_is_refused():
    with pytest.raises(ConfigError, match="Ray starts the trainer ranks itself; set ray.ranks"):
        load_config(RLConfig, None, ["ray.enabled=true", "distributed.nproc_per_node=2",
                                     "distributed.backend=fsdp2"])
    with pytest.raises(ConfigError, match="has no tensor parallelism"):
        load_config(RLConfig, None, ["ray.enabled=true", "ray.engine_tp=2"])
    tp = load_config(RLConfig, None, ["ray.enabled=true", "ray.engine_tp=2", "rollout.engine=vllm"]).ray.engine_tp
    assert tp == 2  # a vLLM engine of two tensor-parallel workers (on CPU bundles)
    with pytest.raises(ConfigError, match="ray.max_staleness=2 has no effect: rollouts are synchronous"):
        load_config(RLConfig, None, ["ray.enabled=true", "ray.max_staleness=2"])
    with pytest.raises(ConfigError, match=r"ray.engines=2 has no effect: Ray is off"):
        load_config(RLConfig, None, ["ray.engines=2"])
    with pytest.raises(ConfigError, match="2 processes need a distributed backend"):
        load_config(RLConfig, None, ["ray.enabled=true", "ray.ranks=2"])
