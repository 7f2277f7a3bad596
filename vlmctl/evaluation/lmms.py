"""Run lmms-eval (github.com/EvolvingLMMs-Lab/lmms-eval, the community's evaluation harness) on a model folder and
read its scores back as flat `lmms_eval/<task>/<metric>` entries for metrics.json. Optional dependency.

lmms-eval runs as its documented command line, `python -m lmms_eval --model ADAPTER --model_args ... --tasks ...`,
in a child process of the same interpreter. The bridge:

- picks the adapter from the model's family (`FamilySpec.lmms_model`; `llava_hf` for composed models);
- passes the device and dtype of this machine in `--model_args` (`device`, `device_map`, and `dtype` where the
  adapter takes one: read from the adapter's `__init__` in lmms-eval's source), because adapters default to
  `cuda` and some to an empty `device_map`, which transformers 5 refuses;
- checks, before starting anything, that the modules the adapter imports at load time are installed (decord for
  `llava_hf` and the Qwen adapters), reading lmms-eval's source without importing it;
- streams lmms-eval's output to stderr and to `lmms_eval.log`, and turns a failed run into a VlmctlError that
  shows lmms-eval's last error lines. lmms-eval's CLI catches an exception during evaluation, logs
  "Error during evaluation: ..." and still exits with status 0 (lmms_eval/__main__.py, `cli_evaluate`); that line,
  a non-zero status, or a run that wrote no results file counts as a failure.

Written against lmms-eval 0.7.3 (its CLI, adapter layout and results files). Install it without replacing torch: `install_command()` and
docs/evaluation.md.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Iterable, TextIO

from vlmctl.errors import ModelError, UsageError, VlmctlError
from vlmctl.families import compose_family, detect_family, get_family
from vlmctl.inference.load import resolve_device, resolve_dtype

LOG_FILE = "lmms_eval.log"
"""lmms-eval's whole output (stdout and stderr, in order), written next to its results under `OUT/lmms_eval/`."""

# The line lmms-eval's CLI logs when it swallows an exception (and then exits 0).
_SWALLOWED = "Error during evaluation"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_LOGURU_ERROR = re.compile(r"\|\s*(?:ERROR|CRITICAL)\s*\|.*? - (.*)$")
# Import names whose pip package is named differently.
_PACKAGE_OF = {"cv2": "opencv-python-headless", "PIL": "pillow", "sklearn": "scikit-learn", "yaml": "pyyaml"}


# ---------------------------------------------------------------------------------------------------------------
# Installation
# ---------------------------------------------------------------------------------------------------------------


def lmms_eval_available() -> bool:
    """Whether the `lmms_eval` package can be imported here (`importlib.util.find_spec`; nothing is imported)."""
    return importlib.util.find_spec("lmms_eval") is not None


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_command(*packages: str) -> str:
    """`pip install PACKAGES "torch==<installed version>"`: naming the installed torch keeps pip's resolver from
    replacing it (lmms-eval asks for `torch>=2.1` and `torchvision`, whose newest release pins a newer torch).
    Without torch installed, plain `pip install PACKAGES`."""
    version = _installed_version("torch")
    pin = f' "torch=={version}"' if version else ""
    return f"pip install {' '.join(packages)}{pin}"


def install_hint() -> str:
    """How to install lmms-eval here without replacing torch, for an error's `hint=`."""
    hint = f"{install_command('lmms-eval')}, then rerun"
    version = _installed_version("torch") or ""
    if "+cpu" in version:
        # PyPI's torchvision (which lmms-eval requires) is built for CUDA torch and fails to load beside a CPU build.
        hint += (f"; torch {version} is a CPU build: install the torchvision built for it from the same package "
                 "index first (docs/evaluation.md)")
    return hint


def check_installed() -> None:
    """Raise UsageError (exit 2) unless lmms-eval is installed, with the install command that keeps torch."""
    if not lmms_eval_available():
        raise UsageError("--lmms-eval needs the lmms-eval package, which is not installed", hint=install_hint())


