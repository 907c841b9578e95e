"""Schemas (`ticketq.schema`): the TOML format, every problem reported at once, the default schema,
and the answer shapes. Plain Python: no model here (the engine side is tests/unit/test_fields.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ticketq.names import DEFAULT_LABELS
from ticketq.schema import (
    DEFAULT_FIELD,
    Field,
    FieldResult,
    SchemaError,
    TicketFields,
    default_schema,
    load_schema,
    parse_schema,
)

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
name = "support"
truncation = "tail"

[fields.category]
instruction = "Which team should handle the ticket?"
labels = { billing = "charges, invoices", technical = "", account = "login, profile" }
threshold = 0.2

[fields.sentiment]
instruction = "How does the customer feel?"
labels = ["positive", "neutral", "negative"]

[fields.topics]
instruction = "Which topics does the ticket mention?"
labels = ["refund", "outage"]
multi = true
select = 0.6
"""


FIELD_A = 'name = "x"\n[fields.a]\ninstruction = "q"\n'


def problems_of(text: str) -> list[str]:
    with pytest.raises(SchemaError) as info:
        parse_schema(text, source="s.toml")
    assert str(info.value) == "\n".join(info.value.problems)
    return list(info.value.problems)


def test_a_schema_reads_in_order_with_every_setting():
    schema = parse_schema(GOOD)
    assert schema.name == "support" and schema.truncation == "tail" and schema.layout == "fields"
    assert schema.field_names == ("category", "sentiment", "topics")
    category = schema.field("category")
    assert category.labels == ("billing", "technical", "account")
    assert category.descriptions == {"billing": "charges, invoices", "account": "login, profile"}
    assert (category.multi, category.threshold) == (False, 0.2)
    assert schema.field("sentiment").threshold == 0.0  # never reviewed unless asked
    topics = schema.field("topics")
    assert (topics.multi, topics.select, topics.labels) == (True, 0.6, ("refund", "outage"))


def test_the_example_schema_is_valid():
    schema = load_schema(ROOT / "examples" / "schema.toml")
    assert schema.field_names == ("category", "priority", "sentiment")
    assert all(not spec.multi and 0 < spec.threshold < 1 for spec in schema.fields)
    assert schema.truncation == "head+tail"


def test_the_multi_label_example_schema_is_valid():
    schema = load_schema(ROOT / "examples" / "schema-topics.toml")
    topics = schema.field("topics")
    assert topics.multi and topics.select == 0.5 and len(topics.descriptions) == len(topics.labels) == 4
    assert schema.layout == "fields" and schema.truncation == "tail"


def test_one_single_label_field_defaults_to_the_system_layout():
    one = parse_schema('name = "x"\n[fields.team]\ninstruction = "Which team?"\nlabels = ["a", "b"]\n')
    assert one.layout == "system"
    multi = parse_schema('name = "x"\n[fields.t]\ninstruction = "Which?"\nlabels = ["a"]\nmulti = true\n')
    assert multi.layout == "fields"


def test_every_problem_is_reported_at_once_one_line_each():
    text = """
name = "bad name!"
truncation = "middle"
colour = "blue"

[fields.category]
instruction = ""
labels = ["billing", "billing"]
threshold = 2

[fields.priority]
instruction = "How urgent?"
labels = ["high"]
treshold = 0.1

[fields.sentiment]
instruction = "How does the customer feel?"
labels = "positive, negative"
select = 0.4

[fields."9lives"]
instruction = "x"
labels = ["a", "b"]
multi = "yes"
"""
    problems = problems_of(text)
    expected = [
        "s.toml: schema: unknown key 'colour'",
        "s.toml: name: must be letters, digits",
        "s.toml: truncation: must be one of head, tail, head+tail, got 'middle'",
        "s.toml: field 'category': instruction must be non-empty text",
        "s.toml: field 'category': label 'billing' appears more than once",
        "s.toml: field 'category': threshold must be a number between 0 and 1, got 2",
        "s.toml: field 'priority': unknown key 'treshold'; did you mean 'threshold'?",
        "s.toml: field 'priority': a single-label field needs two or more, got 1",
        "s.toml: field 'sentiment': labels must be a list of names or a table name = description, got str",
        "s.toml: field 'sentiment': select applies to multi-label fields only",
        "s.toml: field '9lives': a field name must start with a letter",
        "s.toml: field '9lives': multi must be true or false, got 'yes'",
    ]
    for want in expected:
        assert sum(line.startswith(want) for line in problems) == 1, (want, problems)
    assert len(problems) == len(expected), problems
    assert all("\n" not in line for line in problems)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[fields.a]\ninstruction = "q"\nlabels = ["x", "y"]\n', "name: is missing"),
        ('name = "x"\n', "fields: is missing"),
        ('name = "x"\nfields = {}\n', "fields: must be a table of one or more fields"),
        ('system = "  "\n' + FIELD_A + 'labels = ["x", "y"]\n', "system: must be non-empty"),
        ('name = "x"\n[fields.a]\nlabels = ["x", "y"]\n', "field 'a': instruction is missing"),
        ('name = "x"\n[fields.a]\ninstruction = "q"\n', "field 'a': labels are missing"),
        (FIELD_A + 'labels = [" x", "y"]\n', "label names must be non-empty text without surrounding spaces: ' x'"),
        (FIELD_A + 'labels = {x = 1, y = ""}\n', "label descriptions must be text: 'x' = 1"),
        ('name = "x"\n[fields.a]\ninstruction = "q"\nlabels = ["x"]\nmulti = true\nselect = 1\n', "select must be"),
        ('name = "x"\n[fields.a]\ninstruction = "q"\nlabels = ["x", "y"]\nthreshold = true\n', "threshold must be"),
        ('name = "x"\nfields = 3\n', "fields: must be a table"),
        ('name = "x"\n[fields]\na = 3\n', "field 'a': must be a table"),
        ('name = "x"\nlayout = "system"\n[fields.a]\ninstruction = "q"\nlabels = ["x", "y"]\n'
         '[fields.b]\ninstruction = "q"\nlabels = ["x", "y"]\n', 'layout: "system" holds exactly one'),
        ('name = "x"\nlayout = "grid"\n[fields.a]\ninstruction = "q"\nlabels = ["x", "y"]\n', "layout: must be one of"),
        ("name = [", "s.toml: not valid TOML"),
        ('name = "default"\n[fields.a]\ninstruction = "q"\nlabels = ["x", "y"]\n', '"default" is reserved'),
    ],
)  # fmt: skip
def test_each_problem_names_its_place(text, message):
    problems = problems_of(text)
    assert len(problems) == 1, problems
    assert message in problems[0]


