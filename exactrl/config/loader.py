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

from exactrl.config.schema import RENAMED

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
    """The valid key (or section) nearest to ``key``, matching sections and leaf separately: a
    misspelt section ('trian.max_steps') keeps its leaf, a misspelt leaf keeps its section."""
    *sections, leaf = key.split(".")
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
        if field is None:
            # An unknown section ('trainer: {seed: 1}'): suggest for its first key, 'train.seed'.
            probe = f"{dotted}.{next(iter(value))}" if isinstance(value, dict) and value else dotted
            raise ConfigError(f"{source}: unknown key '{dotted}'{_suggest(probe, all_keys)}")
        sub = _submodel(field.annotation)
        if sub is not None and isinstance(value, dict):
            _check_keys(sub, value, f"{dotted}.", source, all_keys)
        elif sub is not None and value is not None:
            raise ConfigError(f"{source}: '{dotted}' is a section (keys: {', '.join(valid_keys(sub))}), got {value!r}")
        elif sub is None and isinstance(value, dict):
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
    """A moved key's new path (schema.RENAMED), with a notice; other paths as given. Keys are
    matched at any depth, so the demo's rl.algo.lam moves too."""
    dotted = ".".join(path)
    for old, new in RENAMED.items():
        if dotted == old or dotted.endswith("." + old):
            warnings.warn(f"{source}: '{old}' is now '{new}'", FutureWarning, stacklevel=3)
            return path[: len(path) - len(old.split("."))] + new.split(".")
    return path


def _rename(data: dict, source: str, prefix: list[str] | None = None) -> None:
    """Move keys of a loaded YAML mapping that schema.RENAMED lists to their new place, in place."""
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
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        text = _read_text(p)
        try:
            _check_scalars(yaml.compose(text), p)
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    keys = valid_keys(cls)
    _rename(data, str(path) if path else "config")
    _check_keys(cls, data, "", str(path) if path else "config", keys)
    # Start from the command's own defaults (a demo's sft section has the demo's defaults,
    # not SFTConfig's), then the file, then the overrides in order.
    merged = _merge(cls().model_dump(), data)
    for text in overrides:
        if not _encodable(text):  # bytes that are not UTF-8 reach Python as lone surrogates
            raise ConfigError(f"override {text!r} is not valid UTF-8 text; fix the command line")
        key_path, value = parse_override(text)
        key_path = _renamed(key_path, f"override '{text}'")
        _check_keys(cls, _nest(key_path, value), "", f"override '{text}'", keys)
        if isinstance(value, (int, float)) and _is_str_field(cls, key_path):
            value = text.split("=", 1)[1]  # model.path=123 means the path "123" (bool is an int too: yes/no stay text)
        _set(merged, key_path, value)
    try:
        return cls.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_explain(e, path)) from None


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


def _check_scalars(node, p: Path) -> None:
    """A YAML escape such as "\\ud800" yields a lone surrogate, which no file, tokenizer or
    log can hold: refuse it at its line. Iterative, each node once (aliases share nodes)."""
    stack, seen = [node] if node is not None else [], set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n, yaml.ScalarNode):
            if not _encodable(n.value):
                raise ConfigError(f"{p}:{n.start_mark.line + 1}: {n.value!r} holds a lone surrogate "
                                  "(not valid Unicode text)")
        elif isinstance(n, yaml.MappingNode):
            stack.extend(x for pair in n.value for x in pair)
        else:
            stack.extend(n.value)


def _is_str_field(cls: type[BaseModel], path: list[str]) -> bool:
    for part in path[:-1]:
        cls = _submodel(cls.model_fields[part].annotation)
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


def _explain(e: ValidationError, path) -> str:
    lines = [f"invalid configuration{f' in {path}' if path else ''}:"]
    for err in e.errors():
        if err["type"] == "value_error":  # our own cross-field checks name their keys within their section
            msg = err["msg"].removeprefix("Value error, ")
            if err["loc"]:  # e.g. the demo's 'sft' section: train.x -> sft.train.x
                prefix = ".".join(str(x) for x in err["loc"]) + "."
                msg = re.sub(r"(?<![\w.])([a-z_]+\.[a-z_]+)", lambda m: prefix + m.group(1), msg)
            lines.append("  " + msg)
            continue
        key = ".".join(str(x) for x in err["loc"])
        lines.append(f"  {key}: {err['msg']} (given: {err['input']!r})")
    if len(lines) == 2:  # one problem: one line
        return f"{lines[0]} {lines[1].strip()}"
    return "\n".join(lines)


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    """Write the resolved config so ``--config path`` replays the run."""
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
