"""Every preference loss's one-pass reference over the whole step, written from its paper's formula with plain torch
(no exactrl loss, term, plan, worker or aggregation code), for tests/test_preference_layouts.py and
preference_layouts.py: the step's mean over its pairs of the per-pair loss, plus a coefficient times the chosen
answers' NLL summed over the step's chosen tokens and divided by their number (RPO, ORPO).

The pairs are pair_references.py's five (answers of 1 to ~60 tokens, so micro-batches of 2 + 2 + 1 pairs and ranks
of 3 and 2 carry very different pair and token counts), with a margin column for the reward model's loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from equivalence import SMALL, in_dtype
from pair_references import answer_logprobs, fresh_model, make_pairs

from exactrl.config.schema import LoraConfig
from exactrl.models.loading import load_value_model
from exactrl.models.lora import apply_lora
from exactrl.tasks.tiny_model import build_tiny_model

MARGINS = [0.5, -0.25, 1.0, 0.0, 2.0]  # bt's margin column, one per pair
HEAD_SCALE = 30.0  # the value head's scores then differ by O(1): the reward model's loss is far from ln 2
LORA = LoraConfig(rank=4, alpha=8.0)  # a LoRA reward model's model.lora (its keys: preference_layouts.settings)


def make_scored_pairs(tok, dtype=torch.float64):
    """The five pairs with each pair's margin on both of its rows (as data/preference.py PairExample sets it)."""
    samples = make_pairs(tok, dtype)
    for i, s in enumerate(samples):
        s.margin = MARGINS[i // 2]
    return samples


def save_lm(tok, path) -> None:
    """The tiny causal LM a reward model starts from (load_value_model adds its seeded scalar head)."""
    build_tiny_model(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=3,
                     **SMALL).save_pretrained(str(path))


def value_model(path, dtype=torch.float64):
    model = in_dtype(load_value_model(path, init_seed=7), dtype)
    with torch.no_grad():
        model.score.weight.mul_(HEAD_SCALE)
    return model


def lora_value_model(path, dtype=torch.float64, lora=LORA):
    """value_model with adapters on its body and its head trained whole (exactrl rm's apply_lora, as
    workers/load.py gives the reward_model role), A and B drawn from one seed (peft starts B at 0, which would
    leave A's gradient 0): the same model every call, on every rank, in any dtype."""
    model = in_dtype(apply_lora(value_model(path, dtype), lora), dtype)  # the adapters in the model's dtype too
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                # drawn in float32, so a float32 layout (ZeRO-0) starts from the float64 reference's very values
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float32))
    return model


def _sums(model, samples, pad_id):
    """The policy's answer log-prob sums [2P], the reference's, each answer's token count, and each answer's NLL sum."""
    lp = answer_logprobs(model, samples, pad_id)
    sums = torch.stack([x.sum() for x in lp])
    ref = torch.stack([s.ref_logprobs[len(s.prompt_ids) - 1 :].sum() for s in samples])
    n = torch.tensor([len(s.response_ids) for s in samples], dtype=sums.dtype)
    return sums, ref, n


def paper_pair_loss(case: dict, model, samples, pad_id: int) -> torch.Tensor:
    """The step's loss of ``case`` (its "loss" and knobs, as preference_layouts.CASES holds them) over all pairs."""
    loss, p = case["loss"], case["params"]
    sums, ref, n = _sums(model, samples, pad_id)
    pc, pr, nc, nr = sums[0::2], sums[1::2], n[0::2], n[1::2]
    hc, hr = pc - ref[0::2], pr - ref[1::2]  # log pi(y|x) - log pi_ref(y|x), summed over the answer
    beta, eps = p.get("beta", 0.1), p.get("label_smoothing", 0.0)
    if loss == "dpo":  # Rafailov et al. 2023 eq. 7; eps > 0: conservative DPO (Mitchell 2023)
        h = beta * (hc - hr)
        per_pair = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
    elif loss == "robust":  # Chowdhury et al. 2024, eq. 3: the unbiased estimator under flip rate eps
        h = beta * (hc - hr)
        per_pair = ((1 - eps) * -F.logsigmoid(h) + eps * F.logsigmoid(-h)) / (1 - 2 * eps)
    elif loss == "ipo":  # Azar et al. 2023 eq. 17, tau = beta; on per-token log-ratios (TRL) or summed (OpenRLHF)
        h = hc / nc - hr / nr if p.get("ipo_length_normalized", True) else hc - hr
        per_pair = (h - 1 / (2 * beta)) ** 2
    elif loss == "simpo":  # Meng et al. 2024 eq. 6: reference-free, average log-probs, absolute margin gamma
        per_pair = -F.logsigmoid(beta * pc / nc - beta * pr / nr - p["gamma"])
    elif loss == "orpo":  # Hong et al. 2024 eqs. 4-7: odds(y) = P / (1 - P), P = exp(average log-prob)
        ac, ar = pc / nc, pr / nr
        log_odds = (ac - torch.log1p(-torch.exp(ac))) - (ar - torch.log1p(-torch.exp(ar)))
        per_pair = -p["orpo_lambda"] * F.logsigmoid(log_odds)
    else:
        raise ValueError(loss)
    nll = -pc.sum() / nc.sum()  # the chosen answers' token-mean NLL over the step's chosen tokens
    return per_pair.mean() + case.get("nll", 0.0) * nll


def paper_bt_loss(case: dict, model, samples) -> torch.Tensor:
    """Bradley-Terry over all pairs (Ouyang et al. 2022 eq. 1; margin: Touvron et al. 2023 eq. 2; centring:
    Eisenstein et al. 2023): -log sigma(r_c - r_r - m) + c (r_c + r_r)^2, r = the head at each sequence's last
    token, each sequence run alone (a LoRA model: through its adapters and its trained copy of the head)."""
    r = torch.stack([model(input_ids=torch.tensor([s.ids])).logits[0, -1, 0] for s in samples])
    m = torch.tensor([s.margin for s in samples[0::2]], dtype=r.dtype) if case["margin"] else 0.0
    c, rj = r[0::2], r[1::2]
    return (-F.logsigmoid(c - rj - m) + case["params"]["center_rewards"] * (c + rj) ** 2).mean()


def sgd_step(model, loss_fn, lr: float) -> tuple[dict, dict]:
    """(parameters after one plain SGD step on ``loss_fn(model)``, the initial ones)."""
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loss_fn(model).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # a LoRA model: its adapters and head; the frozen base keeps no gradient
                p -= lr * p.grad
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, init


def reference_update(case: dict, tok, samples, lr: float, lm_dir=None) -> tuple[dict, dict]:
    """One SGD step on the case's paper loss over all pairs, from the same start as the tested run."""
    if case["command"] == "rm":
        model = lora_value_model(lm_dir) if case.get("lora") else value_model(lm_dir)
        return sgd_step(model, lambda m: paper_bt_loss(case, m, samples), lr)
    return sgd_step(fresh_model(tok), lambda m: paper_pair_loss(case, m, samples, tok.pad_token_id), lr)
