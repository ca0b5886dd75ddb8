"""Request bodies streamed to disk: multipart forms (python-multipart's parser), JSON and url-encoded forms.

Contract: a file part is written chunk by chunk to a temporary file under the data dir's tmp/ folder as it arrives; it
never sits whole in memory. The whole body is capped at `max_bytes` (`UploadTooLarge` -> 413) and text fields at
`MAX_FIELD_BYTES`; a malformed or truncated body raises `BadBody` (-> 400). On any error every temporary file written
so far is deleted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qsl

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

MAX_FIELD_BYTES = 64 * 1024  # one text field
MAX_TEXT_BODY_BYTES = 1 << 20  # a JSON or url-encoded body
MAX_PARTS = 32


class BadBody(Exception):
    """The body is malformed (the message says how)."""


class UploadTooLarge(Exception):
    """The body is larger than the limit."""


@dataclass
class Upload:
    """One file part, already on disk."""

    filename: str
    path: Path
    bytes: int


@dataclass
class Form:
    fields: dict[str, object] = field(default_factory=dict)  # str values (multipart, url-encoded) or JSON values
    files: dict[str, Upload] = field(default_factory=dict)

    def discard(self) -> None:
        for upload in self.files.values():
            upload.path.unlink(missing_ok=True)


def _check_length(request: Request, max_bytes: int) -> None:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise BadBody("Content-Length is not a number")
        if int(length) > max_bytes:
            raise UploadTooLarge(f"the request body is {int(length)} bytes; this server takes at most {max_bytes}")


async def read_body(request: Request, max_bytes: int, tmp_path: Callable[[], Path]) -> Form:
    """Parse a multipart, JSON or url-encoded body (chosen by Content-Type)."""
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type == b"multipart/form-data":
        boundary = params.get(b"boundary")
        if not boundary:
            raise BadBody("multipart/form-data without a boundary")
        return await read_multipart(request, boundary, max_bytes, tmp_path)
    if content_type in (b"application/json", b"application/x-www-form-urlencoded"):
        data = await _read_small(request, min(max_bytes, MAX_TEXT_BODY_BYTES))
        if content_type == b"application/json":
            try:
                value = json.loads(data or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadBody(f"the JSON body does not parse ({e.msg if hasattr(e, 'msg') else e})") from None
            except RecursionError:
                raise BadBody("the JSON body is nested too deeply") from None
            if not isinstance(value, dict):
                raise BadBody("the JSON body must be an object")
            return Form(fields=value)
        try:
            return Form(fields=dict(parse_qsl(data.decode(), keep_blank_values=True, strict_parsing=bool(data))))
        except (ValueError, UnicodeDecodeError):
            raise BadBody("the url-encoded body does not parse") from None
    raise BadBody("send multipart/form-data, application/json or application/x-www-form-urlencoded")


async def _read_small(request: Request, max_bytes: int) -> bytes:
    _check_length(request, max_bytes)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise UploadTooLarge(f"the request body is larger than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_multipart(request: Request, boundary: bytes, max_bytes: int, tmp_path: Callable[[], Path]) -> Form:
    _check_length(request, max_bytes)
    form = Form()
    state: dict = {"headers": {}, "field": b"", "value": b"", "name": None, "file": None, "upload": None,
                   "text": None, "parts": 0, "ended": False, "error": None}

    def on_part_begin() -> None:
        state["parts"] += 1
        if state["parts"] > MAX_PARTS:
            raise BadBody(f"more than {MAX_PARTS} parts")
        state["headers"], state["name"], state["file"], state["upload"], state["text"] = {}, None, None, None, None

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["value"] += data[start:end]

    def on_header_end() -> None:
        state["headers"][state["field"].lower()] = state["value"]
        state["field"], state["value"] = b"", b""

    def on_headers_finished() -> None:
        disposition, options = parse_options_header(state["headers"].get(b"content-disposition", b""))
        if disposition != b"form-data" or b"name" not in options:
            raise BadBody("a part has no Content-Disposition: form-data; name=...")
        name = options[b"name"].decode("utf-8", "replace")
        if name in form.fields or name in form.files:
            raise BadBody(f"the field {name!r} is given twice")
        state["name"] = name
        if b"filename" in options:
            path = tmp_path()
            state["upload"] = Upload(filename=options[b"filename"].decode("utf-8", "replace"), path=path, bytes=0)
            form.files[name] = state["upload"]  # registered first, so discard() finds it on any error
            state["file"] = open(path, "wb")
        else:
            state["text"] = bytearray()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if state["file"] is not None:
            state["file"].write(data[start:end])
            state["upload"].bytes += end - start
        else:
            state["text"] += data[start:end]
            if len(state["text"]) > MAX_FIELD_BYTES:
                raise BadBody(f"the field {state['name']!r} is longer than {MAX_FIELD_BYTES} bytes")

    def on_part_end() -> None:
        if state["file"] is not None:
            state["file"].close()
            state["file"] = None
        else:
            try:
                form.fields[state["name"]] = bytes(state["text"]).decode("utf-8")
            except UnicodeDecodeError:
                raise BadBody(f"the field {state['name']!r} is not UTF-8") from None

    def on_end() -> None:
        state["ended"] = True

    parser = MultipartParser(boundary, {
        "on_part_begin": on_part_begin, "on_part_data": on_part_data, "on_part_end": on_part_end,
        "on_header_field": on_header_field, "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished, "on_end": on_end,
    })
    total = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > max_bytes:
                raise UploadTooLarge(f"the upload is larger than this server's limit of {max_bytes} bytes")
            parser.write(chunk)
        parser.finalize()
        if not state["ended"]:
            raise BadBody("the multipart body ends before its closing boundary")
    except MultipartParseError as e:
        _close(state)
        form.discard()
        raise BadBody(f"malformed multipart body ({e})") from None
    except BaseException:
        _close(state)
        form.discard()
        raise
    return form


def _close(state: dict) -> None:
    if state["file"] is not None:
        state["file"].close()
