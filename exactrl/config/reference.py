"""docs/configuration.md, generated from the schema: every key of every command with its type, default,
description (the Field's own), the other frameworks' names the loader knows for it (schema_rl.ALIASES), its old
names (schema_rl.RENAMED) and when it is refused for having no effect (used.USED_WHEN). `exactrl config docs`
writes it, and docs/exit-codes.md from exactrl/run/exits.py (cli.generated_pages: config/ imports nothing of run/);
tests/test_reference.py fails when the committed files differ. A key's text lives in the schema only: edit the
Field, then regenerate."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel

from exactrl.config.loader import _submodel, valid_keys
from exactrl.config.schema import CommonConfig
from exactrl.config.schema_rl import ALIASES, RENAMED
from exactrl.config.used import USED_WHEN

REGENERATE = "exactrl config docs"
CONFIGURATION = "configuration.md"

INTRO = f"""# Configuration reference

<!-- Generated from exactrl/config/schema*.py and exactrl/config/used.py by `{REGENERATE}`; do not edit by hand:
     change the Field's description (or the USED_WHEN row) and run `{REGENERATE}` from the repository root.
     tests/test_reference.py fails while this file differs from what the schema generates. -->

*Generated from the schema by `{REGENERATE}`; edit the schema, not this page.*

A config is a YAML file of sections (`--config FILE`); any key can also be set on the command line as
`section.key=value`, applied after the file, in order. `exactrl config <command>` prints every key with its
default; `exactrl config check FILE` validates a file and prints its plan without running it.

- An unknown key is refused, naming the closest valid one. The names TRL, peft and OpenRLHF use for a setting
  (`learning_rate`, `lora_alpha`, `num_generations`...) are not accepted, but the error names exactrl's key for
  them: they are listed below as **other names**.
- A key that moved still loads under its **former name**, with a notice.
- A key set to anything but its default in a run where it has no effect is refused, saying why and what would
  use it (**refused when**; one table, `USED_WHEN` in exactrl/config/used.py).
- Wrong types and impossible combinations (batch sizes that do not divide, a group split across steps) fail
  before any model loads, each error led by where the value came from (`file.yaml:LINE` or the override).

Types: `int ≥ 1` is an integer of at least 1, `float in (0, 1]` a number above 0 and at most 1, `a | b` one of
those words, *optional* a key that may be left unset (`null`, the default of such keys unless given).
"""


def _bounds(field) -> str:
    lower = upper = ""
    for m in field.metadata:
        if isinstance(m, at.Ge):
            lower = f"[{m.ge}"
        elif isinstance(m, at.Gt):
            lower = f"({m.gt}"
        elif isinstance(m, at.Le):
            upper = f"{m.le}]"
        elif isinstance(m, at.Lt):
            upper = f"{m.lt})"
    if lower and upper:
        return f" in {lower}, {upper}"
    if lower:
        return (" ≥ " if lower[0] == "[" else " > ") + lower[1:]
    if upper:
        return (" ≤ " if upper[-1] == "]" else " < ") + upper[:-1]
    return ""


def _type_name(ann) -> str:
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args if a is not type(None))
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(ann, "__name__", str(ann))


def type_text(field) -> str:
    """A field's type as a reader types it: `int ≥ 1`, `fp32 | bf16`, `list[str]`, optional."""
    optional = type(None) in get_args(field.annotation)
    return _code(_type_name(field.annotation) + _bounds(field)) + (", optional" if optional else "")


