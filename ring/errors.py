"""Errors raised by the ring layer, and the validation of its wire format."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["EmptyRingError", "check_fields", "encodable", "names_text", "shown"]

#: At most this many characters of one client-chosen name are quoted in an error.
MAX_SHOWN = 40
#: At most this many names are listed in one error (the rest are counted).
MAX_NAMES_SHOWN = 10


class EmptyRingError(LookupError):
    """A key was looked up on a ring that has no members.

    A subclass of ``LookupError`` so callers that already treat "no such
    thing" uniformly keep working, while the router can catch this case
    specifically and answer 503 (nothing to route to) rather than 500.
    """


def check_fields(
    data: object, what: str, allowed: frozenset[str], required: tuple[str, ...]
) -> None:
    """Refuse a wire object that is not a mapping, has unknown fields or lacks one.

    A typo (``"wieght"``) must not quietly become a default: what a node or a
    router does not understand is safer refused than half-applied.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a mapping, got {type(data).__name__}")
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"{what} has unknown field(s): {names_text(unknown)}")
    for name in required:
        if name not in data:
            raise ValueError(f"{what} is missing required field {name!r}")


def shown(name: object) -> str:
    """``name`` (a field name or value a client chose) as an error message may quote it.

    Printable text is quoted as it is (so ``unknown key(s) limt`` reads as
    before); anything else is written as its ``ascii()`` escape. A lone
    surrogate (JSON ``"\\ud800"``) cannot be encoded as UTF-8: quoted raw, it
    made the JSON answer itself fail to encode, a plain-text 500. Cut to
    :data:`MAX_SHOWN` characters, so a 100 kB name does not come back whole.
    """
    text = name if isinstance(name, str) and name.isprintable() else ascii(name)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def given(value: object) -> str:
    """A value a config file or a JSON body gave, as an error message quotes it:
    in their spelling (``true``, ``false``, ``null``), not Python's (``True``,
    ``None``, which a tester read in answers to JSON); a string quoted (as
    :func:`shown`); an array or a table by its kind, not its Python repr."""
    if value is True or value is False:
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        text = repr(value)
        return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."
    if isinstance(value, str):
        return repr(shown(value)) if value.isprintable() else shown(value)
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


def names_text(names: Iterable[object]) -> str:
    """Names for an error message (``a, b, c``): each :func:`shown`, sorted, at
    most :data:`MAX_NAMES_SHOWN` of them and then how many more there were.

    Sorted as text, so names of mixed types (msgpack allows integer keys)
    cannot make the error itself raise a ``TypeError``.
    """
    texts = sorted(shown(n) for n in names)
    listed = ", ".join(texts[:MAX_NAMES_SHOWN])
    more = len(texts) - MAX_NAMES_SHOWN
    return f"{listed} and {more} more" if more > 0 else listed


def encodable(text: str) -> str:
    """``text`` with anything UTF-8 cannot carry (lone surrogates) written as
    ``\\udXXX`` escapes: the last line of defence for an error message that
    quotes client text, so its JSON answer always encodes (never a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text
