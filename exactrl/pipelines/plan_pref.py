"""The FLOPs plan of `exactrl dpo`, `exactrl kto`, `exactrl rm` and `exactrl kd` (`exactrl config check`), in
compute.py's conventions, so that the plan is what the run's FLOPs counter records (algorithms/offline.py run_steps:
``FlopsCounter.trained`` on every step's sequences):

- dpo and rm: every pair's two sequences (prompt + answer) are trained on, 6*N*D each; kto: every row;
- N is the trained model's parameters: the policy (a causal LM) for dpo and kto, the reward model (the same
  architecture with a scalar head in place of the LM head: *ForTokenClassification, one label) for rm;
- steps are train.max_steps, else train.epochs over the data's pairs (rows) as the commands count them
  (algorithms/common.py steps_for), D the mean tokens per sequence over the whole data set (exact for whole epochs).

Like the RL plan's reference and old log-probs, the no-grad forwards are not in the FLOPs and are given beside
them as a note (2*N*D each): dpo's reference over both answers of every pair (none for the reference-free simpo
and orpo, nor when the reference's log-probs are read from a precomputed cache), kto's reference over every row
and its reference point's pre-pass (the policy and the reference over the step's KL rows: every prompt with
another row's answer, as many tokens as the step's rows); a precomputed reference cache leaves only the policy's.
Evaluation and rm's final scoring are not counted.

kd (plan_kd) trains the student on every SFT row of its steps, 6*N_student*D, and its teacher scores the same
sequences without a backward, 2*N_teacher*D with the teacher's own N: that forward is in the FLOPs (compute.py
kd_flops), as the run's counter has it (FlopsCounter.teacher_params).
"""

from __future__ import annotations

from exactrl.compute import GENERATE_PER_PARAM_TOKEN, TRAIN_PER_PARAM_TOKEN, kd_flops, sft_flops

# The data kind of each command's training set in the built-in task, and how its items are called.
DATA_KIND = {"dpo": "pairs_train", "rm": "pairs_train", "kto": "unpaired_train"}


def _sequences(command: str, data: str, tok, cfg) -> tuple[int, list[int]]:
    """(items: pairs or rows, the token count of every trained sequence) of the data file as the command loads it."""
    from exactrl.data.preference import load_pairs, load_unpaired

    if command == "kto":
        rows, _ = load_unpaired(data, tok, cfg.data)
        return len(rows), [len(r.sample().ids) for r in rows]
    pairs, _ = load_pairs(data, tok, cfg.data)
    return len(pairs), [len(s.ids) for p in pairs for s in p.samples()]


def _reward_model_params(model_dir: str, cfg) -> int:
    """N of the reward model `exactrl rm` trains from ``model_dir`` (models/loading.py load_value_model's class and
    head), counted on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    from exactrl.compute import count_parameters

    config = AutoConfig.from_pretrained(model_dir, num_labels=1, trust_remote_code=cfg.model.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForTokenClassification.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    return count_parameters(model)


def no_grad_forwards(command: str, cfg) -> int:
    """How many no-grad forwards over the step's trained tokens the command runs beside training (2*N*D each)."""
    if command == "dpo":
        from exactrl.losses.preference import PAIR_LOSSES

        cached = getattr(cfg.dpo, "reference_cache", "none") != "none"
        return int(PAIR_LOSSES[cfg.dpo.loss].needs_reference and not cached)
    if command == "kto":
        cached = getattr(cfg.kto, "reference_cache", "none") != "none"
        # the policy on the KL rows; the reference on the rows and on the KL rows, unless read from its cache
        return 1 if cached else 3
    return 0


