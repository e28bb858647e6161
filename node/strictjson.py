"""JSON as the API reads it: a field given twice in one object is refused.

JSON leaves duplicate names to the reader (RFC 8259 4: "the behavior of
software that receives such an object is unpredictable"). Python keeps the
last; a proxy or a client library in front may keep the first, and the two
would then disagree on, say, which user a check is for. So every JSON body
ringlimit is sent (by a client, an operator or a peer) and every JSON file
it reads is read here, and a field given twice is an error like any other
ambiguous input, as TOML makes it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ring.errors import given


class GivenTwice(ValueError):
    """A JSON object that names one field twice."""


def _unique_fields(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise GivenTwice(f"the field {given(name)} is given twice in one object")
            seen.add(name)
    return data


class NumberTooLong(ValueError):
    """An integer with more digits than Python converts (``sys.get_int_max_str_digits``)."""


def _integer(text: str) -> int:
    """``int``, whose refusal of a number over the interpreter's limit (4,300
    digits by default) named ``sys.set_int_max_str_digits`` and no field (an
    exploratory tester)."""
    try:
        return int(text)
    except ValueError:
        digits = len(text.lstrip("-"))
        raise NumberTooLong(
            f"a number has {digits:,} digits; at most {sys.get_int_max_str_digits():,} are read"
        ) from None


_UNIQUE_DECODER = json.JSONDecoder(object_pairs_hook=_unique_fields, parse_int=_integer)


def loads_unique(data: bytes | str) -> Any:
    """``json.loads`` (bytes in any of JSON's encodings), but a field given
    twice in one object is :class:`GivenTwice`."""
    if not isinstance(data, str):
        data = data.decode(json.detect_encoding(data), "surrogatepass")
    return _UNIQUE_DECODER.decode(data)
