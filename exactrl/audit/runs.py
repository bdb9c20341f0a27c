"""`exactrl audit run PATH...`: were past training runs hit by the known silent gradient bugs?

It answers from what each run left behind, never running or importing anything from it. A run
directory exactrl wrote is recognised by its manifest.json and read from exactrl's own records
(exactrl/audit/own_run.py, own_facts.py, own_judging.py; a study's, cell by cell); the rest of this
module reads other frameworks' files. The bugs (rules and sources in `exactrl.audit.rules`):

- DeepSpeed ZeRO-2 + ``offload_optimizer: cpu`` + K >= 3 keeps about (g_first + g_last)/K:
  deepspeed [0.15.2, 0.19.0), introduced by PR #6550, fixed by PR #7967 (follow-up PR #7981);
- OpenRLHF's mean-of-means loss (K > 1 or world > 1) until commit df78645e / PR #1249;
- the HF Trainer's gradient-accumulation loss normalisation before PR #34191 (4.46.0).

What it reads: DeepSpeed JSON configs (``"auto"`` is resolved only by the TrainingArguments
that fill it); launch scripts and command lines (``deepspeed``, ``torchrun``, ``accelerate
launch``, ``ray job submit``, ``python``; OpenRLHF ``openrlhf.cli.*`` with the old flags
``--zero_stage --adam_offload --micro_train_batch_size --train_batch_size`` or the dotted ones
of v0.10.2+ ``--ds.zero_stage --ds.adam_offload --train.micro_batch_size --train.batch_size``,
where ``--adam_offload`` means offload_optimizer on CPU; ``llamafactory-cli train``, ``trl``);
saved arguments (HF TrainingArguments JSON, TRL / LLaMA-Factory / OpenRLHF YAML or JSON,
Accelerate config YAML, W&B ``config.yaml`` with the ``huggingface_version`` W&B records, and
``wandb-metadata.json``'s program and args); versions from ``pip freeze``, ``requirements.txt``
(a range is weaker evidence than ==, and verdicts say so), W&B's ``requirements.txt``, ``conda
list`` / ``pip list`` and DeepSpeed's log line ``DeepSpeed info: version=``. Pickles such as
``training_args.bin`` are reported as unreadable, never loaded: unpickling runs code.

Files named by other files (TrainingArguments ``deepspeed``, LLaMA-Factory ``deepspeed:``,
Accelerate ``deepspeed_config_file`` and ``--config_file``) are followed when they exist relative
to the run directory or the naming file, or by file name inside the run directory; otherwise
they are reported missing; other DeepSpeed configs than the one named are reported and ignored.
Each fact keeps its evidence as ``file:line``. The effective K is the given
gradient_accumulation_steps and, whenever known, global batch / (micro batch x world size)
(OpenRLHF divides the world by ring-attention x tensor-parallel size); a verdict other than
UNKNOWN needs every reading of the evidence to agree (disagreements are reported).

The rules also need what the run computed: the trainer (OpenRLHF's ``train_*`` program,
LLaMA-Factory's ``stage``, TRL's ``trl sft`` / ``trl/scripts/sft.py``), OpenRLHF's
``--packing_samples`` and ``--use_dynamic_batch``, whether the engine was FSDP (verl, Accelerate
FSDP), DeepSpeed-Chat's ``main.py --zero_stage --offload``. Output, exit codes: audit/report.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exactrl.audit.evidence import (
    Collected,
    Doc,
    Evidence,
    Problem,
    Reading,
    Token,
    package_list_kind,
    package_pins,
    pickle_kind,
    shell_commands,
    true,
    whole,
)
from exactrl.audit.faults import injected_faults
from exactrl.audit.judging import derive, judge
from exactrl.audit.own_judging import audit_own_run
from exactrl.audit.own_run import run_root, study_cells
from exactrl.audit.readers import parse_flags, read_accelerate_config, read_deepspeed_config, read_launcher
from exactrl.audit.recorded import recorded_facts
from exactrl.audit.rules import RULES, Verdict

PACKAGES = ("deepspeed", "transformers", "openrlhf", "trl", "accelerate", "llamafactory", "torch")
FACTS = ("framework", "uses_deepspeed", "zero_stage", "offload_optimizer", "micro_batch_size", "global_batch_size",
         "world_size", "parallel_divisor", "gradient_accumulation_steps", "effective_k", "is_openrlhf",
         "uses_hf_trainer", "trainer", "packing_samples", "dynamic_batch", "fsdp", *(f"version:{p}" for p in PACKAGES),
         "canary", "rollout_correction")  # the last two: an exactrl run's (audit/own_facts.py, audit/recorded.py)
TEXT_SUFFIXES = {".json", ".yaml", ".yml", ".sh", ".bash", ".zsh", ".txt", ".cmd", ".log", ".out"}
SCRIPT_SUFFIXES = (".sh", ".bash", ".zsh", ".txt", ".cmd")
PICKLE_SUFFIXES = (".bin", ".pkl", ".pickle", ".pt")
MAX_TEXT_BYTES = 5 << 20

# Saved-argument / flag names -> fact. OpenRLHF's dotted names arrived in v0.10.2 (commit ed62d0e2).
OPENRLHF_KEYS = {"zero_stage": "zero_stage", "ds.zero_stage": "zero_stage", "adam_offload": "offload_optimizer",
                 "ds.adam_offload": "offload_optimizer", "micro_train_batch_size": "micro_batch_size",
                 "train.micro_batch_size": "micro_batch_size", "train_batch_size": "global_batch_size",
                 "train.batch_size": "global_batch_size"}
OPENRLHF_MARKERS = {"micro_train_batch_size", "train.micro_batch_size", "adam_offload", "ds.adam_offload",
                    "ds.zero_stage"}
OPENRLHF_FLAGS = {"packing_samples": ("packing_samples", "ds.packing_samples"),
                  "dynamic_batch": ("use_dynamic_batch", "train.dynamic_batch_enable"),
                  "nll": ("nll_loss_coef", "model.nll_loss_coef")}
OPENRLHF_PARALLEL = ("ring_attn_size", "ds.ring_attn_size", "ds_tensor_parallel_size", "ds.tensor_parallel_size")
OPENRLHF_ACTOR = (("actor_num_nodes", "actor.num_nodes", 1), ("actor_num_gpus_per_node", "actor.num_gpus_per_node", 8))
HF_KEYS = {"per_device_train_batch_size": "micro_batch_size",
           "gradient_accumulation_steps": "gradient_accumulation_steps"}
TRL_MARKERS = {"dataset_name", "num_generations", "max_seq_length", "dataset_text_field", "max_prompt_length"}
LLAMAFACTORY_MARKERS = {"stage", "finetuning_type", "template"}
TRL_SCRIPT = re.compile(r"(?:^|/)(?:examples/scripts|trl/scripts)/(\w+)\.py$")  # TRL's example scripts, by trainer
PICKLE_HELP = ("not read (unpickling runs code). In the run's own environment, if you trust the file: python -c "
               "\"import torch; print(torch.load('{}', weights_only=False).to_json_string())\" > training_args.json, "
               "or provide the TrainingArguments JSON.")


@dataclass
class RunAudit:
    path: str
    facts: dict[str, list[Reading]]
    problems: list[Problem]
    verdicts: list[Verdict]


def audit_runs(paths: Iterable[str | Path]) -> list[RunAudit]:
    """One RunAudit per run directory (or single file) given; an exactrl study's, one per directory that
    trained (its base model, each cell)."""
    return [audit_run(run) for p in paths for run in study_cells(Path(p)) or [Path(p)]]


def audit_run(path: Path) -> RunAudit:
    own = run_root(path)
    if own is not None:  # exactrl's own run: its manifest says what ran (exactrl/audit/own_run.py)
        facts, problems, verdicts = audit_own_run(own)
        return RunAudit(str(path), facts, problems, verdicts)
    reader = RunReader(path if path.is_dir() else path.parent)
    if not path.exists():
        reader.c.problem("missing", f"{path} does not exist")
    for file in run_files(path) if path.is_dir() else [path] if path.exists() else []:
        reader.read(file)
    reader.finish()
    facts, problems = derive(reader.c, reader.complete_lists)
    verdicts, injected = injected_faults(path, [judge(rule, facts, problems) for rule in RULES.values()])
    return RunAudit(str(path), facts | recorded_facts(path), injected + problems, verdicts)


def run_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*") if p.is_file() and not {".git", "__pycache__"} & set(p.relative_to(root).parts)]
    return sorted(p for p in files if p.suffix.lower() in TEXT_SUFFIXES or _args_pickle(p))


def _args_pickle(p: Path) -> bool:
    return "args" in p.name.lower() and p.suffix.lower() in PICKLE_SUFFIXES


class RunReader:
    """Reads one run's files into a `Collected`. DeepSpeed configs are interpreted last, once it is
    known which of them the run's arguments name."""

    def __init__(self, root: Path):
        self.root, self.c = root, Collected()
        self.read_paths: set[Path] = set()
        self.queue: list[tuple[str, str, Evidence, Path, str | None]] = []
        self.ds_docs: list[tuple[Path | None, Doc]] = []
        self.ds_named: set[Path] = set()
        self.complete_lists: list[tuple[Evidence, set[str]]] = []

    def read(self, path: Path, hint: str | None = None) -> None:
        if path.resolve() in self.read_paths:
            return
        self.read_paths.add(path.resolve())
        try:
            name = str(path.resolve().relative_to(self.root.resolve()))
        except ValueError:
            name = str(path)
        suffix = path.suffix.lower()
        if suffix in PICKLE_SUFFIXES:
            kind = pickle_kind(path.open("rb").read(8))
            if kind:
                self.c.problem("unreadable", f"{name} is {kind}: " + PICKLE_HELP.format(path.name),
                               Evidence(name, None, kind))
        elif path.stat().st_size <= MAX_TEXT_BYTES and suffix in (".json", ".yaml", ".yml"):
            try:
                doc = Doc.parse(name, path.read_text(errors="replace"), "json" if suffix == ".json" else "yaml")
            except ValueError as e:
                self.c.problem("unreadable", f"{name}: not read as {suffix[1:].upper()} ({e})",
                               Evidence(name, None, ""))
                return
            if isinstance(doc.data, dict):
                self.read_doc(path, doc, hint)
        elif path.stat().st_size <= MAX_TEXT_BYTES:
            self.read_text(path, name, path.read_text(errors="replace"))

    def read_doc(self, path: Path, doc: Doc, hint: str | None) -> None:
        keys = set(doc.keys())
        if path.name == "wandb-metadata.json":  # program and argv of rank 0; W&B does not see the launcher
            program = doc.get("program") or doc.get("codePath")
            if program:
                tokens = [Token(str(program[0]), program[1].line or 0)] + [
                    Token(str(a), doc.evidence("args", i).line or 0) for i, a in enumerate(doc.node("args") or [])]
                self.read_command(tokens, doc.file, doc.text_lines, launcher_seen=False)
        elif "_wandb" in keys:
            version = doc.get("_wandb", "value", "huggingface_version")
            if version:  # W&B telemetry records the transformers version as huggingface_version
                self.c.add("version:transformers", f"=={version[0]}", version[1], note="W&B telemetry")
            self.read_args(self.flat(doc, wandb=True), doc, doc.evidence(), saved=True, base=path.parent)
        elif keys & {"zero_optimization", "train_micro_batch_size_per_gpu"} or hint == "deepspeed":
            self.ds_docs.append((path.resolve(), doc))
        elif keys & {"distributed_type", "compute_environment"} or isinstance(doc.node("deepspeed_config"), dict):
            named = read_accelerate_config(doc, self.c)
            if named:
                self.refer("deepspeed", *named, path.parent)
        else:
            self.read_args(self.flat(doc), doc, doc.evidence(), saved=True, hint=hint, base=path.parent)

    def read_text(self, path: Path, name: str, text: str) -> None:
        kind = package_list_kind(path.name, text) if path.suffix.lower() == ".txt" else None
        if kind:
            if (path.parent / "wandb-metadata.json").exists():
                kind = "freeze"  # W&B saves `pip freeze` as requirements.txt next to its metadata
            pins = package_pins(text, kind)
            for pin in (p for p in pins if p.name in PACKAGES):
                note = ("exact pin" if pin.spec.startswith("==") and "*" not in pin.spec else
                        "unpinned" if not pin.spec else f"git commit {pin.spec[1:]}" if pin.spec.startswith("@")
                        else "a range: weaker evidence than an exact == pin")
                self.c.add(f"version:{pin.name}", pin.spec, Evidence(name, pin.line, pin.text), note=note)
            if kind != "requirements":  # a whole environment: what it lacks was not installed
                self.complete_lists.append((Evidence(name, None, f"{kind} list"), {p.name for p in pins}))
            return
        version = re.search(r"DeepSpeed info: version=([^\s,]+)", text)
        if version:
            line = text.count("\n", 0, version.start()) + 1
            self.c.add("version:deepspeed", f"=={version.group(1)}",
                       Evidence(name, line, text.splitlines()[line - 1].strip()[:200]), note="DeepSpeed start-up log")
        if path.suffix.lower() in SCRIPT_SUFFIXES:
            for tokens in shell_commands(text):
                self.read_command(tokens, name, text.splitlines(), launcher_seen=True, base=path.parent)

    # -------------------------------------------------------------------- references

    def refer(self, kind: str, target: Any, evidence: Evidence, base: Path, hint: str | None = None) -> None:
        if isinstance(target, str) and target.strip():
            self.queue.append((kind, target.strip(), evidence, base, hint))

    def resolve(self, target: str, base: Path) -> Path | None:
        p = Path(target)
        tries = [] if p.is_absolute() else [self.root / p, base / p]
        by_name = [f for f in self.root.rglob(p.name) if f.is_file()]
        return next((t for t in tries if t.is_file()), by_name[0] if len(by_name) == 1 else None)

    def finish(self) -> None:
        while self.queue:
            kind, target, evidence, base, hint = self.queue.pop(0)
            found = self.resolve(target, base)
            if found is None:
                self.c.problem("missing", f"{evidence.at} names {target}, which is not in the run directory: "
                               "copy it there to use it", evidence, fact="deepspeed_config" if kind == "deepspeed"
                               else None)
                continue
            if kind == "deepspeed":
                self.ds_named.add(found.resolve())
            self.read(found, hint=hint or kind)
        named = [p is None or p in self.ds_named for p, _ in self.ds_docs]
        for (_, doc), used in zip(self.ds_docs, named):
            if used or not any(named):
                read_deepspeed_config(doc, self.c)
            else:
                self.c.problem("ignored", f"{doc.file}: a DeepSpeed config the run's arguments do not name; ignored",
                               Evidence(doc.file, None, ""))

    # -------------------------------------------------------------------- arguments and commands

    @staticmethod
    def flat(doc: Doc, wandb: bool = False) -> dict[str, tuple[Any, Evidence, tuple]]:
        """Saved arguments as dotted name -> (value, evidence, path); W&B wraps each in {value: ...}."""
        out = {}

        def walk(path: tuple, name: str) -> None:
            node = doc.node(*path)
            if isinstance(node, dict) and name not in ("deepspeed", "_wandb"):
                for key, child in node.items():
                    inner = ("value",) if wandb and not path and isinstance(child, dict) and "value" in child else ()
                    walk(path + (key,) + inner, f"{name}.{key}" if name else str(key))
            elif name:
                out[name] = (node, doc.evidence(*path), path)

        walk((), "")
        return out

    def read_args(self, args: dict[str, tuple], doc: Doc | None, origin: Evidence, saved: bool,
                  hint: str | None = None, base: Path | None = None) -> None:
        """Saved arguments or command-line flags of OpenRLHF, the HF Trainer, TRL, LLaMA-Factory or
        DeepSpeed-Chat."""
        keys = set(args)
        framework, markers = next(((name, marks) for name, marks, found in (
            ("openrlhf", OPENRLHF_MARKERS, hint == "openrlhf" or keys & OPENRLHF_MARKERS),
            ("llamafactory", LLAMAFACTORY_MARKERS, hint == "llamafactory" or len(keys & LLAMAFACTORY_MARKERS) >= 2),
            ("trl", TRL_MARKERS, hint == "trl" or (saved and keys & TRL_MARKERS and "output_dir" in keys)),
            # DeepSpeed-Chat's main.py: its own loop, `--zero_stage N --offload` on the command line
            ("deepspeed-chat", {"zero_stage"}, not saved and {"zero_stage", "deepspeed"} <= keys),
            ("transformers-trainer", {"per_device_train_batch_size"},
             saved and {"output_dir", "per_device_train_batch_size"} <= keys)) if found), (None, set()))
        if framework:
            marker = sorted(keys & markers)
            self.c.add("framework", framework, args[marker[0]][1] if marker and saved else origin)
        if framework == "openrlhf":
            return self.read_openrlhf(args, origin, saved)
        for key in HF_KEYS.keys() & keys:
            self.c.value(HF_KEYS[key], args[key][:2])
        if framework == "llamafactory" and (saved or "stage" in args):
            stage, where = args.get("stage", ("sft", origin))[:2]  # LLaMA-Factory's default stage is sft
            extra = [f"{k} {args[k][0]}" for k in ("pref_ftx",) if k in args and (whole(args[k][0]) or 0) > 0]
            extra += ["pref_loss orpo"] if stage == "dpo" and args.get("pref_loss", ("",))[0] == "orpo" else []
            self.c.add("trainer", f"{stage} + {', '.join(extra)}" if extra else str(stage), where,
                       note="LLaMA-Factory stage" + (" with a token-averaged SFT term" if extra else ""))
        if framework == "deepspeed-chat":
            self.c.add("uses_deepspeed", True, origin, note="DeepSpeed-Chat trains with DeepSpeed")
            self.c.value("zero_stage", args["zero_stage"][:2])
            offload = args.get("offload")
            self.c.add("offload_optimizer", "cpu" if offload else "none", offload[1] if offload else origin,
                       note="--offload" if offload else "no --offload")
            return
        if "deepspeed" in args:
            value, evidence, path = args["deepspeed"]
            if value in (None, "", False):
                self.c.add_weak("uses_deepspeed", False, evidence, note="TrainingArguments.deepspeed is empty")
                return
            self.c.add("uses_deepspeed", True, evidence, note="the arguments name a DeepSpeed config")
            if isinstance(value, dict) and doc is not None:  # an inline DeepSpeed config
                self.ds_docs.append((None, doc.sub(*path)))
            else:
                self.refer("deepspeed", value, evidence, base or self.root)
        elif framework == "llamafactory":
            self.c.add_weak("uses_deepspeed", False, origin, note="no deepspeed key in the LLaMA-Factory config")

    def read_openrlhf(self, args: dict[str, tuple], origin: Evidence, saved: bool) -> None:
        self.c.add("uses_deepspeed", True, origin, note="OpenRLHF trains with DeepSpeed")
        for key in OPENRLHF_KEYS.keys() & args.keys():
            if OPENRLHF_KEYS[key] == "offload_optimizer":
                self.c.add("offload_optimizer", "cpu" if true(args[key][0]) else "none", args[key][1], note=key)
            else:
                self.c.value(OPENRLHF_KEYS[key], args[key][:2])
        given = {fact: next((args[k] for k in names if k in args), None) for fact, names in OPENRLHF_FLAGS.items()}
        if not saved:  # argparse defaults, the same from v0.3 to v0.11: --zero_stage 2, no --adam_offload
            if not args.keys() & {"zero_stage", "ds.zero_stage"}:
                self.c.add("zero_stage", 2, origin, note="OpenRLHF default (no --zero_stage)")
            if not args.keys() & {"adam_offload", "ds.adam_offload"}:
                self.c.add("offload_optimizer", "none", origin, note="OpenRLHF default (no --adam_offload)")
        for fact in ("packing_samples", "dynamic_batch"):
            if given[fact] is not None:
                self.c.add(fact, true(given[fact][0]), given[fact][1])
            elif not saved:  # a whole command line: an absent store_true flag is False
                self.c.add(fact, False, origin, note="not on the command line")
        parallel = [(whole(args[k][0]), args[k][1]) for k in OPENRLHF_PARALLEL if k in args and whole(args[k][0])]
        if any(v > 1 for v, _ in parallel):
            size = 1
            for v, _ in parallel:
                size *= v
            self.c.add("parallel_divisor", size, *(e for _, e in parallel), note="ring attention x tensor parallel")
        if "train_ppo_ray" in origin.text or args.keys() & {"actor_num_nodes", "actor.num_nodes"}:
            keys = [old if old in args else new if new in args else None for old, new, _ in OPENRLHF_ACTOR]
            factors = [whole(args[k][0]) if k else default for k, (_, _, default) in zip(keys, OPENRLHF_ACTOR)]
            if None not in factors:
                self.c.add("world_size", factors[0] * factors[1], *dict.fromkeys(args[k][1] if k else origin
                                                                                  for k in keys),
                           note="actor nodes x GPUs per node (OpenRLHF defaults 1 x 8 where not given)")

    def read_verl(self, args: dict[str, tuple], origin: Evidence) -> None:
        """verl trains with FSDP (or Megatron) workers that Ray places; it never uses DeepSpeed."""
        self.c.add("framework", "verl", origin)
        strategy = args.get("actor_rollout_ref.actor.strategy", ("fsdp", origin))
        offload = [args[k][1] for k in args if k.startswith("actor_rollout_ref.actor.fsdp_config.") and
                   k.endswith("_offload") and true(args[k][0])]
        self.c.add("uses_deepspeed", False, strategy[1], note=f"verl trains with {strategy[0]}")
        engine = "Megatron" if str(strategy[0]).lower() == "megatron" else "FSDP"
        self.c.add("fsdp", f"{engine} (verl{', with its own offload' if offload else ''})", strategy[1], *offload)

    def read_command(self, tokens: list[Token], file: str, lines: list[str], launcher_seen: bool,
                     base: Path | None = None) -> None:
        words = [t.text for t in tokens]
        ev = lambda i: Evidence(file, tokens[i].line, lines[tokens[i].line - 1].rstrip("\\ ").strip()[:200]  # noqa
                                if 0 < tokens[i].line <= len(lines) else words[i])
        start = next((i for i, w in enumerate(words) if not re.match(r"^[A-Za-z_]\w*=", w)), len(words))
        program = next((i for i, w in enumerate(words) if i >= start and (
            w.startswith(("openrlhf.cli.", "verl.")) or w.endswith((".py", "llamafactory-cli"))
            or w.rsplit("/")[-1] == "trl")), None)
        if program is None:
            return
        prog, base = words[program], base or self.root
        trl_script = TRL_SCRIPT.search(prog)
        hint = ("openrlhf" if re.match(r"openrlhf\.cli\.|.*openrlhf/cli/\w+\.py$", prog)
                else "verl" if prog.startswith("verl.") or re.search(r"(^|/)verl/.*main_\w+\.py$", prog)
                else "llamafactory" if prog.endswith("llamafactory-cli")
                else "trl" if prog.rsplit("/")[-1] == "trl" or trl_script else None)
        rest = program + (2 if hint == "llamafactory" or prog.rsplit("/")[-1] == "trl" else 1)  # skip `train`, `sft`
        args = parse_flags(words[rest:], [ev(i) for i in range(rest, len(words))])
        if hint == "verl":
            return self.read_verl(args, ev(program))
        trainer = (re.search(r"train_(\w+?)(?:_ray)?(?:\.py)?$", prog) if hint == "openrlhf" else
                   trl_script if trl_script else None)
        trainer = trainer.group(1) if trainer else words[program + 1] if rest == program + 2 and hint == "trl" else None
        nll = next((args[k] for k in OPENRLHF_FLAGS["nll"] if k in args), None) if hint == "openrlhf" else None
        if nll and re.fullmatch(r"[\d.e-]+", str(nll[0])) and float(nll[0]) > 0:  # a token-averaged NLL term
            trainer = f"{trainer} + NLL term"
        if trainer:
            self.c.add("trainer", trainer, ev(program), note=f"the program {prog}")
        if hint == "llamafactory" and rest < len(words) and words[rest].endswith((".yaml", ".yml", ".json")):
            self.refer("args", words[rest], ev(rest), base, hint="llamafactory")
        if hint == "trl" and "config" in args:
            self.refer("args", args.pop("config")[0], ev(program), base, hint="trl")
        pre = words[start:program]
        distributed = {w.rsplit("/", 1)[-1] for w in pre} & {"deepspeed", "torchrun", "accelerate", "srun", "mpirun",
                                                            "torch.distributed.run", "torch.distributed.launch"}
        training = hint or args.keys() & (set(HF_KEYS) | {"deepspeed"} | OPENRLHF_MARKERS)
        # Ray places OpenRLHF's PPO actors (--actor(.)num_* flags); trl and llamafactory-cli pick their own
        # launcher; only `python script.py` / `python -m module` with nothing around it is one process.
        if launcher_seen and "train_ppo_ray" not in prog and (training or distributed):
            if all(re.fullmatch(r"python[\d.]*|-[mubOE]+", w.rsplit("/", 1)[-1]) for w in pre) and not (
                    hint == "llamafactory" or prog.rsplit("/")[-1] == "trl"):
                self.c.add("world_size", 1, ev(program), note="plain launch: one process")
            config = read_launcher(pre, [ev(i) for i in range(start, program)], self.c)
            if config:
                self.refer("accelerate", *config, base)
        if training:
            self.read_args(args, None, ev(program), saved=False, hint=hint, base=base)
