"""What DeepSpeed configs, Accelerate configs and launcher command lines (OpenRLHF's old and
dotted flags, deepspeed/torchrun/accelerate) say about a past run's ZeRO stage, offload,
batch sizes and accumulation, each value recorded with its file:line (exactrl/audit/evidence.py)."""

from __future__ import annotations

import re
from typing import Any

from exactrl.audit.evidence import Collected, Doc, Evidence, true, whole


def read_deepspeed_config(doc: Doc, c: Collected) -> None:
    """zero_optimization.stage (DeepSpeed's default is 0), offload_optimizer.device (default
    none; very old configs wrote cpu_offload: true) and the three batch numbers."""
    zero = doc.sub("zero_optimization") if doc.has("zero_optimization") else None
    stage = zero.get("stage") if zero else None
    where = stage[1] if stage else doc.evidence("zero_optimization") if zero else Evidence(doc.file, None, "")
    c.value("zero_stage", stage or (0, where), note="" if stage else "DeepSpeed default (stage not set)")
    offload = zero.get("offload_optimizer", "device") if zero else None
    legacy = zero.get("cpu_offload") if zero else None
    if offload:
        c.value("offload_optimizer", offload)
    elif legacy and true(legacy[0]):
        c.add("offload_optimizer", "cpu", legacy[1], note="legacy cpu_offload")
    else:
        c.add("offload_optimizer", "none", where, note="no offload_optimizer in the config")
    for key, fact in (("train_micro_batch_size_per_gpu", "micro_batch_size"), ("train_batch_size", "global_batch_size"),
                      ("gradient_accumulation_steps", "gradient_accumulation_steps")):
        if doc.has(key):
            c.value(fact, doc.get(key))


def read_accelerate_config(doc: Doc, c: Collected) -> tuple[str, Evidence] | None:
    """An `accelerate config` YAML; returns the deepspeed_config_file it names, if any."""
    kind = doc.get("distributed_type")
    ds = doc.sub("deepspeed_config") if isinstance(doc.node("deepspeed_config"), dict) else None
    if kind:
        c.add("uses_deepspeed", str(kind[0]).upper() == "DEEPSPEED", kind[1], note="accelerate distributed_type")
        if str(kind[0]).upper() == "FSDP":
            c.add("fsdp", "FSDP (Accelerate distributed_type: FSDP)", kind[1])
    if doc.has("num_processes"):
        c.value("world_size", doc.get("num_processes"))
    if ds is None or not (kind is None or str(kind[0]).upper() == "DEEPSPEED"):
        return None
    if ds.has("deepspeed_config_file"):
        return ds.node("deepspeed_config_file"), ds.evidence("deepspeed_config_file")
    for key, fact in (("zero_stage", "zero_stage"), ("offload_optimizer_device", "offload_optimizer"),
                      ("gradient_accumulation_steps", "gradient_accumulation_steps")):
        if ds.has(key):
            c.value(fact, ds.get(key))
    return None


# ---------------------------------------------------------------------------- command lines


def parse_flags(words: list[str], evidence: list[Evidence]) -> dict[str, tuple[Any, Evidence, tuple]]:
    """`--key value`, `--key=value`, `--flag` (True) and LLaMA-Factory's `key=value` overrides."""
    args, i = {}, 0
    while i < len(words):
        w = words[i]
        if w.startswith("--") or re.match(r"^[a-z_.]+=", w):
            key, eq, value = w.lstrip("-").partition("=")
            where = evidence[i]  # the flag's line: a value may come from a variable set elsewhere
            if not eq:
                has_value = i + 1 < len(words) and not words[i + 1].startswith("--")
                value = words[i + 1] if has_value else True
                i += has_value
            args[key] = (value, where, ())
        i += 1
    return args


def read_launcher(words: list[str], evidence: list[Evidence], c: Collected) -> tuple[str, Evidence] | None:
    """World size from the words before the program: deepspeed (--num_gpus per node x --num_nodes,
    or --include), torchrun (--nproc_per_node x --nnodes), accelerate launch (--num_processes; the
    --config_file it names is returned)."""
    opts = {w.lstrip("-").replace("-", "_").partition("=")[0]: (w.partition("=")[2] or (
        words[i + 1] if i + 1 < len(words) else ""), evidence[i]) for i, w in enumerate(words) if w.startswith("-")}
    names = [w.rsplit("/", 1)[-1] for w in words]
    num = lambda key, default="": whole(opts.get(key, (default,))[0])  # noqa: E731
    where = lambda *keys: [opts[k][1] for k in keys if k in opts]  # noqa: E731
    slots = [h.partition(":")[2] for h in opts.get("include", ("",))[0].split("@")]
    if "deepspeed" in names:
        c.add("uses_deepspeed", True, evidence[names.index("deepspeed")], note="deepspeed launcher")
        if "include" in opts and all(slots):
            c.add("world_size", sum(len(h.split(",")) for h in slots), opts["include"][1])
        elif num("num_gpus"):
            c.add("world_size", num("num_gpus") * (num("num_nodes", "1") or 1), *where("num_gpus", "num_nodes"))
        else:
            c.problem("unresolved", "the deepspeed launcher without --num_gpus / --include uses every visible GPU: "
                      "world size unknown", evidence[names.index("deepspeed")], fact="world_size")
    elif {"torchrun", "torch.distributed.run", "torch.distributed.launch"} & set(names) and num("nproc_per_node"):
        c.add("world_size", num("nproc_per_node") * (num("nnodes", "1") or 1), *where("nproc_per_node", "nnodes"))
    elif "accelerate" in names:
        if num("num_processes"):
            c.add("world_size", num("num_processes"), *where("num_processes"))
        return opts.get("config_file")
    return None
