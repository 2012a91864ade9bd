"""`bench structured`'s workload: JSON schemas of our own, each with a chat-less prompt a tiny
Python-code model continues (a comment naming the record, then `name = `) and a hand-written
valid instance (the unit test validates it; it documents the schema's size: 15-80 tokens of the
shipped model's BPE).

Between them they cover nested objects, arrays with minItems/maxItems, enums, integers and
numbers with bounds, optional fields (not in `required`), anyOf, string formats (date, email,
uuid, date-time), const, booleans, null, `additionalProperties: false`, and strings with
maxLength or pattern. Every string has a maxLength or a bounded pattern and every array a
maxItems, so that no row can run away inside a string or a list (numbers' digits stay free:
bench structured reports how many rows end on `max_tokens` instead)."""

from __future__ import annotations

from typing import List


def _obj(properties: dict, required=None, closed: bool = True) -> dict:
    """An object schema: every property required unless `required` names some."""
    out = {"type": "object", "properties": properties,
           "required": list(properties) if required is None else list(required)}
    if closed:
        out["additionalProperties"] = False
    return out


def _str(n: int, **kw) -> dict:
    return {"type": "string", "maxLength": n, **kw}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float, hi: float, step: float = 0.01) -> dict:
    """A number in [lo, hi] with at most two decimals (`multipleOf`: without it a number's digits
    are unbounded, and a tiny model writes them until max_tokens)."""
    return {"type": "number", "minimum": lo, "maximum": hi, "multipleOf": step}


EMAIL = {"type": "string", "format": "email", "maxLength": 24}
DATE_TIME = {"type": "string", "format": "date-time", "maxLength": 25}   # bounds the seconds' fraction


BOOL = {"type": "boolean"}
NULL = {"type": "null"}

