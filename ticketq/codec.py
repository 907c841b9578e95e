"""JSON on the hot path: orjson where it gives the standard library's answer, the standard library where it might not.

At tens of thousands of tickets a second, JSON was a quarter of the worker's CPU and half the
producer's: kombu decodes every message (and Celery every result) with `json.loads` plus an
`object_hook` called once per JSON object, and the worker encoded every result with `json.dumps`.
orjson does the same work in C, several times faster. It is not a drop-in replacement, so each
function here falls back to the standard library wherever the answers could differ:

- integers beyond 64 bits: orjson turns them into floats silently (a 20-digit ticket id would
  change), so any run of 19 or more digits goes to the standard library;
- NaN/Infinity, lone surrogates, invalid UTF-8: orjson raises, the standard library decides (and
  raises its own error where it did before);
- kombu's type markers (`{"__type__": ..., "__value__": ...}`, how kombu sends datetimes, UUIDs
  and decimals): a text that could spell the key, plainly or with `\\u` escapes, goes to kombu.

`install()` makes kombu (so Celery's message and result decoding) use `kombu_loads`; kombu's
encoder is kept as it is, so what goes on the wire does not change.
"""

from __future__ import annotations

import json
import re
from typing import Any

import kombu.serialization
import orjson
from kombu.utils.json import dumps as _kombu_dumps
from kombu.utils.json import loads as _kombu_loads

# Where orjson's answer could differ from the standard library's without an error (see module
# docstring). Plain substring searches (memchr speed: a regex over the whole text cost more than
# orjson's parse): digits are mapped to "0" first, so a run of 19 of them is one literal.
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGIT_RUN = b"0" * 19
_MARKER_KEY = b"__type__"
_ESCAPE = b"\\u00"  # `\u00`: kombu's marker key could be spelled with escapes of its letters
_ESCAPED_MARKER_LETTER = re.compile(rb"\\u00(?:5[fF]|7[049]|65)")  # _ t y p e


def _may_differ(data: bytes, markers: bool) -> bool:
    if _LONG_DIGIT_RUN in data.translate(_DIGITS_TO_ZERO):
        return True
    if not markers:
        return False
    return _MARKER_KEY in data or (_ESCAPE in data and _ESCAPED_MARKER_LETTER.search(data) is not None)


def _fast(data: bytes | bytearray | memoryview | str, markers: bool) -> tuple[bool, Any]:
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if not _may_differ(raw, markers):
        try:
            return True, orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # NaN, lone surrogates, bad UTF-8...: the standard library decides
    return False, None


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """`json.loads(data)`, faster."""
    done, value = _fast(data, markers=False)
    return value if done else json.loads(bytes(data) if isinstance(data, bytearray | memoryview) else data)


def loads_finite(data: bytes | str) -> Any:
    """`json.loads(data)` refusing the `NaN`, `Infinity` and `-Infinity` literals (a ValueError, as
    for any other JSON error), faster. A number too large to be finite (`1e999`) still parses, as inf."""
    done, value = _fast(data, markers=False)  # orjson refuses the literals: the standard library decides
    return value if done else json.loads(data, parse_constant=_no_constant)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number (numbers must be finite)")


def kombu_loads(data: bytes | bytearray | memoryview | str) -> Any:
    """`kombu.utils.json.loads(data)` (type markers included), faster."""
    done, value = _fast(data, markers=True)
    return value if done else _kombu_loads(data)


def dumps(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON, equal to `json.dumps(value)` once parsed, except NaN and
    infinities, written as null (json.dumps wrote NaN, which no strict JSON parser reads).

    What orjson refuses (integers beyond 64 bits, non-string keys, numpy scalars, lone surrogates)
    goes through `json.dumps`, so nothing that encoded before fails now.
    """
    try:
        return orjson.dumps(value)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        pass
    return json.dumps(value, separators=(",", ":")).encode("ascii")  # ASCII: a lone surrogate stays an escape


def install() -> None:
    """Decode JSON messages and results with `kombu_loads` in this process (idempotent)."""
    kombu.serialization.register(
        "json", _kombu_dumps, kombu_loads, content_type="application/json", content_encoding="utf-8"
    )