# ---------------------------------------------------------------------------------------------------------------
# The adapter: which one, what it imports, what it accepts (read from lmms-eval's source, not imported)
# ---------------------------------------------------------------------------------------------------------------


def lmms_eval_root() -> Path | None:
    """The folder of the installed `lmms_eval` package, found without importing it (None when not installed)."""
    spec = importlib.util.find_spec("lmms_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def choose_adapter(model_dir: Path) -> str:
    """The lmms-eval model name (adapter) that loads `model_dir`: its family's `lmms_model` (from config.json's
    `model_type`), else the compose family's (`llava_hf` reads any LlavaForConditionalGeneration folder).
    Raises ModelError when the folder has no config.json."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelError(f"{model_dir} has no config.json: lmms-eval loads Hugging Face model folders",
                         hint="pass a final export (RUN/final), or the checkpoint folder a `model build` folder points at")
    config = json.loads(path.read_text())
    try:
        adapter = get_family(detect_family(config)).lmms_model
    except VlmctlError:
        adapter = None
    return adapter or compose_family().lmms_model


def adapter_files(adapter: str, root: Path | None = None) -> list[Path]:
    """The source file of lmms-eval's `adapter`: `models/chat/<adapter>.py`, which lmms-eval prefers, else
    `models/simple/<adapter>.py` (the layout of its model registry, `lmms_eval/models/__init__.py`). Empty when
    lmms-eval is not installed or has no such adapter file."""
    root = root or lmms_eval_root()
    if root is None:
        return []
    return [f for kind in ("chat", "simple") if (f := root / "models" / kind / f"{adapter}.py").is_file()][:1]


def _module_file(root: Path, module: str) -> Path | None:
    parts = module.split(".")[1:]
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if parts and candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=64)
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _load_time_imports(tree: ast.Module) -> Iterable[tuple[str, list[str]]]:
    """(module, imported names) of the imports in a module's top-level body. Imports inside try blocks, functions
    or `if` blocks are optional (lmms-eval guards them), so they are left out."""
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, [a.name for a in node.names]


def missing_modules(adapter: str, root: Path | None = None) -> list[str]:
    """Top-level modules that lmms-eval's `adapter` imports when it loads (following its imports of other
    `lmms_eval.models` modules) and that are not installed here, e.g. ["decord"] for `llava_hf`. Empty when the
    adapter's source cannot be found (lmms-eval then reports an unknown model itself)."""
    root = root or lmms_eval_root()
    files = adapter_files(adapter, root)
    if root is None or not files:
        return []
    missing: list[str] = []
    seen: set[Path] = set()
    todo = list(files)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for module, names in _load_time_imports(_parse(path)):
            top = module.split(".")[0]
            if top == "lmms_eval":
                if module.startswith("lmms_eval.models"):
                    todo += [f for m in (module, *(f"{module}.{n}" for n in names)) if (f := _module_file(root, m))]
            elif top not in missing and importlib.util.find_spec(top) is None:
                missing.append(top)
    return missing


def _registered_class(tree: ast.Module, name: str | None) -> ast.ClassDef | None:
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        if name is not None:
            if node.name == name:
                return node
            continue
        for dec in node.decorator_list:
            func = dec.func if isinstance(dec, ast.Call) else dec
            if isinstance(func, ast.Name) and func.id == "register_model":
                return node
    return None


def adapter_params(adapter: str, root: Path | None = None) -> set[str] | None:
    """The keyword arguments the `__init__` of lmms-eval's `adapter` class declares (the class registered with
    `@register_model` in its file; a chat class without `__init__` inherits its simple class's). None when the
    source cannot be read. Adapters reject any other key (`assert kwargs == {}`), so only these may be passed."""
    root = root or lmms_eval_root()
    files = adapter_files(adapter, root)
    if root is None or not files:
        return None
    path, name = files[0], None
    for _ in range(4):  # chat class -> simple class -> ... (one level in lmms-eval 0.7)
        tree = _parse(path)
        cls = _registered_class(tree, name)
        if cls is None:
            return None
        for item in cls.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                args = item.args
                return {a.arg for a in (*args.posonlyargs, *args.args[1:], *args.kwonlyargs)}
        imported = {alias.asname or alias.name: (node.module, alias.name)
                    for node in tree.body if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lmms_eval.models")
                    for alias in node.names}
        base = next((imported[b.id] for b in cls.bases if isinstance(b, ast.Name) and b.id in imported), None)
        if base is None or (path := _module_file(root, base[0])) is None:
            return None
        name = base[1]
    return None


