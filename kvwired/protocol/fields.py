"""What a field of a message may hold: its types, whether it is required, a check.

Every message class (``control``, ``sender_local``, ``receiver_local``) names
one of these per field; the frame decoder checks each field against it
before a message object is made, so code behind the decoder only ever sees
well-formed values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import immediate, stripes

# Checks a value of the right type; returns what is wrong with it, or None.
Check = Callable[[Any], str | None]


@dataclass(frozen=True)
class Field:
    types: tuple[type, ...]
    required: bool = True
    check: Check | None = None
    expected: str = ""  # what a good value looks like, for the refusal's hint


def _f(*types: type, required: bool = True, check: Check | None = None,
       expected: str = "") -> Field:
    return Field(types, required, check, expected)


def wire(spec: Field, *, default: dataclasses._MISSING_TYPE | None = dataclasses.MISSING
         ) -> Any:
    """A message class's field, checked against ``spec`` on receipt. An
    optional field says ``default=None`` (None is sent as absent), so that
    mypy knows which fields a message must be given."""
    return dataclasses.field(default=default, metadata={"spec": spec})


def _int_range(low: int, high: int) -> Check:
    def check(value: Any) -> str | None:
        return None if low <= value <= high else f"{value} is outside {low}..{high}"
    return check


def _seconds(value: Any) -> str | None:
    if not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
        return f"{value!r} is not a number of seconds in (0, {MAX_SECONDS:g}]"
    return None


def _text(limit: int) -> Check:
    def check(value: Any) -> str | None:
        return None if 0 < len(value) <= limit else f"length {len(value)} is not 1..{limit}"
    return check


def _shape(value: Any) -> str | None:
    extra = set(value) - {"layers", "layer_bytes"}
    if extra:
        return f"unknown keys {sorted(map(str, extra))}"
    for key, high in (("layers", immediate.MAX_LAYERS), ("layer_bytes", MAX_LAYER_BYTES)):
        item = value.get(key)
        if isinstance(item, bool) or not isinstance(item, int):
            return f"{key!r} is {type(item).__name__}, expected int"
        if not 1 <= item <= high:
            return f"{key!r} {item} is outside 1..{high}"
    return None


def _error(value: Any) -> str | None:
    for key in ("code", "message"):
        if not isinstance(value.get(key), str):
            return f"{key!r} is missing or not a string"
    for key in ("hint", "status"):
        if key in value and not isinstance(value[key], str):
            return f"{key!r} is not a string"
    if "retriable" in value and not isinstance(value["retriable"], bool):
        return "'retriable' is not a boolean"
    return None


def _keys(value: Any) -> str | None:
    if not 1 <= len(value) <= stripes.MAX_CHANNELS:
        return f"{len(value)} keys, not 1..{stripes.MAX_CHANNELS}"
    for key in value:
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 1 << 32:
            return f"{key!r} is not a 32-bit remote key"
    return None


def _lease_keys(value: Any) -> str | None:
    if len(value) >= immediate.LEASE_SPACE:
        return f"{len(value)} pairs, more than there are leases"
    for pair in value:
        if (not isinstance(pair, list) or len(pair) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in pair)):
            return f"{pair!r} is not a [lease, key] pair of integers"
        lease, key = pair
        if not 1 <= lease < immediate.LEASE_SPACE or not 0 <= key < 1 << 32:
            return f"{pair!r}: lease or key out of range"
    return None


def _names(value: Any) -> str | None:
    if len(value) > 16 or not all(isinstance(v, str) and 0 < len(v) <= 64 for v in value):
        return "not a list of at most 16 short names"
    return None


def _note(value: Any) -> str | None:
    if len(value) > MAX_NOTE_ENTRIES:
        return f"{len(value)} entries, more than {MAX_NOTE_ENTRIES}"
    for key, item in value.items():
        if not isinstance(key, str) or not 0 < len(key) <= 64:
            return f"key {key!r} is not a name of 1 to 64 characters"
        if isinstance(item, str) and len(item) > 256:
            return f"{key!r} is a string of {len(item)} characters, more than 256"
        if item is not None and not isinstance(item, str | int | float):
            return f"{key!r} is {type(item).__name__}, not a string, number, boolean or nil"
    return None


MAX_SECONDS = 86400.0  # a deadline or wait longer than a day is a mistake
MAX_NOTE_ENTRIES = 32
MAX_LAYER_BYTES = 1 << 40
U64 = (1 << 64) - 1

INT = _f(int, check=_int_range(0, U64), expected="a non-negative integer")
FLAG = _f(int, required=False, check=_int_range(0, 1), expected="0 or 1")
STR = _f(str, check=_text(1024), expected="a string of 1 to 1024 characters")
REQ = _f(str, check=_text(256), expected="a request id of 1 to 256 characters")
LEASE = _f(int, check=_int_range(1, immediate.LEASE_SPACE - 1),
           expected=f"a lease id in 1..{immediate.LEASE_SPACE - 1}")
LAYER = _f(int, check=_int_range(0, immediate.MAX_LAYERS - 1),
           expected=f"a layer in 0..{immediate.MAX_LAYERS - 1}")
CREDITS = _f(int, check=_int_range(1, 1 << 16), expected="1 to 65536 credits")
CHECKSUM = _f(int, check=_int_range(0, U64), expected="an unsigned 64-bit checksum")
KEY = _f(int, check=_int_range(0, (1 << 32) - 1), expected="a 32-bit remote key")
KEYS = _f(list, check=_keys,
          expected=f"a list of 1 to {stripes.MAX_CHANNELS} 32-bit remote keys, one per channel")
CHANNEL = _f(int, required=False, check=_int_range(0, stripes.MAX_CHANNELS - 1),
             expected=f"a data channel in 0..{stripes.MAX_CHANNELS - 1}")
SHAPE = _f(dict, check=_shape, expected="{layers: 1..1024, layer_bytes: 1..2^40}")
DICT = _f(dict)
# What the prefill engine tells the decode engine about a push (its KV layout),
# carried by both daemons with the open and never read by them: flat, small.
NOTE_CHECK = _note
NOTE = _f(dict, required=False, check=_note,
          expected=f"a flat map of at most {MAX_NOTE_ENTRIES} named strings, numbers, "
                   "booleans or nils")
ERROR_SHAPE = "{code, message[, hint, status]} strings[, retriable: a boolean]"
ERROR = _f(dict, check=_error, expected=ERROR_SHAPE)
NAMES = _f(list, check=_names, expected="a list of names")
SECONDS = _f(float, int, required=False, check=_seconds,
             expected=f"seconds, finite, in (0, {MAX_SECONDS:g}]")
VERDICTS = ("delivered", "aborted", "unknown")
OUTCOME = _f(str, check=lambda v: None if v in VERDICTS else f"{v!r} is not a verdict",
             expected=" or ".join(VERDICTS))


# Fields of one message type each.
DATA_CHANNEL = _f(int, check=_int_range(0, stripes.MAX_CHANNELS - 1),
                  expected=f"a data channel in 0..{stripes.MAX_CHANNELS - 1}")
LEASE_KEYS = _f(list, check=_lease_keys, expected="[lease, key] pairs")
OPTIONAL_CHECKSUM = _f(int, required=False, check=_int_range(0, U64),
                       expected="an unsigned 64-bit checksum")
OPTIONAL_ERROR = _f(dict, required=False, check=_error, expected=ERROR_SHAPE)
OPTIONAL_U64 = _f(int, required=False, check=_int_range(0, U64))
LIST = _f(list)
OPTIONAL_LIST = _f(list, required=False)
PORT = _f(int, check=_int_range(1, 65535), expected="a TCP port")
MAX_READERS = 1024
READERS = _f(int, required=False, check=_int_range(1, MAX_READERS),
             expected=f"1 to {MAX_READERS} decode engines")
CHUNK_BYTES = _f(int, required=False, check=_int_range(1, MAX_LAYER_BYTES << 10),
                 expected="a chunk size of at least 1 B")
