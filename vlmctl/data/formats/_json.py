"""Streaming JSON / JSONL record iteration with line numbers.

JSONL is read line by line. A JSON array is decoded one element at a time with `json.JSONDecoder.raw_decode`
over a sliding text buffer, so a 1 GB LLaVA-style file is never held whole and every record knows its line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

CHUNK_CHARS = 1 << 20  # characters read per refill
MAX_RECORD_CHARS = 256 << 20  # a record larger than this is reported as malformed instead of buffered further


@dataclass
class JsonParseError:
    line: int
    message: str


def iter_json_records(path: Path) -> Iterator[tuple[int, Any] | JsonParseError]:
    """Yield (line, record) for every record of a JSON array, a JSONL file or a single JSON object.

    A malformed JSONL line yields a JsonParseError and reading continues with the next line; a malformed array
    element yields one JsonParseError and ends the file (there is no safe place to resume).
    """
    with open(path, encoding="utf-8-sig", errors="strict", newline="") as f:
        try:
            head = f.read(4096)
        except UnicodeDecodeError as exc:
            yield JsonParseError(1, f"not UTF-8 text ({exc.reason})")
            return
        stripped = head.lstrip()
        if not stripped:
            return
        if stripped[0] == "[" and path.suffix.lower() not in (".jsonl", ".ndjson"):
            yield from _iter_array(f, head)
            return
        # JSONL, or one object spread over several lines (a .json holding a single record).
        first_line = head.split("\n", 1)[0]
        if stripped[0] == "{" and path.suffix.lower() not in (".jsonl", ".ndjson") and not _is_complete(first_line):
            rest = head + f.read()
            try:
                yield _line_of(head, len(head) - len(stripped)), json.loads(rest)
            except json.JSONDecodeError as exc:
                yield JsonParseError(exc.lineno, exc.msg)
            return
        yield from _iter_lines(head, f)


def _is_complete(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _iter_lines(head: str, f) -> Iterator[tuple[int, Any] | JsonParseError]:
    def lines():
        pending = head
        while True:
            nl = pending.find("\n")
            while nl >= 0:
                yield pending[: nl + 1]
                pending = pending[nl + 1 :]
                nl = pending.find("\n")
            try:
                more = f.read(CHUNK_CHARS)
            except UnicodeDecodeError as exc:
                raise _Utf8Error(str(exc.reason)) from None
            if not more:
                if pending:
                    yield pending
                return
            pending += more

    lineno = 0
    try:
        for text in lines():
            lineno += 1
            if not text.strip():
                continue
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as exc:
                yield JsonParseError(lineno, f"{exc.msg} (column {exc.colno})")
    except _Utf8Error as exc:
        yield JsonParseError(lineno + 1, f"not UTF-8 text ({exc})")


class _Utf8Error(Exception):
    pass


def _iter_array(f, buf: str) -> Iterator[tuple[int, Any] | JsonParseError]:
    decoder = json.JSONDecoder()
    pos = buf.index("[") + 1
    line_base = 1  # line number of buf[0]
    counted_pos, counted_line = 0, 1  # incremental newline counting within buf
    eof = False

    def line_at(p: int) -> int:
        nonlocal counted_pos, counted_line
        if p < counted_pos:
            counted_pos, counted_line = 0, line_base
        counted_line += buf.count("\n", counted_pos, p)
        counted_pos = p
        return counted_line

    counted_line = line_base

    def refill() -> bool:
        nonlocal buf, pos, line_base, counted_pos, counted_line, eof
        if eof:
            return False
        try:
            more = f.read(CHUNK_CHARS)
        except UnicodeDecodeError as exc:
            raise _Utf8Error(str(exc.reason)) from None
        if not more:
            eof = True
            return False
        # Drop the consumed prefix so the buffer only holds the current record.
        line_base += buf.count("\n", 0, pos)
        buf = buf[pos:] + more
        pos = 0
        counted_pos, counted_line = 0, line_base
        return True

    def skip_ws() -> bool:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf):
                return True
            if not refill():
                return False

    try:
        first = True
        while True:
            if not skip_ws():
                yield JsonParseError(line_at(pos), "unexpected end of file: the JSON array is not closed with ']'")
                return
            if buf[pos] == "]":
                return
            if not first:
                if buf[pos] != ",":
                    yield JsonParseError(line_at(pos), f"expected ',' or ']' between records, found {buf[pos]!r}")
                    return
                pos += 1
                if not skip_ws():
                    yield JsonParseError(line_at(pos), "unexpected end of file after ','")
                    return
            first = False
            while True:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                    # A number or literal cut at the buffer's end decodes "successfully": make sure it is whole.
                    if end == len(buf) and not eof and refill():
                        continue
                    break
                except json.JSONDecodeError as exc:
                    if len(buf) - pos > MAX_RECORD_CHARS or not refill():
                        yield JsonParseError(line_at(exc.pos), exc.msg)
                        return
            yield line_at(pos), record
            pos = end
    except _Utf8Error as exc:
        yield JsonParseError(line_at(pos), f"not UTF-8 text ({exc})")
