"""A trained reward model as `exactrl rl`'s reward (reward.model=DIR, exactrl/workers/reward_model.py).

* the reward a rollout's sample gets is reward.model_weight x (score - mean) / std, with the score recomputed here
  by Hugging Face's own model class on the sample's exact ids, read at its last token, and mean/std read from
  the directory's reward_stats.json (1e-6), for GRPO's rollout and DAPO's dynamic sampling;
* two ranks (gloo) give every sample the same reward as one process;
* refused before anything loads: a reward model with another tokenizer, missing statistics, a directory that
  is not a reward model, a process reward model normalised; reward.model_weight without reward.model;
* the reward server serves a reward model over text (re-tokenised with its tokenizer);
* a short GRPO run trained on the reward model alone (reward.weights=[0]) raises reward/model;
* under Ray (ray.enabled) the reward model is an actor group of its own: the config is accepted, and (slow) split
  and colocated (two ranks scoring their shares) runs log the in-process run's reward/model and end at its weights.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForTokenClassification

from exactrl.config import RLConfig, load_config
from exactrl.config.loader import ConfigError
from exactrl.models.loading import load_value_model
from exactrl.tasks.builtin import BuiltinSpec
from exactrl.tasks.tiny_model import build_tiny_model
from exactrl.workers.reward_model import STATS_FILE, model_reward

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist" / "rl_reward_model.py"
MEAN, STD, WEIGHT = 0.25, 1.7, 0.7  # the fixture's saved statistics, far from (0, 1), and the reward's weight
SPEC = BuiltinSpec(n_sft=20, n_rl=40, n_eval=10)

# the two paths a reward is scored on: a plain rollout, and DAPO's dynamic sampling (rewards inside its refills)
ALGOS = ("grpo", "dapo")


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, tokenizer):
    """A reward model as `exactrl rm` saves one: a *ForTokenClassification model (a tiny Llama with the built-in
    tokenizer, its head scaled so scores spread over O(1)), the tokenizer, and reward_stats.json."""
    d = tmp_path_factory.mktemp("rm")
    build_tiny_model(len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
                     seed=5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     intermediate_size=64).save_pretrained(str(d / "lm"))
    model = load_value_model(d / "lm", init_seed=11)
    with torch.no_grad():
        model.score.weight.mul_(40.0)
        model.score.bias.fill_(0.3)
    model.save_pretrained(str(d / "final"))
    tokenizer.save_pretrained(str(d / "final"))
    (d / "final" / STATS_FILE).write_text(json.dumps({"train": {"mean": MEAN, "std": STD, "n": 10}}))
    return d / "final"


def independent_scores(rm_dir: Path, ids: list[list[int]]) -> list[float]:
    """Hugging Face's model class on each sequence alone, the head at its last token, normalised as saved."""
    stats = json.loads((rm_dir / STATS_FILE).read_text())["train"]
    model = AutoModelForTokenClassification.from_pretrained(str(rm_dir)).eval()
    with torch.no_grad():
        raw = [model(input_ids=torch.tensor([row])).logits[0, -1, 0].item() for row in ids]
    return [(r - stats["mean"]) / stats["std"] for r in raw]


