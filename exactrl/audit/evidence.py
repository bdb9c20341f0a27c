"""Reading what a past run left behind, with the line every value came from.

The run audit never runs or imports anything from a run: it reads text. Here are its records
(`Evidence`: file relative to the run directory, 1-based line, that line's text; `Reading`: a
value with its evidence; `Problem`: evidence that could not be used) and the formats it reads:
JSON/YAML documents that remember the line of every key (`Doc`), shell scripts split into
tokens that keep their lines (`shell_commands`), package lists (`pip freeze`,
`requirements.txt`, `conda list`, `pip list`) and pickles recognised by their first bytes and
never loaded (`pickle_kind`). What DeepSpeed / Accelerate configs and launcher flags say is
read in exactrl/audit/readers.py.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import yaml
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name


@dataclass(frozen=True)
class Evidence:
    file: str
    line: int | None
    text: str

    @property
    def at(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file

    def to_json(self) -> dict:
        return {"file": self.file, "line": self.line, "at": self.at, "text": self.text}


@dataclass(frozen=True)
class Reading:
    value: Any
    evidence: tuple[Evidence, ...]
    note: str = ""


@dataclass(frozen=True)
class Problem:
    kind: str  # unreadable | missing | contradiction | unresolved | ignored | inconsistent
    message: str
    evidence: tuple[Evidence, ...] = ()
    fact: str | None = None

    def to_json(self) -> dict:
        return {"kind": self.kind, "fact": self.fact, "message": self.message,
                "evidence": [e.to_json() for e in self.evidence]}


# ---------------------------------------------------------------------------- JSON / YAML


_JSON_TOKEN = re.compile(r'\s+|"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"]+')


def _json_lines(text: str) -> dict[tuple, int]:
    """Line of every object key and array element, by path (json.loads checked the syntax)."""
    tokens, line = [], 1
    for m in _JSON_TOKEN.finditer(text):
        if not m.group().isspace():
            tokens.append((m.group(), line))
        line += m.group().count("\n")
    lines: dict[tuple, int] = {}

    def value(i: int, path: tuple) -> int:
        tok = tokens[i][0]
        if tok not in "{[":
            return i + 1
        close, i, index = "}" if tok == "{" else "]", i + 1, 0
        while tokens[i][0] != close:
            if close == "}":
                key, at = json.loads(tokens[i][0]), tokens[i][1]
                lines[path + (key,)] = at
                i = value(i + 2, path + (key,))  # skip the key and the ':'
            else:
                lines[path + (index,)] = tokens[i][1]
                i, index = value(i, path + (index,)), index + 1
            if tokens[i][0] == ",":
                i += 1
        return i + 1

    if tokens:
        value(0, ())
    return lines


def _yaml_lines(node: yaml.Node | None, path: tuple = (), lines: dict | None = None) -> dict[tuple, int]:
    lines = {} if lines is None else lines
    pairs = (node.value if isinstance(node, yaml.MappingNode) else
             [(i, child) for i, child in enumerate(node.value)] if isinstance(node, yaml.SequenceNode) else [])
    for key, child in pairs:
        name, at = (key.value, key) if isinstance(key, yaml.Node) else (key, child)
        lines[path + (name,)] = at.start_mark.line + 1
        _yaml_lines(child, path + (name,), lines)
    return lines


@dataclass
class Doc:
    """A parsed document; `get` returns a value with the evidence of the line it sits on."""

    file: str
    data: Any
    lines: dict[tuple, int]
    text_lines: list[str]
    root: tuple = ()

    @classmethod
    def parse(cls, file: str, text: str, kind: str) -> Doc:
        """kind is "json" or "yaml"; raises ValueError with the parser's message on bad syntax, on
        nesting too deep for the recursive parsers and on YAML aliases that expand past MAX_NODES."""
        if _bracket_depth(text) > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
        try:
            if kind == "json":
                return cls(file, json.loads(text), _json_lines(text), text.splitlines())
            node = yaml.compose(text, Loader=yaml.SafeLoader)  # aliases stay shared here: cheap
            _bounded(node)
            return cls(file, yaml.safe_load(text), _yaml_lines(node), text.splitlines())
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ValueError(str(e).replace("\n", " ")) from None
        except RecursionError:
            raise ValueError("nested too deeply to read") from None


    def node(self, *path) -> Any:
        node = self.data
        for key in self.root + path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def has(self, *path) -> bool:
        parent = self.node(*path[:-1])
        return isinstance(parent, dict) and path[-1] in parent

    def evidence(self, *path) -> Evidence:
        line = self.lines.get(self.root + path)
        text = self.text_lines[line - 1].strip() if line else ".".join(map(str, self.root + path))
        return Evidence(self.file, line, text)

    def get(self, *path) -> tuple[Any, Evidence] | None:
        return (self.node(*path), self.evidence(*path)) if self.has(*path) else None

    def sub(self, *path) -> Doc:
        return Doc(self.file, self.data, self.lines, self.text_lines, self.root + path)

    def keys(self) -> list:
        node = self.node()
        return list(node) if isinstance(node, dict) else []


MAX_DEPTH = 500  # the parsers recurse once per level; a real config nests a handful of levels
MAX_NODES = 200_000  # a real config has a few thousand values; a YAML alias bomb expands to billions


def _bracket_depth(text: str) -> int:
    """Deepest nesting of [ and { (brackets inside strings count too: a bound, not a parse). Checked
    before parsing because the pure-Python YAML scanner takes seconds to reach a RecursionError."""
    depth = deepest = 0
    for ch in re.sub(r"[^\[\]{}]", "", text):
        depth += 1 if ch in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _bounded(root: yaml.Node | None) -> None:
    """Count the nodes the document expands to, each shared (aliased) node once per use,
    without expanding anything; a billion-laughs document is refused in microseconds."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) not in sizes:
            children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else
                        node.value if isinstance(node, yaml.SequenceNode) else [])
            sizes[id(node)] = 1 + sum(size(c) for c in children)
            if sizes[id(node)] > MAX_NODES:
                raise ValueError(f"its aliases expand to more than {MAX_NODES:,} values (an alias bomb?)")
        return sizes[id(node)]

    if root is not None:
        size(root)


# ---------------------------------------------------------------------------- shell


@dataclass(frozen=True)
class Token:
    text: str
    line: int


_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_HEREDOC = re.compile(r"<<-?\s*['\"]?([A-Za-z_]\w*)['\"]?")


def _split(piece: str) -> list[str]:
    try:
        return shlex.split(piece, comments=True)
    except ValueError:  # an unbalanced quote spanning lines: plain whitespace split is the best guess
        return piece.split()


def shell_commands(text: str) -> list[list[Token]]:
    """Commands of a shell script (or a pasted command line), each token carrying its line.

    Handles `\\` continuations, `VAR=value` assignments and OpenRLHF's own example style,
    `read -r -d '' training_commands <<EOF ... EOF` then `deepspeed --module $training_commands`,
    where the expanded tokens keep the lines of the here-document."""
    return _commands(list(enumerate(text.splitlines(), start=1)), {})


def _commands(numbered: list[tuple[int, str]], env: dict[str, list[Token]]) -> list[list[Token]]:
    commands, current, i = [], [], 0
    while i < len(numbered):
        number, raw = numbered[i]
        i += 1
        stripped = raw.rstrip()
        continued = stripped.endswith("\\")
        piece = stripped[:-1] if continued else stripped
        heredoc = _HEREDOC.search(piece) if not current else None
        if heredoc:
            end = next((j for j in range(i, len(numbered)) if numbered[j][1].strip() == heredoc.group(1)),
                       len(numbered))
            body, i = numbered[i:end], end + 1
            read = re.match(r"^\s*read\b.*\s([A-Za-z_]\w*)\s*<<", piece)
            if read:
                env[read.group(1)] = [t for command in _commands(body, env) for t in command]
            continue
        assignment = _ASSIGN.match(piece.strip()) if not current and not continued else None
        if assignment and len(_split(assignment.group(2))) <= 1:  # `X=1 cmd` is a command, not an assignment
            env[assignment.group(1)] = [Token(w, number) for w in _split(assignment.group(2))]
            continue
        for word in _split(piece):
            current.extend(_expand(word, number, env))
        if not continued and current:
            commands.append(current)
            current = []
    if current:
        commands.append(current)
    return commands


def _expand(word: str, number: int, env: dict[str, list[Token]]) -> list[Token]:
    """A word that is one variable becomes its tokens (with their lines); otherwise substitute text."""
    alone = re.fullmatch(r"\$\{?([A-Za-z_]\w*)\}?", word)
    if alone and alone.group(1) in env:
        return list(env[alone.group(1)])
    text = _VAR.sub(lambda m: " ".join(t.text for t in env[m.group(1) or m.group(3)])
                    if (m.group(1) or m.group(3)) in env else m.group(2) if m.group(2) is not None else m.group(0),
                    word)
    return [Token(text, number)]


# ---------------------------------------------------------------------------- package lists


@dataclass(frozen=True)
class Pin:
    name: str  # canonical (lower case, dashes)
    spec: str  # "==0.15.4", ">=0.15,<0.16", "" when unpinned or installed from a URL
    line: int
    text: str


_CONDA_ROW = re.compile(r"^([A-Za-z0-9_.\-]+)\s+(\S+)(?:\s+\S+){0,2}\s*$")


def package_list_kind(name: str, text: str) -> str | None:
    """"table" (conda list, pip list), "freeze" (pip freeze) or "requirements" (pins, maybe
    ranges, maybe partial), or None when the text is not a package list."""
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    body = [s for s in lines if not s.startswith("#")]
    if any(s.startswith("# packages in environment at") for s in lines[:3]) or (
            body and re.match(r"^Package\s+Version\b", body[0])):
        return "table"
    if body and all(s.count("=") >= 2 and "==" not in s and " " not in s for s in body):
        return "table"  # conda list --export: name=version=build
    pins = sum(bool(re.match(r"^[A-Za-z0-9_.\-\[\],]+\s*(==|>=|<=|~=|!=|>|<| @ )", s)) for s in body)
    exact = sum(bool(re.match(r"^[A-Za-z0-9_.\-\[\],]+==[^=,;*]+$", s)) for s in body)
    if "requirement" in name.lower():
        # Exact pins of a whole environment are a freeze saved under another name; a few
        # hand-written pins are not a claim about what else was (not) installed.
        return "freeze" if exact == len(body) >= MIN_FREEZE_PINS else "requirements"
    return "freeze" if pins >= max(1, len(body) // 2) else None


MIN_FREEZE_PINS = 20  # a training environment's freeze lists well over a hundred packages
_EDITABLE_NOTE = re.compile(r"^#\s*Editable install with no version control \(([A-Za-z0-9_.\-]+)==([^)\s]+)\)")
_ARCHIVE = re.compile(r"/([A-Za-z0-9_.]+?)-(\d[^-/]*?)(?:-[^/]*)?\.(?:whl|tar\.gz|zip)$")


def package_pins(text: str, kind: str) -> list[Pin]:
    """Versions a package list states. Besides `name==version` rows: pip freeze's comment
    `# Editable install with no version control (name==version)`, a wheel or sdist named by URL
    (`name @ file:///.../name-1.2.3-py3-none-any.whl`), and `-e git+URL@commit#egg=name` whose
    spec is `@commit` (no version: the commit says which release it belongs to)."""
    pins = []
    for number, raw in enumerate(text.splitlines(), start=1):
        s = raw.strip()
        editable = _EDITABLE_NOTE.match(s)
        if editable:
            pins.append(Pin(canonicalize_name(editable.group(1)), f"=={editable.group(2)}", number, s))
        if not s or s.startswith("#"):
            continue
        if kind == "table":  # `name version [build [channel]]`, or `name=version=build` (--export)
            row = s.split("=") if "=" in s and " " not in s else s.split() if _CONDA_ROW.match(s) else []
            if len(row) >= 2:
                pins.append(Pin(canonicalize_name(row[0]), f"=={row[1]}", number, s))
        elif s.startswith(("-e ", "--editable")):  # installed from a checkout: no version
            egg, commit = re.search(r"#egg=([A-Za-z0-9_.\-]+)", s), re.search(r"@([0-9a-f]{7,40})#", s)
            spec = f"@{commit.group(1)}" if commit else ""
            pins += [Pin(canonicalize_name(egg.group(1)), spec, number, s)] if egg else []
        elif not s.startswith("-"):  # (skips pip options such as --index-url)
            try:
                req = Requirement(s.split(" #")[0])
            except InvalidRequirement:
                continue
            archive = _ARCHIVE.search(req.url or "")
            named = archive and canonicalize_name(archive.group(1)) == canonicalize_name(req.name)
            spec = f"=={unquote(archive.group(2))}" if named else "" if req.url else str(req.specifier)
            pins.append(Pin(canonicalize_name(req.name), spec, number, s))
    return pins


# ---------------------------------------------------------------------------- pickles


def pickle_kind(head: bytes) -> str | None:
    """What a binary file is, if it is a pickle we must not load (unpickling executes code)."""
    if len(head) >= 2 and head[0] == 0x80 and head[1] in (2, 3, 4, 5):
        return f"a pickle (protocol {head[1]})"
    if head[:4] == b"PK\x03\x04":
        return "a torch.save zip archive (it holds a pickle)"
    return None


@dataclass
class Collected:
    """Everything read from one run: readings per fact, problems, "auto" values to resolve."""

    readings: dict[str, list[Reading]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    autos: list[tuple[str, Evidence]] = field(default_factory=list)
    weak: dict[str, list[Reading]] = field(default_factory=dict)

    def add(self, fact: str, value: Any, *evidence: Evidence, note: str = "") -> None:
        self.readings.setdefault(fact, []).append(Reading(value, tuple(evidence), note))

    def add_weak(self, fact: str, value: Any, *evidence: Evidence, note: str = "") -> None:
        """A reading used only when nothing else tells the fact (an absence, e.g. deepspeed: null)."""
        self.weak.setdefault(fact, []).append(Reading(value, tuple(evidence), note))

    def problem(self, kind: str, message: str, *evidence: Evidence, fact: str | None = None) -> None:
        self.problems.append(Problem(kind, message, tuple(evidence), fact))

    def value(self, fact: str, got: tuple[Any, Evidence], note: str = "") -> None:
        """Record a whole number (or the offload device); "auto" is kept aside and resolved, or
        reported, once the whole run is read."""
        raw, evidence = got
        if isinstance(raw, str) and raw.strip().lower() == "auto":
            self.autos.append((fact, evidence))
            return
        value = str(raw).lower() if fact == "offload_optimizer" else whole(raw)
        if value is None:
            self.problem("unreadable", f"{evidence.at}: {fact} is not a whole number ({raw!r})", evidence, fact=fact)
        else:
            self.add(fact, value, evidence, note=note)


def whole(value: Any) -> int | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
        return int(value)
    return int(value) if isinstance(value, str) and value.strip().isdigit() else None


def true(value: Any) -> bool:
    return value is True or str(value).lower() in ("true", "1", "yes")