# name -> (prompt, schema, a valid instance)
_CASES = [
    ("user_profile", "# A user profile, as JSON\nuser = ",
     _obj({"name": _str(16), "age": _int(0, 120),
           "address": _obj({"city": _str(16), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
     {"name": "Ada", "age": 36, "address": {"city": "London", "zip": "12345"}}),
    ("point", "# A labelled point in the plane\npoint = ",
     _obj({"label": _str(8), "x": _num(-100, 100), "y": _num(-100, 100)}),
     {"label": "origin", "x": 1.5, "y": -2}),
    ("tags", "# A blog post's tags\npost = ",
     _obj({"post": _int(1, 9999), "tags": {"type": "array", "items": _str(10), "minItems": 1, "maxItems": 4}}),
     {"post": 42, "tags": ["python", "json", "mlx"]}),
    ("color", "# A colour setting\ncolor = ",
     _obj({"color": {"enum": ["red", "green", "blue"]}, "shade": {"enum": ["light", "dark"]},
           "alpha": _int(0, 255)}),
     {"color": "green", "shade": "dark", "alpha": 128}),
    ("http_status", "# The result of an HTTP request\nstatus = ",
     _obj({"code": _int(100, 599), "ok": BOOL, "reason": _str(20)}),
     {"code": 404, "ok": False, "reason": "Not Found"}),
    ("event", "# A calendar event\nevent = ",
     _obj({"title": _str(20), "date": {"type": "string", "format": "date"}, "all_day": BOOL}),
     {"title": "Release", "date": "2026-12-03", "all_day": True}),
    ("contact", "# A contact card\ncontact = ",
     _obj({"name": _str(16), "email": EMAIL, "phone": _str(12)},
          required=["name", "email"]),
     {"name": "Bob", "email": "bob@example.com"}),
    ("record_id", "# A record's identity\nrecord = ",
     _obj({"id": {"type": "string", "format": "uuid"}, "version": {"const": 1}, "kind": _str(10)}),
     {"id": "123e4567-e89b-12d3-a456-426614174000", "version": 1, "kind": "note"}),
    ("log_line", "# One structured log line\nentry = ",
     _obj({"level": {"enum": ["debug", "info", "warning", "error"]},
           "at": DATE_TIME, "msg": _str(24)}),
     {"level": "info", "at": "2026-12-03T10:15:00Z", "msg": "server started"}),
    ("optional_fields", "# A person; nickname and age are optional\nperson = ",
     _obj({"name": _str(12), "nickname": _str(10), "age": _int(0, 120)}, required=["name"]),
     {"name": "Grace", "nickname": "Amazing", "age": 85}),
    ("any_value", "# A setting whose value is a number, a word or null\nsetting = ",
     _obj({"key": _str(12), "value": {"anyOf": [_int(0, 1000), _str(10), NULL]}}),
     {"key": "mode", "value": "fast"}),
    ("nullable_parent", "# A node of a tree; the root has no parent\nnode = ",
     _obj({"id": _int(1, 999), "parent": {"anyOf": [_int(1, 999), NULL]}, "deleted": BOOL}),
     {"id": 7, "parent": None, "deleted": False}),
    ("const_header", "# The header of a config file\nheader = ",
     _obj({"format": {"const": "mtplx-config"}, "version": {"const": 2}, "debug": BOOL}),
     {"format": "mtplx-config", "version": 2, "debug": False}),
    ("matrix", "# A small matrix of digits\nmatrix = ",
     {"type": "array", "minItems": 2, "maxItems": 3,
      "items": {"type": "array", "items": _int(0, 9), "minItems": 2, "maxItems": 3}},
     [[1, 2, 3], [4, 5, 6], [7, 8, 9]]),
    ("package", "# A Python package's metadata\npackage = ",
     _obj({"name": {"type": "string", "pattern": "^[a-z][a-z0-9_]{0,14}$"},
           "version": {"type": "string", "pattern": "^[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,3}$"},
           "deps": {"type": "array", "items": _str(12), "maxItems": 3}}),
     {"name": "mtplx", "version": "0.3.1", "deps": ["mlx", "numpy"]}),
    ("rgb", "# A named RGB colour\ncolour = ",
     _obj({"name": _str(12), "rgb": {"type": "array", "items": _int(0, 255), "minItems": 3, "maxItems": 3}}),
     {"name": "orange", "rgb": [255, 128, 0]}),
    ("server_config", "# Server settings\nconfig = ",
     _obj({"host": _str(20), "port": _int(1, 65535), "tls": BOOL, "workers": _int(1, 64)}),
     {"host": "127.0.0.1", "port": 8000, "tls": False, "workers": 4}),
    ("todo_list", "# A to-do list\ntodos = ",
     {"type": "array", "minItems": 1, "maxItems": 3,
      "items": _obj({"id": _int(1, 99), "done": BOOL, "title": _str(10)})},
     [{"id": 1, "done": False, "title": "write docs"}, {"id": 2, "done": True, "title": "ship"}]),
    ("page", "# One page of search results\npage = ",
     _obj({"page": _int(1, 1000), "per_page": {"enum": [10, 20, 50]}, "total": _int(0, 100000),
           "next": {"anyOf": [_int(1, 1000), NULL]}}),
     {"page": 1, "per_page": 20, "total": 57, "next": 2}),
    ("shape", "# A shape: a circle or a square\nshape = ",
     {"anyOf": [_obj({"kind": {"const": "circle"}, "radius": _num(0, 10)}),
                _obj({"kind": {"const": "square"}, "side": _num(0, 10)})]},
     {"kind": "circle", "radius": 2.5}),
    ("feature_flags", "# Feature flags of the app\nflags = ",
     _obj({"flags": _obj({"beta": BOOL, "dark_mode": BOOL, "telemetry": BOOL}), "owner": _str(12)}),
     {"flags": {"beta": True, "dark_mode": False, "telemetry": False}, "owner": "ops"}),
    ("price", "# A price\nprice = ",
     _obj({"amount": _num(0, 10000), "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]}, "taxed": BOOL}),
     {"amount": 19.99, "currency": "EUR", "taxed": True}),
    ("commit", "# A git commit\ncommit = ",
     _obj({"sha": {"type": "string", "pattern": "^[0-9a-f]{7}$"}, "author": EMAIL,
           "date": {"type": "string", "format": "date"}, "message": _str(30)}),
     {"sha": "9563932", "author": "dev@example.org", "date": "2026-12-03", "message": "Structured output"}),
    ("sensor", "# A sensor reading\nreading = ",
     _obj({"sensor": {"type": "string", "format": "uuid"}, "celsius": _num(-40, 85), "humidity": _int(0, 100),
           "ok": BOOL}),
     {"sensor": "0f8fad5b-d9cb-469f-a165-70867728950e", "celsius": 21.5, "humidity": 40, "ok": True}),
    ("tree", "# A directory and its children\ntree = ",
     _obj({"name": _str(12), "children": {"type": "array", "maxItems": 2,
                                          "items": _obj({"name": _str(8), "leaf": BOOL})}}),
     {"name": "src", "children": [{"name": "main.py", "leaf": True}]}),
    ("job_result", "# The result of a job: a value or an error\nresult = ",
     _obj({"value": NULL, "error": _obj({"code": _int(1, 999), "message": _str(20)}), "retry": BOOL}),
     {"value": None, "error": {"code": 500, "message": "timeout"}, "retry": True}),
    ("coordinates", "# A place on the map\nplace = ",
     _obj({"name": _str(16), "lat": _num(-90, 90), "lon": _num(-180, 180), "elevation": _int(-500, 9000)},
          required=["name", "lat", "lon"]),
     {"name": "Oslo", "lat": 59.9, "lon": 10.75}),
    ("schedule", "# A weekly schedule\nschedule = ",
     _obj({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                    "minItems": 1, "maxItems": 3},
           "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}, "remote": BOOL}),
     {"days": ["mon", "wed"], "start": "09:30", "remote": False}),
]

SCHEMAS: List[dict] = [{"name": name, "prompt": prompt, "schema": schema, "example": example}
                       for name, prompt, schema, example in _CASES]


def format_checker():
    """jsonschema's format checker with `date-time` added (jsonschema checks it only with the
    optional rfc3339-validator installed; here RFC 3339 by regex and `datetime`)."""
    import datetime
    import re

    import jsonschema

    checker = jsonschema.FormatChecker()
    pattern = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")

    @checker.checks("date-time", raises=ValueError)
    def _date_time(value) -> bool:
        if not isinstance(value, str):
            return True
        if not pattern.match(value):
            return False
        datetime.datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
        return True

    return checker


def validation_error(text: str, schema: dict, checker=None):
    """None when `text` is JSON matching `schema` (formats checked), else why not (one line).
    Numbers are read as decimals, in the text and in the schema: jsonschema's `multipleOf` with
    floats is inexact (19.99 is not a multiple of 0.01 in binary floating point)."""
    import json
    from decimal import Decimal

    import jsonschema

    try:
        value = json.loads(text, parse_float=Decimal)
    except ValueError as exc:
        return f"not JSON: {exc}"
    exact = json.loads(json.dumps(schema), parse_float=Decimal)
    try:
        jsonschema.validate(value, exact, format_checker=checker or format_checker())
    except jsonschema.ValidationError as exc:
        return f"{'/'.join(str(p) for p in exc.absolute_path) or '/'}: {exc.message}"[:200]
    return None
