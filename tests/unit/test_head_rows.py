"""The rows `ticketq fit` trains on (pure: no model, no Redis): `expected` as a label or as the
{field: label} object `ticketq reviews export` writes, read for the single field or for a schema;
review decisions without text, and rows naming another schema, left out with why."""

from __future__ import annotations

import json

import pytest

from ticketq.schema import parse_schema
from ticketq_cli.fitrows import field_labels, read_file, read_reviews, single_label

SCHEMA = parse_schema("""
name = "support"
[fields.team]
instruction = "Which team?"
labels = ["billing", "technical"]
[fields.topics]
instruction = "Which topics?"
labels = ["refund", "outage"]
multi = true
""")


def test_a_single_label_is_the_label_or_the_objects_one_field():
    assert single_label("billing") == single_label({"team": "billing"}) == "billing"
    for bad in ({"team": "billing", "topics": ["refund"]}, {"topics": ["refund"]}, None, "", {}):
        with pytest.raises(ValueError, match="no single `expected` label"):
            single_label(bad)


def test_a_schemas_rows_are_parsed_field_by_field():
    parse = field_labels(SCHEMA)
    assert parse({"team": "billing", "topics": ["outage", "refund"]}) == {"team": "billing",
                                                                           "topics": ("refund", "outage")}
    with pytest.raises(ValueError, match="unknown label"):
        parse({"team": "sales"})
    with pytest.raises(ValueError, match="no `expected`"):
        parse(None)


def test_review_decisions_become_rows_and_the_rest_is_counted():
    records = [{"review_id": "1-0", "text": "refund please", "expected": {"team": "billing"}},
               {"review_id": "2-0", "text": None, "expected": {"team": "billing"}},
               {"review_id": "3-0", "text": "down", "expected": {"team": "technical", "topics": ["outage"]}}]
    single = read_reviews(records, single_label)
    assert single.texts == ["refund please"] and single.expected == ["billing"]
    assert [line.split(":")[0] for line in single.skipped] == ["review 2-0", "review 3-0"]
    fields = read_reviews(records, field_labels(SCHEMA))
    assert fields.expected == [{"team": "billing"}, {"team": "technical", "topics": ("outage",)}]


def test_a_file_row_answered_with_another_schema_or_unreadable_is_left_out(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"text": "a", "schema": "support", "expected": {"team": "billing"}},
            {"text": "b", "schema": "other", "expected": {"team": "billing"}},
            {"text": "c", "expected": "technical"},  # a plain label names no field of a two-field schema
            {"text": "d", "expected": {"team": "technical"}}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    found = read_file(path, "auto", 100_000, field_labels(SCHEMA), "support")
    assert found.texts == ["a", "d"] and found.expected == [{"team": "billing"}, {"team": "technical"}]
    assert len(found.skipped) == 2 and "schema 'other'" in found.skipped[0] and "names no field" in found.skipped[1]