def check_adapter(adapter: str, root: Path | None = None) -> None:
    """Raise UsageError (exit 2) when lmms-eval's `adapter` imports modules that are not installed, naming them
    and the pip command that adds them without replacing torch (and lmms-eval's extra that declares them)."""
    missing = missing_modules(adapter, root)
    if not missing:
        return
    packages = [_PACKAGE_OF.get(m, m) for m in missing]
    extras = sorted({e for p in packages if (e := _extra_declaring(p))})
    declared = f" (lmms-eval declares {', '.join(packages)} in its `{'`, `'.join(extras)}` extra)" if extras else ""
    names = ", ".join(missing)
    raise UsageError(f"lmms-eval's {adapter} adapter imports {names}, which {'is' if len(missing) == 1 else 'are'} "
                     f"not installed{declared}", hint=f"{install_command(*packages)}, then rerun")


def _extra_declaring(package: str) -> str | None:
    """The lmms-eval extra whose requirements name `package` (from its installed metadata), if any."""
    try:
        requires = importlib.metadata.requires("lmms_eval") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    norm = re.sub(r"[-_.]+", "-", package).lower()
    for req in requires:
        name = re.match(r"[A-Za-z0-9._-]+", req)
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", req)
        if name and extra and re.sub(r"[-_.]+", "-", name.group(0)).lower() == norm:
            return extra.group(1)
    return None


# ---------------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class LmmsPlan:
    """What the bridge runs: the adapter, its `--model_args` (in order), the full command, and notes for the user
    (e.g. that the adapter takes no dtype and loads in its own)."""

    adapter: str
    model_args: dict[str, str]
    command: list[str]
    notes: list[str] = field(default_factory=list)


def machine_device_dtype(device: str = "auto", dtype: str = "auto") -> tuple[str, str]:
    """(device, dtype) as lmms-eval's adapters name them: `cpu` or `cuda:0` (the first GPU for `auto`), and
    `float32` / `bfloat16` / `float16` (vlmctl's `auto`: bf16 on GPUs that support it, else fp32; see
    `vlmctl.inference.resolve_dtype`). Raises UsageError for an unknown or absent device or dtype."""
    device = resolve_device(device)
    if device == "cuda":
        device = "cuda:0"  # one process: the whole model on the first visible GPU
    return device, str(resolve_dtype(dtype, device)).removeprefix("torch.")


