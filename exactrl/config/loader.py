"""YAML + dotted command-line overrides -> a validated, typed config.

Errors name the key, what was given and what is allowed, and suggest the closest valid key,
so a typo fails in the first second rather than after the model has loaded.
"""

from __future__ import annotations

import difflib
import re
import warnings
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from exactrl.config.schema import CommonConfig, SFTConfig
from exactrl.config.schema_rl import ALIASES, RENAMED, RLConfig
from exactrl.config.used import USED_WHEN

T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A user-fixable configuration problem; the message says which key and how to fix it."""


def _submodel(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is not None:
        for arg in get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def valid_keys(cls: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of ``cls``: ``["model.path", "train.seed", ...]``."""
    keys = []
    for name, field in cls.model_fields.items():
        sub = _submodel(field.annotation)
        keys.extend(valid_keys(sub, f"{prefix}{name}.") if sub else [f"{prefix}{name}"])
    return keys


def _suggest(key: str, keys: list[str]) -> str:
    """The valid key (or section) nearest to ``key``: another framework's name for it (schema_rl.ALIASES,
    'learning_rate' -> 'optim.lr', in the demo's sections too), else the closest spelling, matching
    sections and leaf separately: a misspelt section ('trian.max_steps') keeps its leaf, a
    misspelt leaf keeps its section."""
    *sections, leaf = key.split(".")
    if leaf in ALIASES:
        target, how = ALIASES[leaf]
        # 'rl.model.lora.r' -> 'rl.model.lora.rank'; the demo's top-level 'lora_alpha' -> 'sft.model.lora.alpha'
        found = [c for i in range(len(sections) + 1) if (c := ".".join([*sections[:i], target])) in keys]
        found += [k for k in keys if k.endswith("." + target)]
        section = ".".join(sections)
        if any(k.startswith(section + ".") for k in keys):  # a real section ('optim.epsilon'): stay in it
            found = [c for c in found if c.startswith(section + ".")]
        if found:
            return f"; did you mean '{found[0]}'?{how}"
    candidates = sorted(set(keys) | {k.rsplit(".", 1)[0] for k in keys if "." in k})

    def score(candidate: str) -> float:
        *c_sections, c_leaf = candidate.split(".")
        leaf_score = difflib.SequenceMatcher(None, leaf, c_leaf).ratio()
        if len(c_sections) != len(sections):  # a key given at another depth ('lr' -> 'optim.lr'): the leaf decides
            return 0.9 * leaf_score - 0.01 * abs(len(c_sections) - len(sections))
        # The leaf weighs most (a key put in the wrong section, 'train.lr' -> 'optim.lr'); the
        # section breaks ties ('modle.path' -> 'model.path', not 'critic.path').
        section_score = (difflib.SequenceMatcher(None, ".".join(sections), ".".join(c_sections)).ratio()
                         if sections else 1.0)
        return 0.9 * leaf_score + 0.1 * section_score

    best = max(candidates, key=score)
    return f"; did you mean '{best}'?" if score(best) >= 0.6 else ""


def _check_keys(cls: type[BaseModel], data: dict, prefix: str, source: str, all_keys: list[str]) -> None:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        field = cls.model_fields.get(key)
        if field is None and issubclass(cls, SFTConfig) and key in RLConfig.model_fields:
            # RL's sections (algo, rollout, reward...) given to SFT: a look-alike key of SFT's would mislead
            what = (f"an RL phase's, not an SFT phase's ({prefix[:-1]}); put it under rl.{key}" if prefix else
                    "`exactrl rl`'s, not `exactrl sft`'s; run `exactrl rl` for RL, or remove it")
            raise ConfigError(f"{source}: unknown key '{dotted}': {key}.* is {what}")
        if field is None:
            # An unknown section ('trainer: {seed: 1}'): suggest for its first key, 'train.seed'.
            probe = f"{dotted}.{next(iter(value))}" if isinstance(value, dict) and value else dotted
            raise ConfigError(f"{source}: unknown key '{dotted}'{_suggest(probe, all_keys)}")
        sub = _submodel(field.annotation)
        if sub is not None and isinstance(value, dict):
            _check_keys(sub, value, f"{dotted}.", source, all_keys)
        elif sub is not None and value is not None:
            raise ConfigError(f"{source}: '{dotted}' is a section (keys: {', '.join(valid_keys(sub))}), got {value!r}")
        elif sub is None and isinstance(value, dict) and get_origin(field.annotation) is not dict:
            raise ConfigError(f"{source}: '{dotted}' is a value, not a section (given {value!r})")


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key.path=value (e.g. optim.lr=3e-4)")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}': '{key}' is not a dotted key like train.micro_batch_size")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0]
        raise ConfigError(f"override '{text}': the value is not valid YAML ({first}); quote it") from None
    return key.split("."), value


