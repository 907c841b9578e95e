"""ticketq.codec gives the standard library's (and kombu's) answers, only faster. Pure unit tests."""

from __future__ import annotations

import datetime
import decimal
import json
import math
import uuid

import kombu.serialization
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

from ticketq import codec

# JSON values as json.dumps writes them: NaN/Infinity included, integers of any size, any text.
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30,
)


def same(a: object, b: object) -> bool:
    """Equal, type for type (True is not 1, 1.0 is not 1), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@given(values, st.booleans())
def test_loads_equals_the_standard_library(value: object, ascii_only: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    for data in (text, text.encode("utf-8", "surrogatepass")):
        try:
            expected = json.loads(data)
        except UnicodeDecodeError:  # lone surrogates written raw are not UTF-8: refused both ways
            with pytest.raises(ValueError):
                codec.loads(data)
            continue
        assert same(codec.loads(data), expected)
        assert same(codec.kombu_loads(data), kombu_loads(data))


@pytest.mark.parametrize(
    "text",
    [
        '{"id": 12345678901234567890123}',  # orjson alone turns integers beyond 64 bits into floats
        "[-9223372036854775809, 18446744073709551616]",
        "[NaN, Infinity, -Infinity]",
        '"\\ud800"',
        '{"a": 1, "a": 2}',
        "-0",
        "1e400",
    ],
)
def test_loads_edge_cases(text: str) -> None:
    assert same(codec.loads(text), json.loads(text))
    assert same(codec.kombu_loads(text.encode()), kombu_loads(text.encode()))


@given(values)
def test_loads_finite_equals_the_standard_library_and_refuses_the_non_finite_literals(value: object) -> None:
    """The gateway's body parser: what `json.loads(parse_constant=refuse)` answers, value or ValueError."""
    data = json.dumps(value).encode()
    try:
        expected = json.loads(data, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))
    except ValueError:
        with pytest.raises(ValueError, match="numbers must be finite"):
            codec.loads_finite(data)
        return
    assert same(codec.loads_finite(data), expected)


@pytest.mark.parametrize("text", ['{"id": 12345678901234567890123}', '"\\ud800"', "1e400", "-0"])
def test_loads_finite_edge_cases(text: str) -> None:
    assert same(codec.loads_finite(text.encode()), json.loads(text))


@pytest.mark.parametrize(
    "value",
    [datetime.datetime(2026, 12, 1, 1, 2, 3), datetime.date(2026, 12, 1), uuid.UUID(int=7), decimal.Decimal("1.5")],
)
def test_kombu_type_markers_survive(value: object) -> None:
    data = kombu_dumps({"v": value, "n": 1})
    assert codec.kombu_loads(data) == kombu_loads(data) == {"v": value, "n": 1}


def test_an_escaped_marker_key_is_still_a_marker() -> None:
    data = '{"\\u005f_type__": "datetime", "__value__": "2026-12-01T00:00:00"}'
    assert codec.kombu_loads(data) == kombu_loads(data) == datetime.datetime(2026, 12, 1)


@given(values)
def test_dumps_round_trips_like_the_standard_library(value: object) -> None:
    expected = json.loads(json.dumps(value))
    got = json.loads(codec.dumps(value))
    if isinstance(value, float) and not math.isfinite(value):
        assert got is None  # orjson writes null where json.dumps wrote NaN (not JSON)
    elif not _has_non_finite(value):
        assert same(got, expected)


def _has_non_finite(value: object) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, list):
        return any(_has_non_finite(v) for v in value)
    if isinstance(value, dict):
        return any(_has_non_finite(v) for v in value.values())
    return False


def test_dumps_takes_what_orjson_refuses() -> None:
    assert json.loads(codec.dumps({1: 2**70})) == {"1": 2**70}
    assert json.loads(codec.dumps("\ud800")) == "\ud800"  # stays an escape, valid UTF-8 on the wire


def test_install_routes_kombu_json_through_the_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    codec.install()
    seen = []
    fast = codec._fast
    monkeypatch.setattr(codec, "_fast", lambda data, markers: seen.append(markers) or fast(data, markers))
    data = kombu_dumps({"when": datetime.datetime(2026, 1, 1), "id": 2**70, "text": "café"})
    assert kombu.serialization.loads(data, "application/json", "utf-8") == kombu_loads(data)
    assert seen == [True]
