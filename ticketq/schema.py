"""Classification schemas: the closed questions ("fields") asked of every ticket, and the shape of
their answers.

A schema names one or more fields. Each field has an instruction, a closed set of labels (each
with an optional short description that goes into the prompt), single-label (exactly one label,
the most probable) or multi-label (every label its own yes/no probability, chosen above `select`),
and a confidence threshold: an answer whose confidence is below it is flagged for review.

Schemas are written in TOML (`examples/schema.toml`) and read with `load_schema`, which reports
every problem at once, one line each, in a `SchemaError`. `default_schema(labels, system_prompt)`
is the single field a worker classifies with when it is given no schema (`TICKETQ_LABELS`, the
system prompt): the prompt, and so every answer, is the one ticketq has always computed.

The contract layer: plain Python, no torch; producers may validate a schema before sending it.

    name = "support"                      # how results and, later, messages name the schema
    system = "You route support tickets." # optional; the shared instructions before the fields
    truncation = "head+tail"              # optional: head (default), tail or head+tail

    [fields.category]
    instruction = "Which team should handle the ticket?"
    labels = { billing = "charges, invoices, refunds", technical = "bugs, errors", account = "login, profile" }
    threshold = 0.2                       # review when the top label leads the runner-up by less

    [fields.topics]
    instruction = "Which topics does the ticket mention?"
    labels = ["refund", "outage", "password"]
    multi = true                          # each label yes/no; chosen when p(yes) > select (0.5)
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from ticketq.contract import SCHEMA_NAME
from ticketq.errors import TicketqError
from ticketq.fieldanswers import FieldResult, TicketFields  # the answers' shape, re-exported here

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

__all__ = [
    "DEFAULT_FIELD",
    "DEFAULT_SCHEMA_NAME",
    "DEFAULT_SYSTEM",
    "LAYOUTS",
    "TRUNCATIONS",
    "Field",
    "FieldResult",
    "Schema",
    "SchemaError",
    "TicketFields",
    "default_schema",
    "load_schema",
    "parse_schema",
    "truncate",
]

T = TypeVar("T")

# How a ticket longer than the token limit is cut: keep its start (what ticketq always did), its
# end (where a reply thread puts the newest message), or both ends, half the limit each.
TRUNCATIONS = ("head", "tail", "head+tail")


def truncate(items: Sequence[T], limit: int, mode: str = "head") -> Sequence[T]:
    """At most `limit` of `items`: the first (`head`), the last (`tail`), or the first and last halves
    (`head+tail`). The one truncation rule: the engine cuts token ids by it, the gateway UTF-8 bytes."""
    if len(items) <= limit:
        return items
    if mode == "head":
        return items[:limit]
    if mode == "tail":
        return items[len(items) - limit :]
    if mode == "head+tail":
        tail = limit // 2
        return items[: limit - tail] + items[len(items) - tail :]
    raise ValueError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {mode!r}")
# Where the fields go in the prompt:
# - "system": one single-label field, its labels in the system prompt and the answer straight after
#   the ticket (the prompt ticketq has always used; every token but the ticket's is cached);
# - "fields": every field described in the system prompt, each answer opened by its field's name
#   after the ticket ("priority:"), so the ticket is read once for all the fields.
LAYOUTS = ("system", "fields")

DEFAULT_SCHEMA_NAME = "default"
DEFAULT_FIELD = "label"  # the default schema's one field: what results have always called `label`
DEFAULT_SYSTEM = (
    "You are a support ticket assistant. Read the customer's ticket, then answer each question about it "
    "with exactly one of the labels listed for that question."
)

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
_SCHEMA_KEYS = ("name", "system", "truncation", "layout", "fields")
_FIELD_KEYS = ("instruction", "labels", "multi", "threshold", "select", "head")


class SchemaError(TicketqError, ValueError):
    """A schema that cannot be used: `problems` holds one line per problem, all of them at once."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class Field:
    """One closed question asked of every ticket."""

    name: str
    labels: tuple[str, ...]
    instruction: str = ""
    descriptions: Mapping[str, str] = field(default_factory=dict)  # label -> short hint for the prompt
    multi: bool = False  # every label its own yes/no probability, chosen when above `select`
    threshold: float = 0.0  # review when the confidence is below it (0: never)
    select: float = 0.5  # multi-label: a label is chosen when its probability is above it
    head: str | None = None  # a label head fitted for this field (`ticketq fit --schema`): it scores the field


