"""How a pydantic schema reads to a person: one-line refusals built from pydantic's errors (the dotted field
path, what the field expects in words, the value found) and an option reference built from field descriptions."""

from __future__ import annotations

import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from annotated_types import Ge, Gt, Le, Lt, MinLen
from pydantic import BeforeValidator, Tag, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError, PydanticUndefined

FIELD_ERROR = "recipe_field"  # raised by cross-field checks through field_error()
CHOICE_ERROR = "recipe_choice"  # a tagged union (e.g. a data source) whose kind cannot be told
_UNKNOWN = {"extra_forbidden", "unexpected_keyword_argument"}
_MISSING = {"missing", "missing_argument", "missing_keyword_only_argument"}
_RANGE = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "string_too_short"}
_ABSENT = object()


def field_error(field: str, expected: str, actual: Any = _ABSENT) -> PydanticCustomError:
    """A cross-field refusal raised inside a validator, reported as ``field '<where>.<field>': expected ...,
    got ...`` (or ``... is missing`` without an actual value); ``field`` is relative to the validated object."""
    ctx = {"field": field, "expected": expected}
    if actual is not _ABSENT:
        ctx["actual"] = short_repr(actual)
    return PydanticCustomError(FIELD_ERROR, "expected {expected}", ctx)


def format_validation_error(exc: ValidationError, root: Any, where: str, overrides: Sequence[str] = ()) -> str:
    """One line for the first error pydantic found in ``root``'s data, prefixed by ``where``; an error under a
    ``key=value`` override's key names the override."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = tuple(err["loc"])
    ctx = err.get("ctx") or {}
    parts, _, info, _ = walk(root, loc)
    path = ".".join(parts)
    if err["type"] == FIELD_ERROR:
        path = ".".join(p for p in (path, ctx["field"]) if p)
        message = (f"field {path!r}: expected {ctx['expected']}, got {ctx['actual']}" if "actual" in ctx
                   else f"field {path!r} is missing; expected {ctx['expected']}")
    elif err["type"] in _UNKNOWN:
        known = list(_fields_of(walk(root, loc[:-1])[3]) or ())
        message = f"unknown field {path!r}" + (f"; expected one of {', '.join(known)}" if known else "")
    elif err["type"] in _MISSING:
        expected = expected_text(info) if info else "a value"
        if info is not None and info.description:
            expected += f": {info.description}"
        message = f"field {path!r} is missing; expected {expected}"
    elif err["type"] == CHOICE_ERROR or info is None:
        message = f"field {path!r}: expected {err['msg']}, got {short_repr(err['input'])}"
    else:
        # a value of the right type but out of range: "or null" would not help
        expected = expected_text(info, nullable=err["type"] not in _RANGE)
        message = f"field {path!r}: expected {expected}, got {short_repr(err['input'])}"
    origin = [o for o in overrides if path == _key(o) or path.startswith(_key(o) + ".")]
    if origin:
        message += f" (set by override {origin[-1]!r})"
    if len(errors) > 1:
        message += f"; {len(errors) - 1} more error(s) after this one"
    return f"{where}: {message}"


def walk(root: Any, loc: Sequence[Any]) -> tuple[list[str], Any, FieldInfo | None, Any]:
    """Follow an error location through the schema: (the dotted parts, union tags and list indexes dropped;
    the class owning the last field; that field's info; the class or type the location ends in)."""
    owner, parent, info, parts = root, None, None, []
    for seg in loc:
        if isinstance(seg, int):
            continue
        member = _tagged_member(owner, seg)
        if member is not None:
            owner = member
            continue
        parts.append(str(seg))
        fields = _fields_of(owner)
        if fields is None or seg not in fields:
            parent, info, owner = owner, None, None
            continue
        parent, info = owner, fields[seg]
        owner = unwrap(info.annotation)[0]
    return parts, parent, info, owner


def _tagged_member(owner: Any, seg: Any) -> Any:
    if get_origin(owner) not in (Union, types.UnionType):
        return None
    for member in get_args(owner):
        base, metadata, _ = unwrap(member)
        if any(isinstance(m, Tag) and m.tag == seg for m in metadata):
            return base
    return None


def _fields_of(cls: Any) -> dict[str, FieldInfo] | None:
    fields = getattr(cls, "__pydantic_fields__", None)
    return fields if isinstance(fields, dict) else None


def unwrap(annotation: Any) -> tuple[Any, list[Any], bool]:
    """(base type, Annotated metadata, nullable) of an annotation, through Annotated and Optional."""
    metadata: list[Any] = []
    nullable = False
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation, *extra = get_args(annotation)
            metadata.extend(extra)
        elif origin in (Union, types.UnionType):
            args = [a for a in get_args(annotation) if a is not type(None)]
            nullable = nullable or len(args) < len(get_args(annotation))
            if len(args) != 1:
                return annotation, metadata, nullable
            annotation = args[0]
        else:
            return annotation, metadata, nullable


def expected_text(info: FieldInfo, nullable: bool = True) -> str:
    """What a field accepts, in words: 'a positive integer', 'a number in [0, 1)', 'one of a, b or null'."""
    annotation, metadata, optional = unwrap(info.annotation)
    metadata = [*metadata, *info.metadata]
    # a field that converts its input first (a task name -> a mapping) is described by what it accepts
    accepted = [m.json_schema_input_type for m in metadata
                if isinstance(m, BeforeValidator) and m.json_schema_input_type not in (Any, PydanticUndefined)]
    text = _type_text(accepted[0] if accepted else annotation, metadata)
    return text + (" or null" if nullable and optional else "")


def _type_text(annotation: Any, metadata: list[Any]) -> str:
    base, extra, _ = unwrap(annotation)
    metadata = [*metadata, *extra]
    origin = get_origin(base)
    if origin in (Union, types.UnionType):
        words = [_type_text(a, []) for a in get_args(base)]
        return " or ".join(dict.fromkeys(words))
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(base))
    if base is bool:
        return "true or false"
    if base in (int, float):
        return _numeric(base, metadata)
    if base is str:
        return "non-empty text" if any(isinstance(m, MinLen) and m.min_length > 0 for m in metadata) else "text"
    if base is Path:
        return "a path"
    if origin in (tuple, list) or base in (tuple, list):
        return "a list"
    return "a mapping"