def value_text(value) -> str:
    """A default as it is written in YAML or on the command line: [q_proj,v_proj], true, ''."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return value or "''"
    return repr(value)


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def _default(value) -> str:
    return _code(value_text(value))


_KEY = re.compile(r"(?<![\w./-])([a-z_]+(?:\.(?:[a-z_0-9]+|\*))+)(='[^']*'|=[^\s;)]*)?")
_ESCAPE = re.compile(r"[|*<~\\]|(?<!\w)_|_(?!\w)")


class Prose:
    """Turns a description into Markdown that renders as written: the config's keys in code spans, the
    characters Markdown would read as markup (`*`, `|` in a table, `<run>`, `~`) escaped."""

    def __init__(self, keys: set[str]):
        sections = {k.rsplit(".", i)[0] for k in keys for i in range(1, k.count(".") + 1)}
        self.known = keys | sections | {s + ".*" for s in sections}

    def __call__(self, text: str) -> str:
        return "".join(part if part.startswith("`") else self._plain(part)
                       for part in re.split(r"(`[^`]*`)", text) if part)

    def _plain(self, text: str) -> str:
        out, last = [], 0
        for m in _KEY.finditer(text):
            if m.group(1) not in self.known:
                continue
            value = m.group(2) or ""
            value = value if value.endswith("'") else value.rstrip(".,:")
            out += [_ESCAPE.sub(lambda e: "\\" + e.group(0), text[last:m.start()]), _code(m.group(1) + value)]
            last = m.start() + len(m.group(1)) + len(value)
        return "".join(out) + _ESCAPE.sub(lambda e: "\\" + e.group(0), text[last:])


def _rule(row) -> str:
    """A USED_WHEN row as a sentence: its why_not (a message formatted with the run's config) with each
    placeholder, '{c.algo.name}' or 'algo.name={c.algo.name}', read as 'the chosen algo.name'."""
    why = re.sub(r"(?:\b([\w.]+)=)?\{c\.([\w.]+)\}", lambda m: f"the chosen {m.group(2)}", row.why_not)
    return f"{why}; {row.fix}"


def _doc(cls) -> str:
    return " ".join((cls.__dict__.get("__doc__") or "").split())


class _Table:
    """One section (a Section class at one dotted path) with the commands that use it and their defaults."""

    def __init__(self, path: str, cls: type[BaseModel], description: str, checked: bool):
        self.path, self.cls, self.description, self.checked = path, cls, description, checked
        self.commands: list[str] = []
        self.defaults: dict[str, dict] = {}  # command -> this section's defaults in that command
        self.title, self.anchor = "", None

    @property
    def leaves(self) -> list[str]:
        return [n for n, f in self.cls.model_fields.items() if _submodel(f.annotation) is None]

    def identity(self) -> tuple:
        fields = self.cls.model_fields
        return self.path, tuple((n, fields[n].description, type_text(fields[n])) for n in self.leaves)


def _walk(cls: type[BaseModel], defaults: dict, path: str, description: str, checked: bool, out: list) -> None:
    """The sections of ``cls`` in declaration order (its own keys first; the root's last), and the whole command
    configs nested in it (a pipeline's phases) as ('phase', path, class, description, defaults)."""
    subs = []
    for name, field in cls.model_fields.items():
        sub = _submodel(field.annotation)
        if sub is None:
            continue
        key = f"{path}.{name}" if path else name
        if issubclass(sub, CommonConfig) and path == "" and not issubclass(cls, CommonConfig):
            out.append(("phase", key, sub, field.description or "", defaults[name]))
        else:
            subs.append((sub, defaults[name], key, field.description or ""))
    own = ("table", path, cls, description, defaults, checked)
    if path:
        out.append(own)
    for sub, sub_defaults, key, desc in subs:
        _walk(sub, sub_defaults, key, desc, checked, out)
    if not path and any(_submodel(f.annotation) is None for f in cls.model_fields.values()):
        out.append(own)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


class _Slugs:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as '-', repeats numbered."""

    def __init__(self):
        self.seen: dict[str, int] = {}

    def __call__(self, heading: str) -> str:
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = self.seen.get(slug, 0)
        self.seen[slug] = n + 1
        return f"{slug}-{n}" if n else slug


def render(commands: dict[str, type[BaseModel]]) -> str:
    """docs/configuration.md for ``commands`` (name -> config class, cli.COMMANDS)."""
    prose, slug = Prose({k for cls in commands.values() for k in valid_keys(cls)}), _Slugs()
    command_of = {cls: name for name, cls in commands.items()}
    walked = {name: [] for name in commands}
    for name, cls in commands.items():
        _walk(cls, cls().model_dump(mode="json"), "", _doc(cls), issubclass(cls, CommonConfig), walked[name])

    tables: dict[tuple, _Table] = {}  # by identity: one table for a section several commands share
    for name, items in walked.items():
        for kind, path, cls, desc, defaults, *rest in items:
            if kind == "table":
                table = _Table(path, cls, desc, rest[0])
                table = tables.setdefault(table.identity(), table)
                table.commands.append(name)
                table.defaults[name] = defaults
    shared_paths = [t.path for t in tables.values()]
    nesting = {name: [c for c, items in walked.items() if any(i[0] == "phase" and command_of[i[2]] == name
                                                                for i in items)] for name in commands}

    out, anchors = [INTRO], {}
    for name, cls in commands.items():
        anchors[name] = slug(f"`exactrl {name}`")
        out.append(f"\n## `exactrl {name}`\n\n{prose(_doc(cls))}\n")
        contents, body = [], []
        for kind, path, sub, desc, defaults, *_ in walked[name]:
            if kind == "phase":
                title = f"`{path}.*`"
                body.append(_phase(title, path, sub, desc, defaults, command_of[sub], anchors, prose))
                contents.append(f"[{title}](#{slug(title)})")
                continue
            table = tables[_Table(path, sub, desc, False).identity()]
            if table.anchor is None:  # first met here: written here, linked from the other commands
                table.title = f"`{path}`" if path else "top-level keys"
                if shared_paths.count(path) > 1:  # e.g. eval's model section is not sft's and rl's
                    table.title += f" ({', '.join(table.commands)})"
                table.anchor = slug(table.title)
                body.append(_table(table, prose, list(dict.fromkeys(n for c in table.commands for n in nesting[c]))))
            contents.append(f"[{table.title}](#{table.anchor})")
        out.append("\nSections: " + ", ".join(contents) + ".\n")
        out += body
    return "".join(out).rstrip() + "\n"


def _used_by(table: _Table, nested: list[str]) -> str:
    also = f", and by the phases of {', '.join(f'`exactrl {c}`' for c in nested)} that nest them" if nested else ""
    return "Used by " + ", ".join(f"`exactrl {c}`" for c in table.commands) + also + "."


def _table(table: _Table, prose: Prose, nested: list[str]) -> str:
    prefix = table.path + "." if table.path else ""
    lines = [f"\n### {table.title}\n"]
    about = " ".join(x for x in (table.description, _doc(table.cls)) if x) if table.path else ""
    lines.append((prose(about) + " " if about else "") + _used_by(table, nested))
    if table.checked:
        for row in USED_WHEN:
            if row.key.endswith(".") and prefix.startswith(row.key):
                lines.append(f"\n**Refused when it has no effect** (any key here): {prose(_rule(row))}.")
    lines += ["", "| key | type | default | description |", "|---|---|---|---|"]
    fields = table.cls.model_fields
    for leaf in table.leaves:
        key = prefix + leaf
        values = {c: table.defaults[c][leaf] for c in table.commands}
        if len({value_text(v) for v in values.values()}) == 1:
            default = _default(next(iter(values.values())))
        else:
            default = "; ".join(f"{_default(v)} ({c})" for c, v in values.items())
        notes = [prose(fields[leaf].description or "")]
        names = [(a, how) for a, (target, how) in ALIASES.items() if target == key]
        if names:
            hows = list(dict.fromkeys(how.strip() for _, how in names if how.strip()))
            notes.append("**Other names:** " + ", ".join(f"`{a}`" for a, _ in names)
                         + (" " + " ".join(prose(h) for h in hows) if hows else ""))
        old = [o for o, new in RENAMED.items() if new == key]
        if old:
            notes.append("**Former name:** " + ", ".join(f"`{o}`" for o in old) + " (still loads, with a notice)")
        if table.checked:
            notes += [f"**Refused when:** {prose(_rule(row))}" for row in USED_WHEN if row.key == key]
        lines.append(f"| `{key}` | {type_text(fields[leaf])} | {default} | {'<br>'.join(notes)} |")
    return "\n".join(lines) + "\n"


def _phase(title: str, path: str, cls, description: str, defaults: dict, command: str, anchors: dict,
           prose: Prose) -> str:
    own = _flat(cls().model_dump(mode="json"))
    here = _flat(defaults)
    differ = [k for k in here if value_text(here[k]) != value_text(own.get(k))]
    lines = [f"\n### {title}\n", f"{prose(description)} Every key of [`exactrl {command}`](#{anchors[command]}) "
             f"under `{path}.` (e.g. `{path}.{next(iter(own))}`)"
             + (", with the defaults of `exactrl " + command + "` except:" if differ else
                ", with the defaults of `exactrl " + command + "`.")]
    if differ:
        lines += ["", f"| key | default here | `exactrl {command}`'s |", "|---|---|---|"]
        lines += [f"| `{path}.{k}` | {_default(here[k])} | {_default(own.get(k))} |" for k in differ]
    return "\n".join(lines) + "\n"


def write_docs(pages: dict[str, str], out: Path, check: bool) -> tuple[int, str]:
    """Write the generated ``pages`` (file name -> text, cli.generated_pages) into ``out``; with ``check``, write
    nothing and say which differ. Returns the exit code and the line to print."""
    if check:
        stale = [name for name, text in pages.items()
                 if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != text]
        if stale:
            return 1, (f"{', '.join(str(out / n) for n in stale)} {'differs' if len(stale) == 1 else 'differ'} from "
                       "what the schema generates; run "
                       f"`{REGENERATE}` and commit the result")
        return 0, f"{', '.join(str(out / n) for n in pages)} are up to date"
    out.mkdir(parents=True, exist_ok=True)
    for name, text in pages.items():
        (out / name).write_text(text, encoding="utf-8")
    return 0, "wrote " + ", ".join(f"{out / n} ({len(t.encode()):,} bytes)" for n, t in pages.items())
