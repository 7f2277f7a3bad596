"""Streaming JSON / JSONL record iteration with line numbers, each record isolated from the others.

- JSONL is read as bytes, line by line; each line is decoded (UTF-8) and parsed on its own, so an invalid byte, a
  syntax error, a record nested too deep or a record too large costs that line only.
- A JSON array is read through a sliding text buffer; a chunk that is not valid UTF-8 is decoded with
  `errors="surrogateescape"` (an invalid byte becomes a lone surrogate, found in the element's text afterwards) and parsed one element at a time with
  `json.JSONDecoder.raw_decode`, so a 1 GB LLaVA-style file is never held whole. Elements that do not fit the
  buffer, or that nest too deep, are delimited by a structural scan (brackets, strings, escapes) that never
  recurses. An element with an invalid byte, too deep or too large is rejected alone; a syntax error inside an
  element ends the file (there is no safe place to resume) and says so.
- A `.json` file holding one object over several lines is parsed whole (up to `MAX_RECORD_BYTES`).

Every record knows its line: the line where it starts; when several elements of an array start on the same line
(a minified one-line array) they also carry their element index (location `file.json:1[#17]`).

Limits per record: `MAX_RECORD_BYTES` (reason `too_large`) and `MAX_DEPTH` levels of nesting (reason `too_deep`).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from vlmctl.errors import DataError

# numpy is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

CHUNK_CHARS = 1 << 20  # bytes read per refill of the array buffer
MAX_RECORD_BYTES = 64 << 20  # a record larger than this is rejected as too_large (never buffered further)
MAX_DEPTH = 100  # a record nested deeper than this is rejected as too_deep (conversation records nest ~6 levels)
HEAD_BYTES = 4096

_BOM = b"\xef\xbb\xbf"
_STRUCT = re.compile(r'[\[\]{}"]')
_STRING_END = re.compile(r'["\\]')
_SURROGATE = re.compile("[\udc80-\udcff]")
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


@dataclass
class JsonParseError:
    """A record that cannot be used: `reason` is parse_error, too_deep or too_large; `index` is the element index
    when several array elements start on `line`."""

    line: int
    message: str
    reason: str = "parse_error"
    index: int | None = None

    @property
    def where(self) -> str:
        """`LINE` or `LINE[#INDEX]`: what follows `file:` in a location."""
        return where(self.line, self.index)


@dataclass
class JsonRecord:
    """One decoded record and where it starts."""

    line: int
    value: Any
    index: int | None = None

    @property
    def where(self) -> str:
        return where(self.line, self.index)


def where(line: int, index: int | None) -> str:
    """`12`, or `1[#17]` for the 18th element of an array whose elements share line 1."""
    return f"{line}" if index is None else f"{line}[#{index}]"


def iter_json_records(path: Path) -> Iterator[tuple[int, Any] | JsonParseError]:
    """(line, record) for every record of a JSON array, a JSONL file or a single JSON object; a JsonParseError for
    every record that cannot be used (see `read_json`)."""
    for item in read_json(path):
        yield item if isinstance(item, JsonParseError) else (item.line, item.value)


class DuplicateKeyError(ValueError):
    """An object of a record names the same key twice (json keeps the last value silently)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return out


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)
"""Decodes records; an object with a repeated key raises DuplicateKeyError (the record is a parse_error)."""


def _duplicate(line: int, exc: DuplicateKeyError, index: int | None = None) -> JsonParseError:
    return JsonParseError(line, f"the key {ascii(exc.key)} appears twice in one object (which value is meant is unclear)", index=index)


