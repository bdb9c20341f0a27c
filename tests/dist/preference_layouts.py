"""Every preference loss, one step, every layout: the update the commands apply is the paper's full-batch update.

usage: python preference_layouts.py {single,fsdp2,deepspeed} WORLD OUT.json   (torchrun for WORLD 2)
       EXACTRL_PREF_LAYOUTS=all (slow): every ZeRO stage and offload, and at world size 2 every micro-batch size;
       else DeepSpeed is ZeRO-2 with the optimizer offloaded, and world size 2 runs 2 pairs (rows) per micro-batch.

Each case goes through the commands' own code: its config loaded as `exactrl dpo|rm|kto` loads it (DPOConfig,
RMConfig, KTOConfig), its objective from dpo_objective / rm_objective / kto_objective, its plan from plan_samples
with unit=2 (pairs) over 2 x pairs per micro-batch as train_dpo / train_rm make it, the reference's log-probs from a
reference worker in the step's own micro-batches (train_dpo's step; kto_step for KTO, z from its pre-pass), then
Worker.train_step on the backend's engine with the canary on. One SGD step on five pairs of 1- to 60-token answers
(KTO: nine rows) in float64, compared on rank 0 with one SGD step on the paper's loss over all pairs at once
(preference_references.py; KTO: kto_references.py). Pairs per micro-batch: 1, 2 (2 + 2 + 1) and 5 (the whole batch);
at world size 2, 2 (ranks of 2 + 1 and 1 + 1 pairs) and 3 (ranks of 3 and 2). Then each loss once more with each
micro-batch normalised by its own pairs (TRL's and OpenRLHF's mean over the micro-batch's pairs, divided by the
number of micro-batches; KTO: TRL's per-micro-batch z), to show the peers' convention is another update.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import replace

import torch
from equivalence import dtype_of, finish, full_state, precision, rank0, relative_error
from kto_references import make_rows, reference_model
from kto_references import sgd_reference as kto_reference
from pair_references import fresh_model
from preference_references import LORA, lora_value_model, make_scored_pairs, reference_update, save_lm, value_model

from exactrl.algorithms.dpo import dpo_objective
from exactrl.algorithms.kto import kto_objective, kto_step, layout_of
from exactrl.algorithms.rm import rm_objective
from exactrl.config import load_config
from exactrl.config.schema_pref import DPOConfig, KTOConfig
from exactrl.config.schema_rm import RMConfig
from exactrl.distributed.engine import build_engine
from exactrl.distributed.step_plan import plan_samples
from exactrl.losses.preference import PAIR_LOSSES
from exactrl.tasks.tokenizer import build_tokenizer
from exactrl.workers.reward_model import RewardModel
from exactrl.workers.worker import Worker

LR = 1.0
# Every pair loss of losses/preference.py PAIR_LOSSES (dpo with and without label smoothing, robust, ipo on per-token
# and on summed log-ratios, simpo, orpo with its NLL), RPO's NLL add-on, the reward model's bt with margin and
# centring, and KTO with the step's z. "params": the command's section keys (dpo.*, rm.*, kto.*).
CASES = [
    {"name": "dpo", "command": "dpo", "loss": "dpo", "params": {"beta": 0.5}},
    {"name": "cdpo", "command": "dpo", "loss": "dpo", "params": {"beta": 0.5, "label_smoothing": 0.2}},
    {"name": "robust", "command": "dpo", "loss": "robust", "params": {"beta": 0.5, "label_smoothing": 0.1}},
    {"name": "ipo", "command": "dpo", "loss": "ipo", "params": {"beta": 0.5}},
    {"name": "ipo-summed", "command": "dpo", "loss": "ipo", "params": {"beta": 2.0, "ipo_length_normalized": False}},
    {"name": "simpo", "command": "dpo", "loss": "simpo", "params": {"beta": 2.0, "gamma": 0.5}},
    {"name": "orpo", "command": "dpo", "loss": "orpo", "params": {"orpo_lambda": 0.5}, "nll": 1.0},
    {"name": "rpo", "command": "dpo", "loss": "dpo", "params": {"beta": 0.5}, "nll": 0.3},
    {"name": "bt", "command": "rm", "loss": "bt", "params": {"center_rewards": 0.05}, "margin": True},
    # exactrl rm with model.lora.rank > 0: adapters on the body, the head trained whole (peft's modules_to_save)
    {"name": "bt-lora", "command": "rm", "loss": "bt", "params": {"center_rewards": 0.05}, "margin": True,
     "lora": True},
    {"name": "kto", "command": "kto", "params": {"beta": 0.5, "desirable_weight": 1.0, "undesirable_weight": 1.3}},
]
CONFIGS = {"dpo": DPOConfig, "rm": RMConfig, "kto": KTOConfig}
# units (pairs; KTO: rows) per micro-batch: 1, 2 and the whole batch in one process; uneven ranks at world size 2
MICROS = {1: {"pairs": (1, 2, 5), "rows": (1, 2, 9)}, 2: {"pairs": (2, 3), "rows": (2, 5)}}
PEERS_MICRO = {1: {"pairs": 2, "rows": 2}, 2: {"pairs": 2, "rows": 2}}
PEERS_AT_WORLD_2 = ("dpo", "kto")


def everything() -> bool:
    return os.environ.get("EXACTRL_PREF_LAYOUTS") == "all"


def layouts(backend: str) -> list[list[str]]:
    if backend in ("single", "fsdp2"):
        return [[f"distributed.backend={backend}"]]
    ds = ["distributed.backend=deepspeed", "deepspeed.zero_stage"]
    if not everything():
        return [[*ds[:1], f"{ds[1]}=2", "deepspeed.offload_optimizer=cpu"]]
    return [[*ds[:1], f"{ds[1]}={stage}", *([f"deepspeed.offload_optimizer={o}"] if stage in (1, 2) else [])]
            for stage in range(4) for o in (("none", "cpu") if stage in (1, 2) else ("none",))] + [
        [*ds[:1], f"{ds[1]}=3", "deepspeed.offload_optimizer=cpu", "deepspeed.offload_param=cpu"]]


def settings(case: dict) -> list[str]:
    section = case["command"]
    out = [f"{section}.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in case["params"].items()]
    if section == "dpo":
        out += [f"dpo.loss={case['loss']}", f"dpo.nll_coef={case.get('nll', 0.0)}"]
    if section == "rm":
        out.append(f"rm.margin={str(case['margin']).lower()}")
    if case.get("lora"):
        out += [f"model.lora.rank={LORA.rank}", f"model.lora.alpha={LORA.alpha}"]
    return out


def trained(key: str) -> bool:
    """Whether a LoRA reward model trains the parameter ``key``: an adapter, or peft's trained copy of the head."""
    return "lora_" in key or ".modules_to_save." in key


