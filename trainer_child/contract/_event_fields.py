"""How the fields of an event line are read back: by type, leniently (a wrong type is None).

Private to :mod:`.events`: the records there are built on :class:`PlainEvent`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from qlora_supervise.trainer_child.contract.codes import Stage


def event_line(event: str, **fields: Any) -> str:
    """One line of the child's events file."""
    return json.dumps({"event": event, "time": time.time(), **fields}, default=str) + "\n"


def int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def float_or_none(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _bool_or_none(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _stage_or_none(value: object) -> Stage | None:
    return Stage.named(value) if isinstance(value, str) else None


def _mapping_or_none(value: object) -> Mapping[str, Any] | None:
    return value if isinstance(value, Mapping) else None


#: How a plain field of an event record is read from its line, by the field's annotation.
_READERS: Mapping[str, Callable[[object], object]] = {
    "int | None": int_or_none,
    "float | None": float_or_none,
    "str | None": str_or_none,
    "bool | None": _bool_or_none,
    "Stage | None": _stage_or_none,
    "Mapping[str, Any] | None": _mapping_or_none,
}


_E = TypeVar("_E", bound="PlainEvent")


class PlainEvent:
    """An event record whose fields are the line's keys, each read by its annotation (:data:`_READERS`).

    Subclasses are frozen dataclasses with a ``ClassVar`` ``event`` name. ``time`` is the line's
    stamp (``event_line`` sets it when writing; None in a record built to be written);
    ``fields()`` are the other keys, as the child writes them. A field that is a record of its
    own is read by :meth:`_nested` and written by an override of :meth:`fields`.
    """

    event: ClassVar[str]

    @classmethod
    def from_fields(cls: type[_E], raw: Mapping[str, Any]) -> _E:
        values = {f.name: _READERS[str(f.type)](raw.get(f.name)) for f in _plain(cls)}
        build: Callable[..., _E] = cls  # the dataclass's own __init__ takes these keywords
        return build(**values, **cls._nested(raw))

    @classmethod
    def _nested(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def fields(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in _plain(type(self)) if f.name != "time"}
        return {name: value.value if isinstance(value, Stage) else value for name, value in out.items()}

    def to_line(self) -> str:
        return event_line(self.event, **self.fields())


def _plain(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if str(f.type) in _READERS]