def open_regular(path: Path) -> BinaryIO:
    """`open(path, "rb")` for a regular file only: opened without blocking and checked on the open file, so a FIFO,
    device or socket is refused before a byte is read (a FIFO would block forever). Raises DataError naming the file,
    OSError when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise DataError(f"{path} is not a regular file (a FIFO, device, socket or folder): it is not read",
                            hint="point data.sources[].path at data files")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_regular(path: Path) -> None:
    """Raise DataError unless `path` is a regular file (symlinks followed); see `open_regular`."""
    open_regular(path).close()


def read_json(path: Path) -> Iterator[JsonRecord | JsonParseError]:
    """Every record of a JSON array, a JSONL file or a single JSON object, in file order.

    A record that cannot be used yields a JsonParseError and reading goes on with the next one, except after a
    syntax error inside an array element (the message says that the rest of the file was not read).
    Raises OSError when the file cannot be read, DataError when it is not a regular file.
    """
    path = Path(path)
    jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
    with open_regular(path) as f:
        head = f.read(HEAD_BYTES)
        stripped = head.removeprefix(_BOM).lstrip()
        if not stripped and len(head) < HEAD_BYTES:
            return
        first = stripped[:1]
        if first == b"[" and not jsonl:
            yield from _with_indices(_iter_array(path))
            return
        f.seek(0)
        if first == b"{" and not jsonl:
            line = f.readline(MAX_RECORD_BYTES + 1)
            if len(line) <= MAX_RECORD_BYTES and not _is_complete(line):
                # One object spread over several lines (a .json holding a single record).
                f.seek(0)
                yield from _iter_whole(f)
                return
            f.seek(0)
        yield from _iter_lines(f)


def _is_complete(line: bytes) -> bool:
    try:
        json.loads(line.removeprefix(_BOM).decode("utf-8", errors="replace"))
        return True
    except (json.JSONDecodeError, RecursionError):
        return False


# ------------------------------------------------------------------------------------------------ one record


def max_depth(text: str) -> int:
    """Deepest nesting of brackets/braces in JSON `text`, strings excluded; iterative (no recursion)."""
    import numpy as np

    rest = _JSON_STRING.sub("", text).encode("ascii", errors="ignore")
    codes = np.frombuffer(rest, dtype=np.uint8)
    delta = np.isin(codes, (0x5B, 0x7B)).astype(np.int64) - np.isin(codes, (0x5D, 0x7D))
    return int(np.cumsum(delta).max(initial=0))


def _depth_error(text: str, line: int, index: int | None = None) -> JsonParseError | None:
    # Counting openers is cheap; the exact depth is computed only when the count could exceed the limit.
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return None
    depth = max_depth(text)
    if depth <= MAX_DEPTH:
        return None
    return JsonParseError(line, f"record is nested {depth:,} levels deep, over the limit of {MAX_DEPTH}", "too_deep", index)


def _too_large(size: int, line: int, index: int | None = None, unit: str = "bytes") -> JsonParseError:
    limit = f"{MAX_RECORD_BYTES >> 20} MiB" if MAX_RECORD_BYTES >= 1 << 20 else f"{MAX_RECORD_BYTES:,} bytes"
    return JsonParseError(line, f"record is {size:,} {unit} long, over the limit of {limit} per record", "too_large", index)


def decode_record(data: bytes, line: int = 1) -> JsonRecord | JsonParseError:
    """One record's bytes (a JSONL line, a whole file or a tar member, starting at `line`) -> the record, or why it
    cannot be used (invalid UTF-8, nested deeper than MAX_DEPTH, a syntax error). Never raises."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad_line = line + data.count(b"\n", 0, exc.start)
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        return JsonParseError(bad_line, f"not UTF-8 text: byte 0x{data[exc.start]:02x} at column {column} ({exc.reason})")
    error = _depth_error(text, line)
    if error is not None:
        return error
    try:
        return JsonRecord(line, _DECODER.decode(text))
    except json.JSONDecodeError as exc:
        return JsonParseError(line + exc.lineno - 1, f"{exc.msg} (column {exc.colno})")
    except DuplicateKeyError as exc:
        return _duplicate(line, exc)
    except RecursionError:
        return JsonParseError(line, f"record is nested too deep (over the limit of {MAX_DEPTH} levels)", "too_deep")


# ------------------------------------------------------------------------------------------------ JSONL / whole