@dataclass(frozen=True)
class Schema:
    name: str
    fields: tuple[Field, ...]
    system: str = DEFAULT_SYSTEM  # shared instructions: the start of every field's prompt
    truncation: str | None = None  # None: the worker's setting (head unless told otherwise)
    layout: str = "fields"

    def field(self, name: str) -> Field:
        for item in self.fields:
            if item.name == name:
                return item
        raise KeyError(name)

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(item.name for item in self.fields)


def default_schema(
    labels: Sequence[str], system_prompt: str, descriptions: Mapping[str, str] | None = None
) -> Schema:
    """The single field of a worker without a schema: `TICKETQ_LABELS` and its system prompt, in the
    "system" layout, never flagged for review. Its prompt is the one ticketq has always used."""
    only = Field(DEFAULT_FIELD, tuple(labels), descriptions=dict(descriptions or {}))
    return Schema(DEFAULT_SCHEMA_NAME, (only,), system=system_prompt, truncation=None, layout="system")


def load_schema(path: str | Path) -> Schema:
    """Read and validate a TOML schema file; `SchemaError` lists every problem, one line each."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SchemaError([f"{path}: cannot read the schema: {exc}"]) from None
    schema = parse_schema(text, source=str(path))
    # a field's head file is named relative to the schema file
    fields = tuple(replace(spec, head=str(path.parent / spec.head)) if spec.head else spec for spec in schema.fields)
    return replace(schema, fields=fields)


def parse_schema(document: str | Mapping[str, Any], source: str = "schema") -> Schema:
    """A schema from TOML text or an already parsed mapping (e.g. a message's JSON), validated."""
    if isinstance(document, str):
        try:
            document = tomllib.loads(document)
        except tomllib.TOMLDecodeError as exc:
            raise SchemaError([f"{source}: not valid TOML: {exc}"]) from None
    problems = _Problems(source)
    schema = _build(document, problems)
    if problems.lines:
        raise SchemaError(problems.lines)
    assert schema is not None
    return schema


# ----- validation ----------------------------------------------------------------------------


class _Problems:
    def __init__(self, source: str) -> None:
        self.source = source
        self.lines: list[str] = []

    def add(self, where: str, message: str) -> None:
        self.lines.append(f"{self.source}: {where}: {message}")


def _build(document: object, problems: _Problems) -> Schema | None:
    if not isinstance(document, Mapping):
        problems.add("schema", f"must be a table of keys, got {type(document).__name__}")
        return None
    _unknown_keys(document, _SCHEMA_KEYS, "schema", problems)
    name = document.get("name")
    if name is None:
        problems.add("name", 'is missing: every schema needs a name (name = "support")')
    elif not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        problems.add("name", f"must be letters, digits, '_', '-' or '.' (at most 128), got {name!r}")
    elif name == DEFAULT_SCHEMA_NAME:  # clients sending no schema rely on its single-label shape
        problems.add("name", f'"{DEFAULT_SCHEMA_NAME}" is reserved for the single field of TICKETQ_LABELS; '
                             "give this schema a name of its own")  # fmt: skip
    system = document.get("system", DEFAULT_SYSTEM)
    if not isinstance(system, str) or not system.strip():
        problems.add("system", f"must be non-empty text, got {system!r}")
    truncation = document.get("truncation")
    if truncation is not None and truncation not in TRUNCATIONS:
        problems.add("truncation", f"must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
    before = len(problems.lines)
    fields = _fields(document.get("fields"), problems)
    fields_ok = len(problems.lines) == before  # else `fields` lacks the broken ones: no layout verdict on it
    layout = document.get("layout")
    if layout is None:
        one = len(fields) == 1 and not fields[0].multi
        layout = "system" if one else "fields"
    elif layout not in LAYOUTS:
        problems.add("layout", f"must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    elif layout == "system" and fields_ok and (len(fields) != 1 or fields[0].multi):
        problems.add("layout", '"system" holds exactly one single-label field; several fields need "fields"')
    if problems.lines:
        return None
    return Schema(name, tuple(fields), system=system.strip(), truncation=truncation, layout=layout)


def _fields(raw: object, problems: _Problems) -> list[Field]:
    if raw is None:
        problems.add("fields", "is missing: a schema needs at least one field ([fields.category] …)")
        return []
    if not isinstance(raw, Mapping) or not raw:
        problems.add("fields", "must be a table of one or more fields ([fields.category] …)")
        return []
    fields = []
    for name, spec in raw.items():
        where = f"field {name!r}"
        before = len(problems.lines)
        if not _NAME.fullmatch(name):
            problems.add(where, "a field name must start with a letter and hold only letters, digits, '_' or '-'")
        if not isinstance(spec, Mapping):
            problems.add(where, f"must be a table (instruction, labels, …), got {type(spec).__name__}")
            continue
        built = _field(name, spec, where, problems)
        if built is not None and len(problems.lines) == before:
            fields.append(built)
    return fields


def _field(name: str, spec: Mapping[str, Any], where: str, problems: _Problems) -> Field | None:
    _unknown_keys(spec, _FIELD_KEYS, where, problems)
    instruction = spec.get("instruction")
    if instruction is None:
        problems.add(where, "instruction is missing: the question the field asks, in one sentence")
    elif not isinstance(instruction, str) or not instruction.strip():
        problems.add(where, f"instruction must be non-empty text, got {instruction!r}")
    multi = spec.get("multi", False)
    if not isinstance(multi, bool):
        problems.add(where, f"multi must be true or false, got {multi!r}")
        multi = False
    labels, descriptions = _labels(spec.get("labels"), multi, where, problems)
    threshold = _number(spec, "threshold", 0.0, where, problems, low=0.0, high=1.0, closed=True)
    if "select" in spec and not multi:
        problems.add(where, "select applies to multi-label fields only (multi = true)")
    select = _number(spec, "select", 0.5, where, problems, low=0.0, high=1.0, closed=False)
    head = spec.get("head")
    if head is not None and (not isinstance(head, str) or not head.strip()):
        problems.add(where, f'head must be the path of a head file (head = "heads/{name}.safetensors"), got {head!r}')
    if labels is None or threshold is None or select is None or not isinstance(instruction, str):
        return None
    return Field(name, labels, instruction.strip(), descriptions, multi, threshold, select, head)


def _labels(
    raw: object, multi: bool, where: str, problems: _Problems
) -> tuple[tuple[str, ...] | None, dict[str, str]]:
    """A list of names, or a table name -> description ("" for none)."""
    if raw is None:
        problems.add(where, 'labels are missing: labels = ["a", "b"] or labels = { a = "what a means", b = "" }')
        return None, {}
    if isinstance(raw, Mapping):
        pairs = list(raw.items())
    elif isinstance(raw, list):
        pairs = [(item, "") for item in raw]
    else:
        problems.add(where, f"labels must be a list of names or a table name = description, got {type(raw).__name__}")
        return None, {}
    names_bad = [repr(name) for name, _ in pairs if not isinstance(name, str) or not name or name != name.strip()]
    descriptions_bad = [f"{name!r} = {desc!r}" for name, desc in pairs if not isinstance(desc, str)]
    if names_bad:
        problems.add(where, f"label names must be non-empty text without surrounding spaces: {', '.join(names_bad)}")
    if descriptions_bad:
        problems.add(where, f"label descriptions must be text: {', '.join(descriptions_bad)}")
    if names_bad or descriptions_bad:
        return None, {}
    names = [name for name, _ in pairs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        problems.add(where, f"label {', '.join(map(repr, duplicates))} appears more than once")
        return None, {}
    fewest = 1 if multi else 2
    if len(names) < fewest:
        kind = "a multi-label field needs at least one label" if multi else "a single-label field needs two or more"
        problems.add(where, f"{kind}, got {len(names)}")
        return None, {}
    return tuple(names), {name: desc.strip() for name, desc in pairs if desc.strip()}


def _number(
    spec: Mapping[str, Any], key: str, default: float, where: str, problems: _Problems, *, low, high, closed
) -> float | None:
    value = spec.get(key, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (low <= value <= high if closed else low < value < high)
    if not ok:
        span = f"between {low:g} and {high:g}" if closed else f"strictly between {low:g} and {high:g}"
        problems.add(where, f"{key} must be a number {span}, got {value!r}")
        return None
    return float(value)


def _unknown_keys(table: Mapping[str, Any], known: Sequence[str], where: str, problems: _Problems) -> None:
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            problems.add(where, f"unknown key {key!r}; {hint}")