def plan_preference(cfg, command: str, spec, opts):
    """The PhasePlan of a dpo, kto or rm config (plan.py describes it)."""
    from exactrl.algorithms.common import steps_for
    from exactrl.pipelines.plan_base import PhasePlan, _local, _n_params, _tokenizer

    t = cfg.train
    per_item = 1 if command == "kto" else 2  # sequences per pair (row)
    p = PhasePlan(command, samples_per_step=per_item * t.global_batch_size)
    model_dir = _local(cfg.model.path, spec, "model", p.notes, "model")
    data = _local(cfg.data.train, spec, DATA_KIND[command], p.notes, "data.train")
    items = opts.data_rows
    p.tokens_per_sample = opts.tokens_per_sample
    tok = _tokenizer(model_dir, cfg, p.notes) if data else None
    if tok is not None:
        items, lengths = _sequences(command, data, tok, cfg)
        if p.tokens_per_sample is None:
            p.tokens_per_sample = sum(lengths) / len(lengths)
            p.notes.append(f"{p.tokens_per_sample:.1f} tokens per sequence on average in {data}")
    if t.max_steps:
        p.steps = t.max_steps
    elif items is not None:
        p.steps = steps_for(t, items, t.global_batch_size)
    else:
        p.notes.append(f"steps unknown: train.epochs={t.epochs} of data not here; give --data-rows")
    if opts.params is None and model_dir is not None and command == "rm":
        p.n_params = _reward_model_params(model_dir, cfg)
    else:
        p.n_params = _n_params(model_dir, opts, p.notes, cfg)
    if None not in (p.steps, p.tokens_per_sample, p.n_params):
        p.flops = sft_flops(p.n_params, p.steps * p.samples_per_step, p.tokens_per_sample)
        forwards = no_grad_forwards(command, cfg)
        if forwards:
            extra = forwards * GENERATE_PER_PARAM_TOKEN * p.flops / TRAIN_PER_PARAM_TOKEN
            what = {"dpo": "the reference over both answers", "kto": "z's pre-pass over the KL rows (the policy; the "
                    "reference, with the rows' own, unless cached)"}[command]
            p.notes.append(f"not in the FLOPs (as the RL plan's reference forwards): {forwards} no-grad forward(s) "
                           f"per trained sequence, {what}: {extra:.3g} more")
    return p


def plan_kd(cfg, spec, opts):
    """The PhasePlan of a kd config: SFT's steps and D over data.train, N of the student and of the teacher."""
    from exactrl.algorithms.common import steps_for
    from exactrl.data.encode import load_sft
    from exactrl.pipelines.plan_base import Options, PhasePlan, _local, _n_params, _tokenizer

    t = cfg.train
    p = PhasePlan("kd", samples_per_step=t.global_batch_size, tokens_per_sample=opts.tokens_per_sample)
    model_dir = _local(cfg.model.path, spec, "model", p.notes, "model")
    teacher_dir = _local(cfg.kd.teacher, spec, "model", p.notes, "kd.teacher")
    data = _local(cfg.data.train, spec, "sft_train", p.notes, "data.train")
    items = opts.data_rows
    tok = _tokenizer(model_dir, cfg, p.notes) if data else None
    if tok is not None:  # the rows as `exactrl kd` loads them (its samples' ids are the examples' input ids)
        examples, _ = load_sft(data, tok, cfg.data)
        items = len(examples)
        if p.tokens_per_sample is None:
            p.tokens_per_sample = sum(len(e.input_ids) for e in examples) / items
            p.notes.append(f"{p.tokens_per_sample:.1f} tokens per sample on average in {data}")
    if t.max_steps or items is not None:
        p.steps = steps_for(t, items or 0, t.global_batch_size)
    else:
        p.notes.append(f"steps unknown: train.epochs={t.epochs} of data not here; give --data-rows")
    p.n_params = _n_params(model_dir, opts, p.notes, cfg)
    if opts.teacher_params is not None or teacher_dir is not None:
        p.teacher_params = _n_params(teacher_dir, Options(params=opts.teacher_params), p.notes, cfg)
    else:
        p.notes.append("the teacher's N unknown: give --teacher-params")
    if None not in (p.steps, p.tokens_per_sample, p.n_params, p.teacher_params):
        p.flops = kd_flops(p.n_params, p.teacher_params, p.steps * p.samples_per_step, p.tokens_per_sample)
        p.notes.append(f"of which the teacher's no-grad forward over every trained sequence (2*N_teacher*D): "
                       f"{kd_flops(0, p.teacher_params, p.steps * p.samples_per_step, p.tokens_per_sample):.3g}")
    return p