def test_a_broken_field_gets_no_second_verdict_from_the_layout():
    text = 'name = "x"\nlayout = "system"\n[fields.a]\ninstruction = "q"\nlabels = ["x"]\n'
    assert problems_of(text) == ["s.toml: field 'a': a single-label field needs two or more, got 1"]


def test_a_missing_file_is_a_schema_error(tmp_path):
    with pytest.raises(SchemaError, match=r"cannot read the schema"):
        load_schema(tmp_path / "nope.toml")
    assert issubclass(SchemaError, ValueError)


def test_a_parsed_mapping_is_validated_as_toml_is():
    schema = parse_schema({"name": "m", "fields": {"a": {"instruction": "q", "labels": ["x", "y"]}}})
    assert schema.field_names == ("a",)
    with pytest.raises(SchemaError, match="field 'a': labels are missing"):
        parse_schema({"name": "m", "fields": {"a": {"instruction": "q"}}})


def test_default_schema_is_todays_single_field():
    schema = default_schema(DEFAULT_LABELS, "Route tickets.", {"billing": "money"})
    assert schema.layout == "system" and schema.truncation is None
    (only,) = schema.fields
    assert only == Field(DEFAULT_FIELD, DEFAULT_LABELS, descriptions={"billing": "money"})
    assert only.threshold == 0.0 and not only.multi  # never flagged for review
    assert schema.system == "Route tickets."


def test_single_label_result_margin_and_review():
    spec = Field("priority", ("low", "high", "urgent"), threshold=0.3)
    result = FieldResult.single(spec, {"low": 0.2, "high": 0.45, "urgent": 0.35})
    assert (result.label, result.labels) == ("high", ("high",))
    assert result.confidence == pytest.approx(0.10)
    assert result.review
    assert result.to_json() == {"label": "high", "probs": result.probs, "confidence": result.confidence, "review": True}
    sure = FieldResult.single(spec, {"low": 0.05, "high": 0.9, "urgent": 0.05})
    assert not sure.review


def test_multi_label_result_chooses_above_select_and_reviews_the_weakest_decision():
    spec = Field("topics", ("refund", "outage", "password"), multi=True, threshold=0.5, select=0.5)
    result = FieldResult.several(spec, {"refund": 0.9, "outage": 0.6, "password": 0.1})
    assert result.label is None and result.labels == ("refund", "outage")
    assert result.confidence == pytest.approx(0.2)  # outage: |0.6 - 0.5| / 0.5
    assert result.review
    assert result.to_json()["labels"] == ["refund", "outage"] and "label" not in result.to_json()
    skewed = Field("topics", ("refund",), multi=True, select=0.8)
    assert FieldResult.several(skewed, {"refund": 0.0}).confidence == pytest.approx(1.0)


def test_ticket_fields_json_says_how_it_was_truncated():
    spec = Field("team", ("a", "b"), threshold=0.5)
    answer = FieldResult.single(spec, {"a": 0.6, "b": 0.4})
    whole = TicketFields("s", {"team": answer}, tokens=12, ticket_tokens=12, truncation=None)
    assert not whole.truncated and whole.review
    cut = TicketFields("s", {"team": answer}, tokens=512, ticket_tokens=900, truncation="head+tail")
    assert cut.to_json() == {
        "schema": "s", "fields": {"team": answer.to_json()}, "review": True,
        "truncated": True, "truncation": "head+tail", "tokens": 512, "ticket_tokens": 900,
    }  # fmt: skip


def test_the_schema_module_imports_nothing_heavy():
    code = "import sys, ticketq.schema; print(sorted(m for m in ('torch', 'worker', 'celery') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"