def run_script(rm_dir: Path, out: Path, world: int, *overrides: str) -> dict:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] if world > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.run([sys.executable, *launcher, str(SCRIPT), str(rm_dir), str(out), *overrides],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def one_and_two_ranks(rm_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollouts")
    overrides = ("reward.weights=[0]", f"reward.model_weight={WEIGHT}")
    return [run_script(rm_dir, tmp / f"w{world}.json", world, *overrides) for world in (1, 2)]


@pytest.mark.parametrize("algo", ALGOS)
def test_the_reward_is_the_reward_model_s_score_recomputed_and_normalised_as_saved(rm_dir, one_and_two_ranks, algo):
    got = one_and_two_ranks[0][algo]
    expected = independent_scores(rm_dir, got["ids"])
    assert len(expected) == 24 and max(expected) - min(expected) > 0.5  # the scores differ: a wrong one would show
    assert [p["model"] for p in got["parts"]] == pytest.approx(expected, abs=1e-6)
    # reward.weights=[0]: the checker is computed and logged but adds nothing
    assert all("exactrl.tasks.arithmetic:reward" in p for p in got["parts"])
    assert got["rewards"] == pytest.approx([WEIGHT * e for e in expected], abs=1e-6)
    assert got["stats"]["reward/model"] == pytest.approx(sum(expected) / len(expected), abs=1e-6)


@pytest.mark.parametrize("algo", ALGOS)
def test_two_ranks_give_every_sample_the_reward_one_process_gives(one_and_two_ranks, algo):
    one, two = (r[algo] for r in one_and_two_ranks)
    assert two["ids"] == one["ids"]
    assert two["rewards"] == pytest.approx(one["rewards"], abs=1e-6)


def test_a_reward_model_with_another_tokenizer_is_refused(rm_dir, tokenizer, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(rm_dir, other)
    changed = type(tokenizer).from_pretrained(str(rm_dir))
    changed.add_tokens(["<tool>"])
    changed.save_pretrained(str(other))
    cfg = load_config(RLConfig, None, [f"reward.model={other}"])
    with pytest.raises(ConfigError, match=f"reward.model={other}: its tokenizer differs from the policy's"):
        model_reward(cfg.reward, tokenizer, 4)
    same = load_config(RLConfig, None, [f"reward.model={rm_dir}"])
    assert model_reward(same.reward, tokenizer, 4).mean == MEAN


def test_missing_statistics_are_refused_naming_the_file_unless_not_normalising(rm_dir, tokenizer, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(rm_dir, bare)
    (bare / STATS_FILE).unlink()
    cfg = load_config(RLConfig, None, [f"reward.model={bare}"])
    with pytest.raises(ConfigError, match=f"{bare / STATS_FILE} does not exist"):
        model_reward(cfg.reward, tokenizer, 4)
    raw = model_reward(load_config(RLConfig, None, [f"reward.model={bare}", "reward.model_normalize=false"]).reward,
                       tokenizer, 4)
    assert (raw.mean, raw.std) == (0.0, 1.0)


def test_a_directory_that_is_not_a_reward_model_is_refused(rm_dir, tokenizer, tmp_path):
    lm = rm_dir.parent / "lm"  # the causal LM the fixture started from: a reward model's head would be random
    with pytest.raises(ConfigError, match="not a reward model"):
        model_reward(load_config(RLConfig, None, [f"reward.model={lm}"]).reward, tokenizer, 4)
    prm = tmp_path / "prm"  # a process reward model's reward is a probability: not normalised by its logits' stats
    shutil.copytree(rm_dir, prm)  # (tests/test_rl_prm_reward.py: a PRM as reward.model)
    (prm / STATS_FILE).write_text(json.dumps({"kind": "process", "train": {"mean": 0.0, "std": 1.0}}))
    with pytest.raises(ConfigError, match=f"reward.model_normalize=true, but reward.model={prm} is a process reward"):
        model_reward(load_config(RLConfig, None, [f"reward.model={prm}"]).reward, tokenizer, 4)


def test_reward_model_keys_without_a_reward_model_are_refused():
    with pytest.raises(ConfigError, match="reward.model_weight"):
        load_config(RLConfig, None, ["reward.model_weight=2"])


def test_the_reward_server_serves_a_reward_model_over_text(rm_dir, tokenizer):
    from exactrl.rewards.server import make_server

    server = make_server(None, port=0, model=str(rm_dir))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prompts, completions = ["3+4=", "12+30=", "1+1="], ["7", "#### 42", "x"]
        body = json.dumps({"prompts": prompts, "completions": completions}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{server.server_port}/", body,
                                         {"Content-Type": "application/json"})
        got = json.loads(urllib.request.urlopen(request, timeout=60).read())["rewards"]
    finally:
        server.shutdown()
        server.server_close()
    # the text re-tokenised as `exactrl rm` encodes a text pair: the prompt, the completion, then EOS
    ids = [tokenizer(p)["input_ids"] + tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
           for p, c in zip(prompts, completions)]
    assert got == pytest.approx(independent_scores(rm_dir, ids), abs=1e-6)


def grpo_on_the_reward_model(rm_dir: Path, tmp_path: Path, monkeypatch, steps: int) -> list[dict]:
    """A GRPO run from the built-in task's untrained model on ``rm_dir``'s scores alone; its step records."""
    from exactrl.algorithms.rl import train_rl

    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    cfg = load_config(RLConfig, None, ["model.path=builtin", "data.eval=null", "train.global_batch_size=16",
                                       "train.micro_batch_size=8", "algo.group_size=8", f"train.max_steps={steps}",
                                       "train.log_every=1", "rollout.max_new_tokens=8", "optim.lr=3e-3",
                                       f"reward.model={rm_dir}", "reward.weights=[0]",
                                       f"output_dir={tmp_path / 'run'}"])
    result = train_rl(cfg, spec=SPEC)
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in rows if "loss" in r]
    assert len(records) == steps and all(r["canary"] == 1.0 for r in records)
    # reward.weights=[0]: the reward is the reward model's normalised score alone, the checker logged beside it
    assert all(math.isclose(r["reward_mean"], r["reward/model"], abs_tol=1e-9) for r in records)
    assert all("reward/exactrl.tasks.arithmetic:reward" in r for r in records)
    return records


def test_an_rl_run_takes_its_reward_from_the_reward_model(rm_dir, tmp_path, monkeypatch):
    grpo_on_the_reward_model(rm_dir, tmp_path, monkeypatch, steps=1)


@pytest.mark.slow
def test_grpo_on_the_reward_model_alone_raises_its_score(rm_dir, tmp_path, monkeypatch):
    records = grpo_on_the_reward_model(rm_dir, tmp_path, monkeypatch, steps=8)
    first, last = (sum(r["reward/model"] for r in part) / 3 for part in (records[:3], records[-3:]))
    assert last > first + 0.3, [r["reward/model"] for r in records]


def test_a_reward_model_under_ray_is_accepted_and_its_group_serves_score(rm_dir):
    """reward.model with ray.enabled resolves (it was refused while the bundles held no reward model actor): the
    driver's ModelReward calls ``score`` and ``world_size`` on a Ray group as on a RewardModel, and a colocated
    bundle has room for every trainer role's rank, the reward model's included, beside an engine."""
    from exactrl.distributed.ray_cluster import SHARE, TRAINER_ROLES
    from exactrl.workers.groups import WorkerGroup

    for placement in ("split", "colocated"):
        cfg = load_config(RLConfig, None, [f"reward.model={rm_dir}", "ray.enabled=true", f"ray.placement={placement}"])
        assert (cfg.reward.model, cfg.ray.enabled, cfg.ray.placement) == (str(rm_dir), True, placement)
    group = WorkerGroup("reward", [None, None], [])
    assert group.world_size == 2 and callable(group.score)  # a Worker method run on every rank
    assert "reward" in TRAINER_ROLES and (len(TRAINER_ROLES) + 1) * SHARE <= 1


RAY_LAYOUTS = {"split": ["ray.enabled=true", "ray.placement=split", "ray.ranks=1", "ray.engines=1"],
               # two reward model ranks, each scoring its share of the rollout's micro-batches (score_layout)
               "colocated": ["ray.enabled=true", "ray.placement=colocated", "ray.ranks=2", "ray.engines=1",
                             "distributed.backend=fsdp2"]}


@pytest.mark.slow  # ~2-4 min: three runs and a Ray cluster
def test_a_ray_reward_model_group_trains_as_the_in_process_one(rm_dir, tmp_path, monkeypatch):
    """reward.model under Ray, split (its own bundle beside the policy's and the engine's) and colocated (two
    ranks sharing the policy's bundles): every step logs the in-process run's reward/model, and the run ends with
    its weights (SGD, fp32, as tests/test_ray.py compares placements)."""
    import ray
    from safetensors.torch import load_file

    from exactrl.algorithms.rl import train_rl
    from exactrl.tasks.builtin import ensure_builtin

    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    common = ["model.path=builtin", "data.eval=null", "train.global_batch_size=16", "train.micro_batch_size=4",
              "algo.group_size=8", "train.max_steps=2", "train.log_every=1", "rollout.max_new_tokens=8",
              "model.dtype=fp32", "optim.name=sgd", "optim.lr=0.05", f"reward.model={rm_dir}", "reward.weights=[0]"]
    weights, logged = {}, {}
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        for name, extra in (("plain", []), *RAY_LAYOUTS.items()):
            out = tmp_path / name
            train_rl(load_config(RLConfig, None, [*common, *extra, f"output_dir={out}"]), spec=SPEC)
            weights[name] = load_file(out / "final" / "model.safetensors")
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            logged[name] = [(r["reward/model"], r["reward_mean"]) for r in rows if "loss" in r]
    finally:
        ray.shutdown()
    plain = logged["plain"]
    assert len(plain) == 2 and all(m == pytest.approx(mean, abs=1e-9) for m, mean in plain)  # the reward is the RM's
    start = load_file(ensure_builtin(SPEC).model / "model.safetensors")
    moved = max((weights["plain"][k] - v).abs().max().item() for k, v in start.items())
    for name in RAY_LAYOUTS:
        assert len(logged[name]) == 2
        assert [m for m, _ in logged[name]] == pytest.approx([m for m, _ in plain], abs=1e-6), (name, logged)
        common_keys = weights[name].keys() & weights["plain"].keys()  # FSDP2 also writes the tied lm_head.weight
        diff = max((weights[name][k].double() - weights["plain"][k].double()).abs().max().item() for k in common_keys)
        print(f"reward.model ray {name} vs plain: max |weight difference| {diff:.3g} (the policy moved {moved:.3g}); "
              f"reward/model per step {[m for m, _ in logged[name]]}")
        assert len(common_keys) >= len(weights["plain"]) and diff <= 1e-5 and moved > 1e-4, (name, diff, moved)
