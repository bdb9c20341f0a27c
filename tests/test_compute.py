"""The FLOPs model (exactrl/compute.py) against a hand count, against the seed paper's own totals, and
against what a real run logged.

The paper's figures are those of arXiv 2604.23747, Appendix B ("FLOPs estimation"): N = 7e9 for
Qwen2.5-Math-7B, D_data = 4,200 tokens per demonstration; it counts response tokens only. It reports
three significant digits, so each total is compared at that precision (the formatted value is equal,
not close).
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from exactrl.compute import FlopsCounter, rl_flops, sft_flops
from exactrl.data.batch import Sample

N_7B = 7e9  # Appendix B: "N = 7x10^9 (Qwen2.5-Math-7B)"
D_DATA = 4200  # Appendix B: the average off-policy demonstration response length


def paper(x: float) -> str:
    return f"{x:.2e}"


def test_formula_against_a_hand_count():
    n = 10
    sft = FlopsCounter(n)
    sft.trained([Sample([], [1, 2, 3], source="demonstration"), Sample([], [1, 2, 3, 4, 5], source="demonstration")])
    assert sft.flops == 6 * 10 * (3 + 5) == 480

    # an RL step: two rollouts (sequences of 4 and 6 tokens, prompt included) and one demonstration of 7
    rollout = [Sample([1, 2], [3, 4]), Sample([1, 2], [3, 4, 5, 6]), Sample([1, 2], [3, 4, 5, 6, 7],
                                                                              source="demonstration")]
    rl = FlopsCounter(n)
    rl.generated(rollout)
    rl.trained(rollout)
    assert rl.flops == 8 * 10 * (4 + 6) + 6 * 10 * 7 == 1220
    assert rl_flops(10, 1, 1, 2, 5, 1, 7) == 1220  # the same step planned: 2 rollouts of 5 tokens on average
    # a second PPO epoch trains every sample again, generating nothing more
    rl.trained(rollout)
    assert rl.flops == 1220 + 6 * 10 * (4 + 6 + 7) == rl_flops(10, 1, 1, 2, 5, 1, 7, training_passes=2)
    # dynamic sampling: 9 response tokens were generated in all, 6 kept (2 + 4): the 3 dropped count as generated
    dapo = FlopsCounter(n)
    dapo.generated(rollout[:2], responses_generated=9)
    assert dapo.flops == 2 * 10 * (4 + 6 + 3)


def test_the_seed_papers_sft_then_rl_total():
    """SFT: 3 epochs over 46k samples; then 50 RL steps of 128 prompts x 8 on-policy rollouts, D_rollout = 4,200."""
    sft = sft_flops(N_7B, 3 * 46_000, D_DATA)
    rl = rl_flops(N_7B, rollouts=50, prompts_per_rollout=128, on_policy_per_prompt=8, rollout_tokens=4200)
    assert paper(rl_flops(N_7B, 1, 1, 8, 4200)) == "1.88e+15"  # "8 x 8 x N x D_rollout" per question
    assert (paper(sft), paper(rl)) == ("2.43e+19", "1.20e+19")
    # The paper's total is the sum of its rounded parts, 2.43 + 1.20; unrounded the two make 3.6385e19.
    assert paper(float(paper(sft)) + float(paper(rl))) == "3.63e+19" and paper(sft + rl) == "3.64e+19"


def test_luffy_total():
    """LUFFY (arXiv 2504.14945; its exp_scripts/train.sh: train_batch_size=128, rollout.n=8 with n_prefix=1):
    500 steps of 128 questions, 7 on-policy rollouts (D_rollout = 2,200 per Appendix B) and 1 demonstration."""
    per_question = rl_flops(N_7B, 1, 1, 7, 2200, demonstrations_per_prompt=1, demonstration_tokens=D_DATA)
    assert (paper(rl_flops(N_7B, 1, 1, 7, 2200)), paper(sft_flops(N_7B, 1, D_DATA))) == ("8.62e+14", "1.76e+14")
    assert paper(per_question) == "1.04e+15"
    total = rl_flops(N_7B, 500, 128, 7, 2200, demonstrations_per_prompt=1, demonstration_tokens=D_DATA)
    assert paper(total) == "6.65e+19"


def test_relift_total():
    """ReLIFT (arXiv 2506.07527; its examples/math-7b/train_relift.sh: train_batch_size=128, rollout.n=8,
    sft_mini_batch_size=64): 500 steps of 128 questions x 8 rollouts (D_rollout = 3,000 per Appendix B),
    plus 138 SFT updates of 64 buffered demonstrations."""
    rl = rl_flops(N_7B, 500, 128, 8, 3000)
    sft = sft_flops(N_7B, 138 * 64, D_DATA)
    assert (paper(rl_flops(N_7B, 1, 1, 8, 3000)), paper(sft)) == ("1.34e+15", "1.56e+18")
    assert paper(rl + sft) == "8.76e+19"


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))


def _records(run_dir) -> list[dict]:
    return [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "flops" in r]


def _n_params(model_dir) -> int:
    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def test_a_sft_run_logs_6_n_d_of_the_tokens_it_trained(tmp_path, cache):
    """8 rows, batches of 4, 2 steps: one epoch, every row trained once. D counted from the tokenizer here:
    the prompt with its special tokens, the completion without, then EOS (the SFT row format)."""
    from exactrl.algorithms.sft import train_sft
    from exactrl.config import SFTConfig, load_config

    rows = [{"prompt": f"{a}+{b}=", "completion": f"#### {a + b}"} for a, b in
            ((1, 2), (10, 20), (100, 200), (3, 4), (30, 400), (5, 6000), (7, 8), (90, 9))]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(SFTConfig, None, [f"data.train={data}", "data.eval=null", "train.global_batch_size=4",
                                        "train.micro_batch_size=2", "train.max_steps=2", "train.log_every=1",
                                        f"output_dir={tmp_path / 'run'}"])
    result = train_sft(cfg)
    tok = AutoTokenizer.from_pretrained(result.final_model)
    tokens = sum(len(tok(r["prompt"])["input_ids"]) + len(tok(r["completion"], add_special_tokens=False)["input_ids"])
                 + 1 for r in rows)
    n = _n_params(result.final_model)
    last = _records(result.run_dir)[-1]
    assert last["step"] == 2 and last["flops"] == 6 * n * tokens == result.compute["flops"]
    assert last["flops_generated_tokens"] == 0 and last["n_params"] == n


def test_a_grpo_run_logs_8_n_d_of_its_rollouts(tmp_path, cache):
    """Two rollouts of 2 prompts x 4 responses, one optimizer step each: every response generated once and
    trained once, 8*N*(prompt + response tokens). All built-in prompts are 'abc+def=', so each prompt's
    length is that of any one of them; the response tokens are the rollout statistics' own count."""
    from exactrl.algorithms.rl import train_rl
    from exactrl.config import RLConfig, load_config
    from exactrl.tasks.builtin import BuiltinSpec, ensure_builtin

    spec = BuiltinSpec(n_sft=64, n_rl=16, n_eval=8)
    cfg = load_config(RLConfig, None, ["data.eval=null", "train.global_batch_size=8", "train.micro_batch_size=4",
                                       "train.max_steps=2", "train.log_every=1", "algo.group_size=4",
                                       "rollout.max_new_tokens=8", f"output_dir={tmp_path / 'run'}"])
    result = train_rl(cfg, spec=spec)
    prompts = [json.loads(line)["prompt"] for line in open(ensure_builtin(spec).rl_train)]
    tok = AutoTokenizer.from_pretrained(result.final_model)
    (prompt_len,) = {len(tok(p)["input_ids"]) for p in prompts}
    records = _records(result.run_dir)
    tokens = sum(r["rollout_responses"] * prompt_len + r["generated_tokens"] for r in records)
    n = _n_params(result.final_model)
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["flops"] == 8 * n * tokens == result.compute["flops"]