def _numeric(base: type, metadata: list[Any]) -> str:
    kind = "integer" if base is int else "number"
    bounds = {type(m): m for m in metadata if isinstance(m, Ge | Gt | Le | Lt)}
    low, high = bounds.get(Ge) or bounds.get(Gt), bounds.get(Le) or bounds.get(Lt)
    if high is None and isinstance(low, Gt) and low.gt == 0:
        return f"a positive {kind}"
    if high is None and isinstance(low, Ge) and low.ge == 0:
        return f"a non-negative {kind}"
    article = "an" if kind == "integer" else "a"
    if low is not None and high is not None:
        left = f"[{low.ge}" if isinstance(low, Ge) else f"({low.gt}"
        right = f"{high.le}]" if isinstance(high, Le) else f"{high.lt})"
        return f"{article} {kind} in {left}, {right}"
    if low is not None:
        return f"{article} {kind} " + (f">= {low.ge}" if isinstance(low, Ge) else f"> {low.gt}")
    if high is not None:
        return f"{article} {kind} " + (f"<= {high.le}" if isinstance(high, Le) else f"< {high.lt}")
    return f"{article} {kind}"


def schema_fields(owner: Any, prefix: str = "", note: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(dotted path, expected, default, description) of every field under ``owner``, mappings included; the
    fields of each tagged union member follow, their description prefixed with the tag."""
    for name, info in (_fields_of(owner) or {}).items():
        path = f"{prefix}{name}"
        yield path, expected_text(info), default_text(info), note + (info.description or "")
        base = unwrap(info.annotation)[0]
        if get_origin(base) in (Union, types.UnionType):
            for member in get_args(base):
                member_base, metadata, _ = unwrap(member)
                tags = [m.tag for m in metadata if isinstance(m, Tag)]
                yield from schema_fields(member_base, f"{path}.", f"({tags[0]}) " if tags else note)
        else:
            yield from schema_fields(base, f"{path}.", note)


def default_text(info: FieldInfo) -> str:
    """A field's default as YAML flow text, or 'required'."""
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
    if _fields_of(type(value)) is not None:
        value = TypeAdapter(type(value)).dump_python(value, mode="json", exclude_none=True)
    return yaml.safe_dump([value], default_flow_style=True, width=1000, sort_keys=False).strip()[1:-1]


def reference_markdown(root: Any) -> str:
    """A markdown table of every field of ``root``: path, expected value, default, meaning."""
    lines = ["| field | expected | default | meaning |", "| --- | --- | --- | --- |"]
    for path, expected, default, description in schema_fields(root):
        cells = (f"`{path}`", expected, "required" if default == "required" else f"`{default}`", description)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _key(override: str) -> str:
    return override.partition("=")[0].strip()


def short_repr(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
