"""Hypothesis strategies for protocol messages and frames, and decode's
contract, shared by the fuzz tests of the stages' inboxes.

`frames` is what a peer (or anything that connects) may send: random bytes,
random msgpack values, valid messages, and valid messages mutated byte-wise
or field-wise. `check_decode` states what protocol.decode must do with them.
"""

from __future__ import annotations

import types
from typing import Annotated, Union, get_args, get_origin

import msgspec
import pytest
from hypothesis import strategies as st

from fuzz_helpers import mutated
from pipeline import protocol

# What every receive path catches around protocol.decode.
CAUGHT = (ValueError, TypeError)
MESSAGE_TYPES = get_args(protocol.Message)


# ---------------------------------------------------------------- values of declared types

def _is_union(tp) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _bounds(tp) -> tuple[type, int | None]:
    """Annotated[int, Meta(ge=N)] -> (int, N); any other type -> (it, None)."""
    if get_origin(tp) is Annotated:
        base, *metas = get_args(tp)
        return base, next((m.ge for m in metas if isinstance(m, msgspec.Meta) and m.ge is not None), None)
    return tp, None


def values_of(tp) -> st.SearchStrategy:
    """Plausible values of a field type of protocol.py."""
    tp, least = _bounds(tp)
    if least is not None:
        return st.integers(least, 2**63 - 1)
    if tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-2**63, 2**64 - 1)   # what msgpack can carry
    if tp is float:
        return st.floats()
    if tp is str:
        return st.text(max_size=24)
    if tp is bytes:
        return st.binary(max_size=64)
    if _is_union(tp):
        return st.one_of([values_of(arg) for arg in get_args(tp)])
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        fields = {f.name: values_of(f.type) for f in msgspec.structs.fields(tp)}
        return st.builds(tp, **fields)
    origin, args = get_origin(tp), get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(values_of(args[0]), max_size=4).map(tuple)
    if origin is tuple:
        return st.tuples(*[values_of(arg) for arg in args])
    if origin is dict:
        return st.dictionaries(values_of(args[0]), values_of(args[1]), max_size=4)
    raise TypeError(f"no strategy for field type {tp!r}")


def conforms(value, tp) -> bool:
    """Whether `value` is of field type `tp`, strictly (a bool is no int)."""
    tp, least = _bounds(tp)
    if least is not None and not (type(value) is int and value >= least):
        return False
    if tp is type(None):
        return value is None
    if tp in (bool, int, float, str, bytes):
        return type(value) is tp
    if _is_union(tp):
        return any(conforms(value, arg) for arg in get_args(tp))
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return type(value) is tp and all(conforms(getattr(value, f.name), f.type)
                                         for f in msgspec.structs.fields(tp))
    origin, args = get_origin(tp), get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return type(value) is tuple and all(conforms(v, args[0]) for v in value)
    if origin is tuple:
        return type(value) is tuple and len(value) == len(args) and all(map(conforms, value, args))
    if origin is dict:
        return type(value) is dict and all(conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items())
    raise TypeError(f"no check for field type {tp!r}")


messages = st.one_of([values_of(tp) for tp in MESSAGE_TYPES])

# Anything msgpack can hold, nested: what a peer speaking another protocol sends.
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=16)
    | st.binary(max_size=16) | st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=8)),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), children, max_size=4),
    max_leaves=24)

TAGS = [tp.__struct_config__.tag for tp in MESSAGE_TYPES]


@st.composite
def structurally_mutated(draw) -> bytes:
    """A valid message as its msgpack array [tag, field, ...], then a field
    replaced by a value of another type, a field dropped, extra fields
    added, or the tag swapped for another message's."""
    items = msgspec.msgpack.decode(protocol.encode(draw(messages)))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("replace", "drop", "append", "retag", "nested")))
        at = draw(st.integers(0, len(items) - 1)) if items else 0
        if kind == "replace" and items:
            items[at] = draw(msgpack_values)
        elif kind == "drop" and items:
            del items[at]
        elif kind == "append":
            items.extend(draw(st.lists(msgpack_values, min_size=1, max_size=3)))
        elif kind == "retag" and items:
            items[0] = draw(st.sampled_from(TAGS) | st.text(max_size=8))
        elif kind == "nested" and items and isinstance(items[at], (list, dict)) and items[at]:
            inner = items[at]
            key = draw(st.sampled_from(list(inner) if isinstance(inner, dict) else range(len(inner))))
            inner[key] = draw(msgpack_values)
    return msgspec.msgpack.encode(items)


frames = st.one_of(
    st.binary(max_size=128),
    msgpack_values.map(msgspec.msgpack.encode),
    messages.map(protocol.encode),
    messages.map(protocol.encode).flatmap(lambda data: mutated(data, header=16)),
    structurally_mutated(),
)


def check_decode(data: bytes) -> protocol.Message | None:
    """decode's contract: a declared message of declared field types, or an
    error the receive paths catch (msgspec's, which derive from ValueError)."""
    try:
        message = protocol.decode(data)
    except CAUGHT as exc:
        assert isinstance(exc, msgspec.DecodeError), f"{type(exc).__name__}: {exc}"
        with pytest.raises(msgspec.DecodeError):
            protocol.decode(memoryview(data))   # a zmq frame's buffer decodes the same
        return None
    assert type(message) in MESSAGE_TYPES
    assert conforms(message, type(message)), message
    assert protocol.encode(protocol.decode(memoryview(data))) == protocol.encode(message)
    # What a stage re-sends (a forwarded or answered message) is a valid frame.
    again = protocol.encode(message)
    assert protocol.encode(protocol.decode(again)) == again
    return message
