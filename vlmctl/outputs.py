"""Folders vlmctl writes as a whole, and the one place where an existing one is replaced.

`data prepare` (data.prepared_dir, the `--export-dir` folder), `model build` (model.output_dir), `vlmctl convert -o`,
`vlmctl eval -o` and the generated data of `vlmctl init` write a complete folder under a temporary name, put a
marker file in it (`.vlmctl-output.json`: {"kind", "vlmctl_version"}) and rename it into place (`install`).

Before an existing folder is replaced, `check_replaceable` proves that doing so loses nothing:

- the folder was written by the same kind of command: it holds that kind's marker (or, for folders written before
  markers existed, that kind's own record file, `RECORDS`), or it is empty;
- no input of the run (a data source, an image folder, the model, a checkpoint) is the folder or lies inside it;
- no other vlmctl result (a marker or record file of another kind, a project file, a training checkpoint) lies
  inside it: e.g. `outputs/`, which holds the built model and every run.

Otherwise it raises UsageError naming the path and the fix; nothing has been written or removed then.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

from vlmctl import __version__
from vlmctl.errors import UsageError
from vlmctl.files import honour_umask

MARKER = ".vlmctl-output.json"

KINDS = {
    "prepared": "prepared data (`vlmctl data prepare`)",
    "energon": "an Energon export (`vlmctl data prepare --export energon`)",
    "model": "a built model (`vlmctl model build`)",
    "export": "a converted model (`vlmctl convert`)",
    "eval": "an evaluation (`vlmctl eval`)",
    "generated": "generated sample data (`vlmctl init`, `vlmctl demo`)",
}

# The file each kind wrote before markers existed: such a folder is recognised as that kind's own.
RECORDS = {
    "prepared": ("manifest.json",),
    "energon": (".nv-meta/dataset.yaml",),
    "model": ("vlmctl_model.json",),
    "export": ("vlmctl_export.json",),
    "eval": ("metrics.json",),
    "generated": ("shapes_vqa.json", "moving_shapes.json", "tones.json"),
}

# Inside a folder being replaced, these name something else that would be lost with it.
FOREIGN = {
    "vlmctl.yaml": "a vlmctl project",
    "trainer_state.json": "a training checkpoint",
    "vlmctl_model.json": "a built model",
    "vlmctl_export.json": "a converted model",
    ".lock": "a training run",
}

# Results that may hold another kind's folder of their own: prepared data holds its default Energon export.
NESTED_OK = {"prepared": {"energon"}}


def marker_kind(folder: Path) -> str | None:
    """The kind recorded in `folder`'s marker, "?" for an unreadable one, None without a marker."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    try:
        return str(json.loads(path.read_text()).get("kind")) or "?"
    except (OSError, ValueError, AttributeError):
        return "?"