def _renamed(path: list[str], source: str) -> list[str]:
    """A moved key's new path (schema_rl.RENAMED), with a notice; other paths as given. Keys are
    matched at any depth, so the demo's rl.algo.lam moves too."""
    dotted = ".".join(path)
    for old, new in RENAMED.items():
        if dotted == old or dotted.endswith("." + old):
            warnings.warn(f"{source}: '{old}' is now '{new}'", FutureWarning, stacklevel=3)
            return path[: len(path) - len(old.split("."))] + new.split(".")
    return path


def _rename(data: dict, source: str, prefix: list[str] | None = None) -> None:
    """Move keys of a loaded YAML mapping that schema_rl.RENAMED lists to their new place, in place."""
    for key in list(data):
        path = (prefix or []) + [key]
        if isinstance(data[key], dict):
            _rename(data[key], source, path)
        new = _renamed(path, source)
        if new != path:
            node = data
            for part in new[len(prefix or []) : -1]:
                node = node.setdefault(part, {})
            node[new[-1]] = data.pop(key)


def _set(data: dict, path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:  # _check_keys has already rejected paths through values
        node = node.setdefault(part, {})
    node[path[-1]] = value


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Load ``cls`` from an optional YAML file, then apply ``key.path=value`` overrides in order."""
    data: dict = {}
    origins: dict[str, str] = {}  # dotted key -> where it was last set ('file:line', "override 'k=v'"), for errors
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        text = _read_text(p)
        try:
            lines = _check_nodes(yaml.compose(text), p)
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        origins |= {key: f"{p}:{line}" for key, line in lines.items()}
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    keys = valid_keys(cls)
    _rename(data, str(path) if path else "config")
    _check_keys(cls, data, "", str(path) if path else "config", keys)
    # Start from the command's own defaults (a demo's sft section has the demo's defaults,
    # not SFTConfig's), then the file, then the overrides in order.
    return _overridden(cls, _merge(cls().model_dump(), data), overrides, origins, keys)


def with_overrides(cfg: T, overrides: list[str] | tuple[str, ...]) -> T:
    """``cfg`` with ``key.path=value`` overrides applied in order, checked as load_config checks
    them (a study's per-cell settings on top of its sections)."""
    cls = type(cfg)
    return _overridden(cls, cfg.model_dump(), overrides, {}, valid_keys(cls))


def _overridden(cls: type[T], merged: dict, overrides, origins: dict[str, str], keys: list[str]) -> T:
    for text in overrides:
        if not _encodable(text):  # bytes that are not UTF-8 reach Python as lone surrogates
            raise ConfigError(f"override {text!r} is not valid UTF-8 text; fix the command line")
        key_path, value = parse_override(text)
        key_path = _renamed(key_path, f"override '{text}'")
        _check_keys(cls, _nest(key_path, value), "", f"override '{text}'", keys)
        if isinstance(value, (int, float)) and _is_str_field(cls, key_path):
            value = text.split("=", 1)[1]  # model.path=123 means the path "123" (bool is an int too: yes/no stay text)
        _set(merged, key_path, value)
        dotted = ".".join(key_path)
        origins = {k: v for k, v in origins.items() if k != dotted and not k.startswith(dotted + ".")}
        origins[dotted] = f"override '{text}'"
    try:
        cfg = cls.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_explain(e, origins, keys)) from None
    check_used(cfg, cls(), keys, origins)
    return cfg


def _read_text(p: Path) -> str:
    raw = p.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(f"{p}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}); save the file as UTF-8") from None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _check_nodes(node, p: Path) -> dict[str, int]:
    """Refuse at its line what PyYAML would load without a word: a key given twice in one
    mapping (the last would win: a second `train:` section replaces the first whole), and a
    lone surrogate from an escape such as "\\ud800", which no file, tokenizer or log can hold.
    Returns the line of each dotted key. Iterative, each node once (aliases share nodes)."""
    stack, seen, lines = [(node, "")] if node is not None else [], set(), {}
    while stack:
        n, prefix = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n, yaml.ScalarNode):
            if not _encodable(n.value):
                raise ConfigError(f"{p}:{n.start_mark.line + 1}: {n.value!r} holds a lone surrogate "
                                  "(not valid Unicode text)")
        elif isinstance(n, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, value in n.value:
                line = key.start_mark.line + 1
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":  # '<<' is YAML's merge key
                    if key.value in first:
                        raise ConfigError(f"{p}:{line}: duplicate key '{prefix}{key.value}' (first at line "
                                          f"{first[key.value]}); keep one")
                    first[key.value] = lines[f"{prefix}{key.value}"] = line
                stack += [(key, prefix), (value, f"{prefix}{key.value}." if isinstance(key, yaml.ScalarNode)
                                          else prefix)]
        else:
            stack.extend((x, prefix) for x in n.value)
    return lines


def _is_str_field(cls: type[BaseModel], path: list[str]) -> bool:
    for part in path[:-1]:
        cls = _submodel(cls.model_fields[part].annotation)
        if cls is None:  # a key inside a dict-valued field (env.args.delay): its value is YAML's
            return False
    annotation = cls.model_fields[path[-1]].annotation
    return annotation is str or (get_origin(annotation) is not None and str in get_args(annotation))


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _nest(path: list[str], value: Any) -> dict:
    for part in reversed(path):
        value = {part: value}
    return value


def _origin(key: str, origins: dict[str, str]) -> str | None:
    """Where ``key`` or the section holding it was last set (None: it kept its default)."""
    parts = key.split(".")
    return next((origins[k] for i in range(len(parts), 0, -1) if (k := ".".join(parts[:i])) in origins), None)


def _full_keys(msg: str, loc: tuple, keys: list[str]) -> str:
    """A cross-field check names keys from its command's root ('train.micro_batch_size',
    'model.lora.target_modules'); inside the demo's 'sft' section they are 'sft.train...'. Put
    the shortest part of the check's location in front that makes each a key of the config."""
    known = set(keys) | {k.rsplit(".", i)[0] for k in keys for i in range(1, k.count(".") + 1)}

    def full(m: re.Match) -> str:
        for i in range(len(loc) + 1):
            candidate = ".".join([*map(str, loc[:i]), m.group(1)])
            if candidate in known:
                return candidate
        return m.group(1)

    return re.sub(r"(?<![\w.])([a-z_]+(?:\.[a-z_]+)+)", full, msg)


def _explain(e: ValidationError, origins: dict[str, str], keys: list[str]) -> str:
    """One line per problem, led by where the offending value came from: the file and line, or
    the command-line override (a bad override is not the file's fault)."""
    problems = []
    for err in e.errors():
        if err["type"] == "value_error":  # our own cross-field checks name their keys
            body = _full_keys(err["msg"].removeprefix("Value error, "), err["loc"], keys)
            named = re.findall(r"(?<![\w.])([a-z_]+(?:\.[a-z_]+)+)", body)
        else:
            named = [".".join(str(x) for x in err["loc"])]
            body = f"{named[0]}: {err['msg']} (given: {err['input']!r})"
        where = list(dict.fromkeys(o for k in named if (o := _origin(k, origins))))
        problems.append(f"{'; '.join(where) or 'invalid configuration'}: {body}")
    if len(problems) == 1:
        return problems[0]
    return "\n".join(["invalid configuration:", *("  " + p for p in problems)])


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def _show(value: Any) -> str:
    """A value as it is typed on the command line: [q_proj,v_proj], true, null."""
    if isinstance(value, list):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def check_used(cfg: BaseModel, defaults: BaseModel, keys: list[str] | None = None, origins: dict[
    str, str] | None = None,
               prefix: str = "") -> None:
    """Refuse a key set to other than the command's default (``defaults``; a resolved config.yaml
    holds every key, those at their defaults pass) that this run cannot use (config/used.py),
    naming where it was set (``origins``, as load_config records them). The demo's phases, each
    a whole command's config, are checked against their own defaults."""
    keys = keys if keys is not None else valid_keys(type(cfg))
    if isinstance(cfg, CommonConfig):
        now, default = _flat(cfg.model_dump(mode="json")), _flat(defaults.model_dump(mode="json"))
        loc = tuple(prefix.split(".")[:-1])
        for key in (k for k in now if now[k] != default.get(k)):
            for row in USED_WHEN:
                if (key.startswith(row.key) if row.key.endswith(".") else key == row.key) and not row.used(cfg):
                    where = _origin(prefix + key, origins or {})
                    # a file's key can also be set back from the command line, leaving the file as it is
                    back = f" (or override it back: {key}={_show(default.get(key))})" \
                        if where and not where.startswith("override") else ""
                    raise ConfigError((f"{where}: " if where else "") + _full_keys(
                        f"{key}={_show(now[key])} has no effect: {row.why_not.format(c=cfg)}; {row.fix} or remove it"
                        f"{back}", loc, keys))
    for name in type(cfg).model_fields:
        if isinstance(getattr(cfg, name), CommonConfig):
            check_used(getattr(cfg, name), getattr(defaults, name), keys, origins, f"{prefix}{name}.")


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    """Write the resolved config so ``--config path`` replays the run."""
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def describe_keys(cls) -> list[str]:
    """``key = default  # description`` for every dotted key of ``cls``."""
    defaults = cls().model_dump(mode="json")
    out = []
    for key in valid_keys(cls):
        node, field_cls = defaults, cls
        for part in key.split("."):
            node = node[part]
        *sections, leaf = key.split(".")
        for part in sections:
            field_cls = field_cls.model_fields[part].annotation
        desc = field_cls.model_fields[leaf].description or ""
        out.append(f"{key} = {node!r}  # {desc}")
    return out