def plan_lmms_eval(model_dir: Path, tasks: str, out_dir: Path, batch_size: int = 1, *, device: str = "cpu",
                   dtype: str = "float32", include_path: Path | None = None, limit: int | None = None,
                   adapter: str | None = None, root: Path | None = None) -> LmmsPlan:
    """The lmms-eval command for `model_dir` on `tasks` (comma-separated), writing under `out_dir`.

    `device` / `dtype`: lmms-eval names (`machine_device_dtype`). `device` goes to the adapter as `device` and as
    `device_map` (some adapters default `device_map` to "", which transformers 5 refuses; others to "auto"),
    `dtype` only where the adapter's `__init__` takes one. `include_path`: a folder of custom task YAMLs
    (`--include_path`). `limit`: at most this many documents per task (`--limit`). Raises UsageError for a model
    path with a comma (lmms-eval splits `--model_args` at commas).
    """
    model_dir = Path(model_dir)
    if "," in str(model_dir):
        raise UsageError(f"{model_dir}: lmms-eval cannot load a model path with a comma (it splits --model_args at commas)",
                         hint="move or link the model folder to a path without commas")
    adapter = adapter or choose_adapter(model_dir)
    params = adapter_params(adapter, root)
    accepted = params if params is not None else {"device", "device_map"}  # every adapter vlmctl names takes both
    args = {"pretrained": str(model_dir)}
    notes = []
    if "device" in accepted:
        args["device"] = device
    if "device_map" in accepted:
        args["device_map"] = device
    if "dtype" in accepted:
        args["dtype"] = dtype
    elif params is not None:
        notes.append(f"lmms-eval's {adapter} adapter takes no dtype: it loads the model in its own (not {dtype})")
    command = [sys.executable, "-m", "lmms_eval", "--model", adapter,
               "--model_args", ",".join(f"{k}={v}" for k, v in args.items()),
               "--tasks", tasks, "--batch_size", str(batch_size), "--output_path", str(out_dir)]
    if include_path is not None:
        command += ["--include_path", str(include_path)]
    if limit is not None:
        command += ["--limit", str(limit)]
    return LmmsPlan(adapter=adapter, model_args=args, command=command, notes=notes)


def lmms_command(model_dir: Path, tasks: str, out_dir: Path, batch_size: int = 1, **kwargs) -> list[str]:
    """The `python -m lmms_eval ...` command line of `plan_lmms_eval` (same arguments)."""
    return plan_lmms_eval(model_dir, tasks, out_dir, batch_size, **kwargs).command


# ---------------------------------------------------------------------------------------------------------------
# Results and errors
# ---------------------------------------------------------------------------------------------------------------


def result_files(out_dir: Path) -> list[Path]:
    """The `*results*.json` files lmms-eval wrote under `out_dir` (one per run, in `<model>/<time>_results.json`)."""
    return sorted(Path(out_dir).rglob("*results*.json")) if Path(out_dir).is_dir() else []


def collect_scores(out_dir: Path, files: Iterable[Path] | None = None) -> dict[str, float]:
    """Numeric results of every `*results*.json` lmms-eval wrote under `out_dir` (or of `files`), as
    {"lmms_eval/task/metric": value} (lmms-eval names metrics `metric,filter`, e.g. `exact_match,none`; the `,none`
    filter suffix is dropped; stderr entries are left out). Values on the task's own scale."""
    scores: dict[str, float] = {}
    for f in sorted(files) if files is not None else result_files(out_dir):
        data = json.loads(Path(f).read_text())
        for task, values in (data.get("results") or {}).items():
            for name, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in name:
                    scores[f"lmms_eval/{task}/{name.removesuffix(',none')}"] = float(value)
    return scores


def error_lines(output: str, limit: int = 6) -> list[str]:
    """lmms-eval's last error lines in `output`: the exception line that closes each traceback and the messages
    it logged at ERROR level (colour codes and log prefixes removed); the last `limit` of them, else the last
    `limit` non-empty lines."""
    lines = [_ANSI.sub("", line).rstrip() for line in output.splitlines()]
    found: list[str] = []
    in_traceback = False
    for line in lines:
        if "Traceback (most recent call last):" in line:  # may follow a progress bar's last frame on one line
            in_traceback = True
        elif in_traceback:
            if line and not line.startswith((" ", "\t")):
                found.append(line)
                in_traceback = False
        elif m := _LOGURU_ERROR.search(line):
            found.append(m.group(1).strip())
    return found[-limit:] or [line for line in lines if line.strip()][-limit:]