def _iter_lines(f: BinaryIO) -> Iterator[JsonRecord | JsonParseError]:
    lineno = 0
    while True:
        data = f.readline(MAX_RECORD_BYTES + 1)
        if not data:
            return
        lineno += 1
        if lineno == 1:
            data = data.removeprefix(_BOM)
        if len(data) > MAX_RECORD_BYTES:
            size = len(data)
            while not data.endswith(b"\n"):  # skip the rest of the line without holding it
                data = f.readline(CHUNK_CHARS)
                if not data:
                    break
                size += len(data)
            yield _too_large(size, lineno)
            continue
        data = data.rstrip(b"\r\n")
        if not data.strip():
            continue
        yield decode_record(data, lineno)


def _iter_whole(f: BinaryIO) -> Iterator[JsonRecord | JsonParseError]:
    data = f.read(MAX_RECORD_BYTES + 1).removeprefix(_BOM)
    if len(data) > MAX_RECORD_BYTES:
        yield _too_large(len(data), 1, unit="bytes")
        return
    start = len(data) - len(data.lstrip())
    line = 1 + data.count(b"\n", 0, start)
    item = decode_record(data[start:], line)
    if isinstance(item, JsonParseError) and item.reason == "parse_error":
        # Perhaps JSONL in a .json file whose first line is broken: read it line by line when other lines parse.
        lines = data.split(b"\n")
        if sum(1 for x in lines[1:] if x.strip() and _is_complete(x)) > 0:
            import io

            yield from _iter_lines(io.BytesIO(data))
            return
    yield item


# ------------------------------------------------------------------------------------------------ JSON arrays