def write_marker(folder: Path, kind: str) -> None:
    """Record in `folder` that vlmctl wrote it as a result of `kind` (one of `KINDS`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    (Path(folder) / MARKER).write_text(json.dumps({"kind": kind, "vlmctl_version": __version__}) + "\n")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _resolved(path) -> Path | None:
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):
        return None


def local_paths(*refs) -> list[Path]:
    """The entries of `refs` (paths, Hub ids, inline text, None) that name something on this machine."""
    out = []
    for ref in refs:
        if not ref:
            continue
        try:
            if Path(ref).expanduser().exists():
                out.append(Path(ref))
        except (OSError, ValueError):
            continue
    return out


def check_inputs_outside(target: Path, inputs: Iterable, *, what: str, fix: str) -> None:
    """Raise UsageError when any of `inputs` (paths; None and non-local entries are skipped) is `target` or lies
    inside it: replacing `target` would delete that input."""
    folder = _resolved(target)
    if folder is None:
        return
    for item in inputs:
        if item is None or str(item) == "":
            continue
        path = _resolved(item)
        if path is not None and _inside(path, folder):
            same = "is" if path == folder else "holds"
            raise UsageError(f"{what} {target} {same} an input of this run ({item}): writing it would delete that input",
                             hint=fix)


def check_replaceable(target: Path | str, kind: str, *, inputs: Iterable = (), what: str = "the output",
                      fix: str = "choose another output folder") -> None:
    """Raise UsageError unless `target` may be replaced by a new result of `kind` (see the module docstring):
    it does not exist, is empty, or holds `kind`'s marker (or record file) and nothing else of value, and none of
    `inputs` lies inside it. `what` names the folder in the message (e.g. "data.prepared_dir"), `fix` is the hint."""
    target = Path(target)
    inputs = list(inputs)
    check_inputs_outside(target, inputs, what=what, fix=fix)
    if not target.exists() and not target.is_symlink():
        return
    if target.is_symlink() or not target.is_dir():
        raise UsageError(f"{what} {target} exists and is not a folder vlmctl wrote (a {'link' if target.is_symlink() else 'file'})",
                         hint=f"{fix}, or remove it yourself")
    try:
        entries = list(os.scandir(target))
    except OSError as exc:
        raise UsageError(f"cannot read {what} {target}: {exc.strerror}", hint=fix) from exc
    if not entries:
        return
    found = marker_kind(target)
    if found is None and any((target / name).is_file() for name in RECORDS.get(kind, ())):
        found = kind
    if found != kind:
        held = KINDS.get(found or "", "files vlmctl did not write")
        raise UsageError(
            f"{what} {target} already exists and holds {held}, not {KINDS[kind]}: replacing it would delete those files",
            hint=f"{fix}, or move the folder away yourself",
        )
    allowed = NESTED_OK.get(kind, set())
    for root, dirs, files in os.walk(target):
        if Path(root) == target:
            names = [n for n in files if n == "vlmctl.yaml" or n == "trainer_state.json" or n == ".lock"]
        else:
            nested = marker_kind(Path(root))
            if nested is not None and nested in allowed:
                dirs[:] = []
                continue
            names = [n for n in files if n in FOREIGN or n == MARKER]
        if names:
            name = names[0]
            held = FOREIGN.get(name) or KINDS.get(marker_kind(Path(root)) or "", "another vlmctl result")
            raise UsageError(
                f"{what} {target} holds {held} ({Path(root) / name}): replacing the folder would delete it",
                hint=f"{fix}, or move {Path(root)} out of it first",
            )


def install(tmp: Path, final: Path, kind: str) -> None:
    """Mark the finished folder `tmp` as a result of `kind` and rename it to `final`. An existing `final` (which the
    caller proved replaceable with `check_replaceable`) is moved aside first and removed only after the rename, so
    an interruption leaves either the old or the new folder in place. The folder's files get the modes the umask
    gives new files (temporary folders are 0700 and safetensors writes 0600: `files.honour_umask`)."""
    write_marker(tmp, kind)
    honour_umask(tmp)
    old = None
    if final.exists() or final.is_symlink():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    try:
        tmp.rename(final)
    except BaseException:
        if old is not None:
            old.rename(final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_fresh(target: Path | str, kind: str, *, inputs: Iterable = (), force: bool = False, what: str = "the output",
                fix: str = "choose another output folder (-o)") -> None:
    """Raise UsageError unless `target` may become a new result of `kind`: it does not exist or is empty, or, with
    `force`, it passes `check_replaceable`; in every case no input lies inside it."""
    target = Path(target)
    inputs = list(inputs)
    check_inputs_outside(target, inputs, what=what, fix=fix)
    if not (target.exists() or target.is_symlink()):
        return
    if target.is_dir() and not target.is_symlink() and not any(os.scandir(target)):
        return
    if not force:
        raise UsageError(f"{what} {target} already exists", hint=f"pass --force to replace it, or {fix}")
    check_replaceable(target, kind, inputs=inputs, what=what, fix=fix)


@contextlib.contextmanager
def fresh_folder(target: Path | str, kind: str, *, inputs: Iterable = (), force: bool = False, what: str = "the output",
                 fix: str = "choose another output folder (-o)") -> Iterator[Path]:
    """A new, empty folder `target` for a result of `kind` that is written in place (e.g. an evaluation).

    An existing non-empty `target` is refused without `force`; with it, it must pass `check_replaceable` and is
    moved aside, removed once the body succeeds, and put back if the body fails. The finished folder gets the marker.
    Raises UsageError (see `check_replaceable`)."""
    target = Path(target)
    inputs = list(inputs)
    check_fresh(target, kind, inputs=inputs, force=force, what=what, fix=fix)
    old = None
    if target.exists() or target.is_symlink():
        if target.is_dir() and not target.is_symlink() and not any(os.scandir(target)):
            target.rmdir()
        else:
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            if old.exists():
                shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
    target.mkdir(parents=True)
    try:
        yield target
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        if old is not None:
            old.rename(target)
        raise
    write_marker(target, kind)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
