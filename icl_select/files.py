"""Files every stage writes and reads: atomic writes, tensors, JSON with one-line errors, and JSONL logs.

Whole files are written to a temporary name and renamed, so a kill never leaves a half-written one; JSONL logs are
flushed line by line, so a kill can leave one truncated last line, which `read_jsonl` alone judges and `append_jsonl`
mends. A full disk or quota is one line naming the file (`DiskFull`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, TextIO


class DataError(ValueError):
    """Malformed input data; the message names the file, the line (JSONL) and the field."""


class DiskFull(OSError):
    """No space left (or the quota is spent) while writing a file; the message names it."""


@contextlib.contextmanager
def full_disk_names(path: Path) -> Iterator[None]:
    """Inside the block, a full disk or quota is a DiskFull naming `path` (an OSError from a write names no file)."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or isinstance(e, DiskFull):
            raise
        raise DiskFull(f"{path}: the disk is full ({e.strerror}); free space, then re-run the same command") from None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """`data` to `path` through a temporary file and a rename; on any failure the temporary file is removed. A plain
    open(), so every file the kit writes gets the same mode (0666 less the umask)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with full_disk_names(path), open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def save_tensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Tensors to a safetensors file, atomically (contiguous CPU copies; safetensors holds tensors only, no pickle)."""
    from safetensors.torch import save

    atomic_write_bytes(path, save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata))


def read_tensors(path: Path, map_location: str = "cpu") -> dict:
    """Every tensor of a safetensors file; a missing, truncated or corrupt file is one line naming it."""
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt", device=map_location) as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@functools.cache
def _folder_digest(folder: Path, stats: tuple) -> str:
    h = hashlib.sha256()
    for name, *_ in stats:
        h.update(json.dumps([name, sha256(folder / name)]).encode())
    return "sha256:" + h.hexdigest()[:16]


def folder_digest(folder: Path) -> str:
    """Who a model folder is: a digest of every file in it (weights, config, tokenizer) by relative name and bytes,
    none hidden (caches), wherever the folder lies. Each folder is read once per process while no file in it changes
    (size, modification time, inode)."""
    folder = Path(folder).resolve()
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    stats = tuple(
        (str(p.relative_to(folder)), st.st_size, st.st_mtime_ns, st.st_ino) for p in files for st in [p.stat()]
    )
    return _folder_digest(folder, stats)


def selector_digest(source: Path) -> str:
    """Who the selector at `source` is, by content: SHA-256 over its weights and its settings (a run folder's
    model.safetensors and model.json; an epoch checkpoint holds both). Other settings with the same weights (its
    picks' order, what it was trained for) are another selector."""
    source = Path(source)
    if not source.is_dir():
        return sha256(source)
    return hashlib.sha256("".join(sha256(source / n) for n in ("model.safetensors", "model.json")).encode()).hexdigest()


def read_json(path: Path) -> object:
    if not path.is_file():
        raise DataError(f"{path}: missing file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None


Truncated = Literal["error", "warn", "skip"]


def read_jsonl(path: Path, truncated: Truncated = "error", hint: str = "") -> list[tuple[int, dict]]:
    """(line number, object) of every non-empty line; a line that does not parse is an error naming the file and
    line, except a last line without newline (a write cut short by a kill), which is an error (with `hint` on how
    to finish or ignore it), a warning, or skipped silently (progress files that are simply redone)."""
    if not path.is_file():
        raise DataError(f"{path}: missing file")
    text = path.read_text()
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((i, json.loads(line)))
        except json.JSONDecodeError as e:
            if i < len(lines) or text.endswith("\n"):
                raise DataError(f"{path} line {i}: not valid JSON ({e})") from None
            if truncated == "error":
                raise DataError(f"{path} line {i}: truncated last line (an interrupted write?){hint}") from None
            if truncated == "warn":
                print(f"warning: {path} line {i}: truncated last line ignored", file=sys.stderr)
    return out


def append_line(path: Path, line: str) -> None:
    """`line` and a newline appended to `path`, flushed on return (a log written as it goes)."""
    with full_disk_names(path), open(path, "a") as f:
        f.write(line + "\n")


def append_jsonl(path: Path) -> TextIO:
    """`path` opened for appending lines. A last line without newline (a killed write) would glue the next line
    onto it: one that parses (only the newline was lost) gets its newline, one that does not is cut, as
    `read_jsonl` reads them."""
    text = path.read_text() if path.exists() else ""
    if text and not text.endswith("\n"):
        head, tail = text[: text.rfind("\n") + 1], text[text.rfind("\n") + 1 :]
        try:
            json.loads(tail)
            atomic_write_text(path, text + "\n")
        except json.JSONDecodeError:
            print(f"note: {path}: dropping a truncated last line from an interrupted run", file=sys.stderr)
            atomic_write_text(path, head)
    return path.open("a")