class _Window:
    """A text buffer over the file: `buf` holds the text from the element being read on; `line_at(p)` counts lines
    incrementally. Bytes are decoded chunk by chunk: strictly (fast) when the chunk is valid UTF-8, else with
    `surrogateescape`, and then `dirty` is set until the invalid bytes have left the buffer."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.buf = ""
        self.eof = False
        self.dirty = False  # the buffer may hold lone surrogates (invalid bytes)
        self.line_base = 1  # line number of buf[0]
        self._pos, self._line = 0, 1
        self._pending = b""  # an incomplete UTF-8 sequence at the end of the last chunk
        self._first = True

    def _read(self) -> str:
        raw = self._pending + self.f.read(max(CHUNK_CHARS, HEAD_BYTES) if self._first else CHUNK_CHARS)
        if self._first:
            raw, self._first = raw.removeprefix(_BOM), False
        cut = _complete_prefix(raw) if len(raw) > len(self._pending) else len(raw)
        raw, self._pending = raw[:cut], raw[cut:]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.dirty = True
            return raw.decode("utf-8", errors="surrogateescape")

    def refill(self, keep_from: int) -> int:
        """Drop buf[:keep_from], append the next chunk; return how many characters were dropped, or -1 at EOF."""
        if self.eof:
            return -1
        more = self._read()
        if not more:
            self.eof = True
            return -1
        if self.dirty and not (_SURROGATE.search(self.buf, keep_from) or _SURROGATE.search(more)):
            self.dirty = False
        self.line_base += self.buf.count("\n", 0, keep_from)
        self.buf = self.buf[keep_from:] + more
        self._pos, self._line = 0, self.line_base
        return keep_from

    def line_at(self, p: int) -> int:
        if p < self._pos:
            self._pos, self._line = 0, self.line_base
        self._line += self.buf.count("\n", self._pos, p)
        self._pos = p
        return self._line


def _complete_prefix(raw: bytes) -> int:
    """Length of `raw` without a UTF-8 sequence cut at its end (kept for the next chunk)."""
    for back in range(1, min(4, len(raw)) + 1):
        b = raw[-back]
        if b < 0x80:
            return len(raw)
        if b >= 0xC0:  # a lead byte: its sequence needs 2, 3 or 4 bytes
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return len(raw) - back if need > back else len(raw)
    return len(raw)


class _Scan:
    """Incremental structural scan of one JSON container or string: depth and strings across buffer refills."""

    def __init__(self):
        self.depth = 0
        self.deepest = 0
        self.in_string = False
        self.escape = False

    def run(self, buf: str, p: int) -> int | None:
        """Scan `buf` from `p`; the offset just after the value, or None when `buf` ends first."""
        n = len(buf)
        while p < n:
            if self.escape:
                p += 1
                self.escape = False
                continue
            if self.in_string:
                m = _STRING_END.search(buf, p)
                if m is None:
                    return None
                p = m.end()
                if m.group() == "\\":
                    self.escape = True
                    continue
                self.in_string = False
                if self.depth == 0:
                    return p
                continue
            m = _STRUCT.search(buf, p)
            if m is None:
                return None
            p = m.end()
            c = m.group()
            if c == '"':
                self.in_string = True
            elif c in "[{":
                self.depth += 1
                self.deepest = max(self.deepest, self.depth)
            else:
                self.depth -= 1
                if self.depth <= 0:
                    return p
        return None


def _iter_array(path: Path) -> Iterator[tuple[int, int, JsonRecord | JsonParseError]]:
    """(start line, element index, item) per element, in order; reading ends after an error that stops it."""
    with open_regular(path) as f:
        w = _Window(f)
        pos, _ = _skip_ws(w, 0)
        pos += 1  # the "[" read_json saw
        decoder = _DECODER
        k = 0
        while True:
            pos, ok = _skip_ws(w, pos)
            if not ok:
                yield w.line_at(pos), k, JsonParseError(w.line_at(pos), "unexpected end of file: the JSON array is not closed with ']'")
                return
            if w.buf[pos] == "]":
                return
            if k > 0:
                if w.buf[pos] != ",":
                    line = w.line_at(pos)
                    yield line, k, JsonParseError(line, f"expected ',' or ']' between records, found {w.buf[pos]!r}; the rest of the file was not read")
                    return
                pos, ok = _skip_ws(w, pos + 1)
                if not ok:
                    yield w.line_at(pos), k, JsonParseError(w.line_at(pos), "unexpected end of file after ','")
                    return
            line = w.line_at(pos)
            item, pos, stop = _read_element(w, decoder, pos, line, k)
            yield line, k, item
            if stop:
                return
            k += 1


def _skip_ws(w: _Window, pos: int) -> tuple[int, bool]:
    while True:
        while pos < len(w.buf) and w.buf[pos] in " \t\r\n":
            pos += 1
        if pos < len(w.buf):
            return pos, True
        shift = w.refill(pos)
        if shift < 0:
            return pos, False
        pos -= shift


def _read_element(w: _Window, decoder: json.JSONDecoder, start: int, line: int, k: int) -> tuple[JsonRecord | JsonParseError, int, bool]:
    """Decode the element at `start`: (item, offset after it, whether reading must stop)."""
    while True:
        try:
            value, end = decoder.raw_decode(w.buf, start)
        except (json.JSONDecodeError, RecursionError):
            break
        except DuplicateKeyError:
            return _scan_element(w, decoder, start, line, k)  # finds where the element ends, then reports it
        # A number or literal cut at the buffer's end decodes "successfully": make sure it is whole.
        if end == len(w.buf) and not w.eof:
            shift = w.refill(start)
            if shift >= 0:
                start -= shift
                continue
        if end - start > MAX_RECORD_BYTES:
            return _too_large(end - start, line, k, unit="characters"), end, False
        bad = _SURROGATE.search(w.buf, start, end) if w.dirty else None
        if bad is not None:
            return _utf8_error(w, bad.start(), k), end, False
        if w.buf.count("[", start, end) + w.buf.count("{", start, end) > MAX_DEPTH:
            error = _depth_error(w.buf[start:end], line, k)
            if error is not None:
                return error, end, False
        return JsonRecord(line, value, k), end, False
    if w.buf[start] not in '[{"':
        # A scalar that does not decode: more text may complete it (a literal cut by the buffer), else it is wrong.
        while len(w.buf) - start < 1024 and not w.eof:
            shift = w.refill(start)
            if shift < 0:
                break
            start -= shift
            try:
                value, end = decoder.raw_decode(w.buf, start)
                return JsonRecord(line, value, k), end, False
            except json.JSONDecodeError:
                continue
        return _syntax_error(w, decoder, start, k), start, True
    return _scan_element(w, decoder, start, line, k)


def _scan_element(w: _Window, decoder: json.JSONDecoder, start: int, line: int, k: int) -> tuple[JsonRecord | JsonParseError, int, bool]:
    """Find the end of the container/string at `start` by a structural scan (refilling as needed, dropping the
    text of a record already known to be too large), then decode it or say why not."""
    scan = _Scan()
    p = start
    skipped = 0  # characters of this element already dropped from the buffer
    while True:
        end = scan.run(w.buf, p)
        if end is not None:
            break
        p = len(w.buf)
        size = skipped + p - start
        keep = start
        if size > MAX_RECORD_BYTES:  # stop holding it: keep scanning to find where it ends
            skipped += p - start
            keep = start = p
        shift = w.refill(keep)
        if shift < 0:
            err = JsonParseError(line, "unexpected end of file inside this record: the rest of the file was not read", index=k)
            return err, len(w.buf), True
        start -= shift
        p -= shift
    size = skipped + end - start
    if size > MAX_RECORD_BYTES:
        return _too_large(size, line, k, unit="characters"), end, False
    if scan.deepest > MAX_DEPTH:
        return JsonParseError(line, f"record is nested {scan.deepest:,} levels deep, over the limit of {MAX_DEPTH}", "too_deep", k), end, False
    bad = _SURROGATE.search(w.buf, start, end) if w.dirty else None
    if bad is not None:
        return _utf8_error(w, bad.start(), k), end, False
    try:
        value = _DECODER.decode(w.buf[start:end])
    except json.JSONDecodeError as exc:
        return _syntax_error(w, decoder, start, k, exc), end, True
    except DuplicateKeyError as exc:
        return _duplicate(line, exc, k), end, False
    except RecursionError:
        return JsonParseError(line, f"record is nested too deep (over the limit of {MAX_DEPTH} levels)", "too_deep", k), end, False
    return JsonRecord(line, value, k), end, False


def _utf8_error(w: _Window, p: int, k: int) -> JsonParseError:
    byte = ord(w.buf[p]) - 0xDC00
    return JsonParseError(w.line_at(p), f"not UTF-8 text: byte 0x{byte:02x}", index=k)


def _syntax_error(w: _Window, decoder: json.JSONDecoder, start: int, k: int, exc: json.JSONDecodeError | None = None) -> JsonParseError:
    if exc is None:
        try:
            json.JSONDecoder().raw_decode(w.buf, start)  # without the duplicate-key check: only the syntax error is wanted
        except json.JSONDecodeError as e:
            exc = e
    if exc is None:
        return JsonParseError(w.line_at(start), "invalid JSON; the rest of the file was not read", index=k)
    # exc.pos is an offset into the text that was decoded: the buffer itself, or the element's text
    p = exc.pos if exc.doc is w.buf else start + exc.pos
    return JsonParseError(w.line_at(p), f"{exc.msg}; the rest of the file was not read", index=k)


def _with_indices(items: Iterator[tuple[int, int, JsonRecord | JsonParseError]]) -> Iterator[JsonRecord | JsonParseError]:
    """Drop the element index of elements alone on their start line (the line says where they are); keep it where
    several elements start on the same line. Looks one element ahead."""
    held = None  # (line, item, shares the line with the previous element)
    previous_line = None
    for line, _k, item in items:
        if held is not None:
            yield _strip_index(held[1], keep=held[2] or held[0] == line)
        held = (line, item, line == previous_line)
        previous_line = line
    if held is not None:
        yield _strip_index(held[1], keep=held[2])


def _strip_index(item: JsonRecord | JsonParseError, keep: bool) -> JsonRecord | JsonParseError:
    if not keep:
        item.index = None
    return item