def failure_hint(output: str, log: Path | None = None) -> str:
    """How to fix the failure `output` shows, for the usual causes; always ends with where the full output is."""
    text = _ANSI.sub("", output)
    tail = f" (lmms-eval's full output: {log})" if log else ""
    if m := re.search(r"No module named '([\w.]+)'", text):
        module = m.group(1).split(".")[0]
        return f"{install_command(_PACKAGE_OF.get(module, module))}, then rerun{tail}"
    if re.search(r"Couldn't reach|OfflineModeIsEnabled|LocalEntryNotFoundError|ConnectionError|Max retries exceeded", text):
        return ("this task downloads its data from the Hugging Face Hub when it runs: run where the Hub can be reached "
                "(HF_HUB_OFFLINE and HF_DATASETS_OFFLINE unset), or evaluate a local task with --lmms-eval-include DIR" + tail)
    if "Tasks not found" in text:
        return ("check the task names with `python -m lmms_eval --tasks list`; a custom task needs its folder: "
                "--lmms-eval-include DIR" + tail)
    if "torchvision::nms does not exist" in text:
        return ("the installed torchvision was built for another torch: install the torchvision built for this torch "
                "from the same package index (docs/evaluation.md)" + tail)
    if "batch_size_per_gpu > 1" in text:
        return "this lmms-eval adapter answers one sample at a time: leave out --batch-size (1)" + tail
    return f"see lmms-eval's error above{tail}"


# ---------------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------------


def run_lmms_eval(model_dir: Path, tasks: str, out_dir: Path, batch_size: int = 1, *, device: str = "auto",
                  dtype: str = "auto", include_path: Path | None = None, limit: int | None = None,
                  echo: bool = True, notes: list[str] | None = None) -> dict[str, float]:
    """Run lmms-eval's `tasks` (comma-separated) on `model_dir`, writing its files to `out_dir/lmms_eval`, and return
    the scores of this run (`collect_scores`).

    `device` / `dtype`: vlmctl names (`auto` = a GPU when there is one, bf16 there and fp32 on CPU), passed to
    the adapter (`plan_lmms_eval`). `batch_size`: lmms-eval's `--batch_size` (samples per generation call; most
    adapters take only 1). `include_path`, `limit`: as in `plan_lmms_eval`. lmms-eval's output goes to
    `out_dir/lmms_eval/lmms_eval.log` and, with `echo`, to stderr as it comes. `notes`, when given, receives the plan's notes.

    Raises UsageError when lmms-eval, or a module its adapter imports, is not installed; VlmctlError when
    lmms-eval fails (a non-zero exit status, or the error it logs before exiting 0) or writes no results, with
    its last error lines in the message.
    """
    check_installed()
    device, dtype = machine_device_dtype(device, dtype)
    target = Path(out_dir).resolve() / "lmms_eval"
    plan = plan_lmms_eval(Path(model_dir), tasks, target, batch_size, device=device, dtype=dtype,
                          include_path=include_path, limit=limit)
    check_adapter(plan.adapter)
    if notes is not None:
        notes.extend(plan.notes)
    target.mkdir(parents=True, exist_ok=True)
    before = set(result_files(target))  # an earlier run's results in the same folder are not this run's scores
    log = target / LOG_FILE
    code, output = _run_streaming(plan.command, log, sys.stderr if echo else None)
    new = [f for f in result_files(target) if f not in before]
    if code != 0 or _SWALLOWED in output:
        status = f"exit code {code}" if code != 0 else "it logged the error and exited with code 0"
        lines = "\n".join(error_lines(output))
        raise VlmctlError(f"lmms-eval failed ({status}):\n{lines}", hint=failure_hint(output, log))
    scores = collect_scores(target, new)
    if not scores:
        lines = "\n".join(error_lines(output))
        raise VlmctlError(f"lmms-eval wrote no scores under {target}; its last lines:\n{lines}",
                          hint=failure_hint(output, log))
    return scores


def _run_streaming(command: list[str], log: Path, stream: TextIO | None) -> tuple[int, str]:
    """Run `command` with stdout and stderr merged, copying each line to `stream` and `log` as it comes; return
    (exit status, whole output). The child is ended when this process is interrupted."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # lines as they happen, not at exit
    chunks: list[str] = []
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                encoding="utf-8", errors="replace", env=env)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                chunks.append(line)
                fh.write(line)
                if stream is not None:
                    stream.write(line)
                    stream.flush()
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return code, "".join(chunks)
