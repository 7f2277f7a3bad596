"""How vlmctl writes files: whole or not at all (`atomic_write`), and with the modes of a plain `open()` / `mkdir()`
under the process's umask (`honour_umask`).

Temporary files and folders (`tempfile.mkstemp`, `mkdtemp`) are created 0600 / 0700 and some writers (safetensors)
create their files 0600; renamed into place they would keep that mode, so a project, a built model or an export
would be unreadable to the group even where the umask allows it. `honour_umask` resets them before the rename.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: Path) -> Path:
    """Give `path` (and, for a folder, everything below it) the mode a new file (0666) or folder (0777) gets under
    the umask; returns `path`. Symlinks are left alone."""
    mask = current_umask()
    path = Path(path)
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
    return path


def atomic_write(path: Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` through a temporary file in the same folder and a rename, so a reader never
    sees a half-written file. Returns `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


__all__ = ["atomic_write", "current_umask", "honour_umask"]