def lora_facts(got: dict, ref: dict, init: dict) -> dict:
    """A LoRA case's frozen parameters that moved, and its trained ones that did not (both must be empty)."""
    same = lambda k: torch.equal(got[k], init[k].to(got[k].dtype))  # noqa: E731 (a float32 layout: its own start)
    return {"base_moved": [k for k in init if not trained(k) and not same(k)],
            "trained_still": [k for k in ref if trained(k) and same(k)],
            "n_trained": sum(trained(k) for k in ref)}


def run(case: dict, layout: list[str], world: int, tok, micro: int, lm_dir, micro_means: bool = False,
        padding_free: bool = True):
    """(full parameters after one optimizer step, facts of the step) through the case's command's functions."""
    cfg = load_config(CONFIGS[case["command"]], None, [
        *layout, f"distributed.nproc_per_node={world}", "train.global_batch_size=10", "train.micro_batch_size=1",
        "train.max_grad_norm=0", "optim.name=sgd", f"optim.lr={LR}", "optim.scheduler=constant",
        f"train.padding_free={str(padding_free).lower()}", *settings(case)])
    t, dtype, pad = cfg.train, dtype_of(cfg), tok.pad_token_id
    if case["command"] == "kto":
        model = fresh_model(tok, dtype=dtype)
        policy = Worker("policy", model, build_engine(model, cfg, total_steps=1), pad_id=pad, packed=t.padding_free)
        reference = Worker("reference", reference_model(tok, dtype), pad_id=pad, packed=t.padding_free)
        batch = make_rows(tok)
        plan = plan_samples(batch, micro, t.loss_agg, None, policy.world_size)  # as train_kto
        result = kto_step(policy, reference, batch, plan, kto_objective(cfg), "micro_batch" if micro_means else
                          cfg.kto.z)
    else:
        batch = make_scored_pairs(tok, dtype)
        if case["command"] == "rm":
            # the reward_model role with model.lora as workers/load.py gives it (apply_lora of models/lora.py)
            model = lora_value_model(lm_dir, dtype, cfg.model.lora) if case.get("lora") else value_model(lm_dir, dtype)
            policy = RewardModel("reward_model", model, build_engine(model, cfg, total_steps=1), pad_id=pad,
                                 packed=t.padding_free)
            objective = rm_objective(cfg)
        else:
            model = fresh_model(tok, dtype=dtype)
            policy = Worker("policy", model, build_engine(model, cfg, total_steps=1), pad_id=pad,
                            packed=t.padding_free)
            objective = dpo_objective(cfg)
        plan = plan_samples(batch, 2 * micro, t.loss_agg, None, policy.world_size, unit=2)  # as train_dpo/train_rm
        if case["command"] == "dpo":
            for s in batch:  # only the reference worker's log-probs may reach the loss
                s.ref_logprobs = None
            if PAIR_LOSSES[case["loss"]].needs_reference:  # train_dpo's step: in the step's own micro-batches
                reference = Worker("reference", fresh_model(tok, seed=9, dtype=dtype), pad_id=pad,
                                   packed=t.padding_free)
                for s, v in zip(batch, reference.forward(batch, "logprobs", layout_of(plan))):
                    s.ref_logprobs = v
        result = policy.train_step(batch, replace(plan, micro_means=micro_means), objective)
    unit = 1 if case["command"] == "kto" else 2
    facts = {"canary": result.stats["canary"], "precision": precision(cfg), "loss_value": result.loss,
             "units_per_rank": [plan.for_rank(r).num_samples // unit for r in range(world)],
             "units_per_micro_batch": [len(mb) // unit for mb in plan.micro_batches]}
    return full_state(policy.engine, model), facts



def references(tok, lm_dir) -> dict:
    """Each case's (parameters after the paper's one-pass SGD step, initial parameters), on rank 0 only."""
    refs = {}
    for case in CASES:
        if case["command"] == "kto":
            refs[case["name"]] = kto_reference(make_rows(tok), tok, LR, 1)
        else:
            refs[case["name"]] = reference_update(case, tok, make_scored_pairs(tok), LR, lm_dir)
    return refs


def cases_for(backend: str, world: int, tok, lm_dir, refs: dict | None, names=None) -> tuple[list, list]:
    """(every case x layout x micro-batch size, the peers' convention once per case); refs None off rank 0."""
    cases, peers = [], []
    for case in (c for c in CASES if names is None or c["name"] in names):
        kind = "rows" if case["command"] == "kto" else "pairs"
        for layout in layouts(backend):
            for micro in MICROS[world][kind] if world == 1 or everything() else MICROS[world][kind][:1]:
                got, facts = run(case, layout, world, tok, micro, lm_dir)
                if refs is not None:
                    cases.append({"loss": case["name"], "micro": micro, "config": " ".join(layout), **facts,
                                  "rel_err": relative_error(got, *refs[case["name"]]),
                                  **(lora_facts(got, *refs[case["name"]]) if case.get("lora") else {})})
        if world > 1 and case["name"] not in PEERS_AT_WORLD_2 and not everything():
            continue  # one process shows every loss's; at world size 2 one pair loss and KTO do
        got, facts = run(case, layouts(backend)[0], world, tok, PEERS_MICRO[world][kind], lm_dir, micro_means=True)
        if refs is not None:
            peers.append({"loss": case["name"], **facts, "rel_err": relative_error(got, *refs[case["name"]])})
    return cases, peers


def main(backend: str, world: int, out_path: str) -> None:
    tok = build_tokenizer()
    with tempfile.TemporaryDirectory() as d:  # every rank its own copy of the reward model's starting LM
        save_lm(tok, d)
        refs = references(tok, d) if rank0() else None
        cases, peers = cases_for(backend, world, tok, d, refs)
    finish(out_path, cases, peers)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
