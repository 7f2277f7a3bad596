"""A stand-in `lmms_eval` package for testing vlmctl's lmms-eval bridge where lmms-eval is not installed.

It has what the bridge reads (adapter sources under `lmms_eval/models/{chat,simple}/`) and what it runs
(`python -m lmms_eval`), and behaves as lmms-eval 0.7.3's CLI does (lmms_eval/__main__.py, `cli_evaluate`):

- an exception during evaluation is printed as a traceback on stderr, logged on stdout as loguru's
  "ERROR | ... - Error during evaluation: ..." line (with colour codes), and the process exits 0;
- a run that ends writes `OUTPUT_PATH/<model>/<time>_results.json` with {"results": {task: {"metric,filter": value}}}.

`LMMS_STUB` picks the outcome: `ok` (default; fails as transformers 5 does when `device_map` is missing or empty,
the failure the bridge exists to avoid), `swallow` (an error, exit 0), `crash` (an uncaught error, exit 1).
`LMMS_STUB_ARGV`, when set, is a file the stub writes its command line to (JSON list).
"""

from __future__ import annotations

import json
from pathlib import Path

MAIN = r'''
import json, os, sys, time, traceback
from pathlib import Path

ERROR = ("\x1b[32m2026-01-01 00:00:00\x1b[0m | \x1b[31m\x1b[1mERROR   \x1b[0m | \x1b[36mlmms_eval.__main__\x1b[0m:"
         "\x1b[36mcli_evaluate\x1b[0m:\x1b[36m614\x1b[0m - \x1b[31m\x1b[1mError during evaluation: {}. "
         "Please set `--verbosity=DEBUG` to get more information.\x1b[0m")

argv = sys.argv[1:]
opts = {argv[i]: argv[i + 1] for i in range(0, len(argv) - 1, 2) if argv[i].startswith("--")}
if os.environ.get("LMMS_STUB_ARGV"):
    Path(os.environ["LMMS_STUB_ARGV"]).write_text(json.dumps(argv))
model_args = dict(kv.split("=", 1) for kv in opts.get("--model_args", "").split(",") if kv)
mode = os.environ.get("LMMS_STUB", "ok")
print("\x1b[32m2026-01-01 00:00:00\x1b[0m | \x1b[1mINFO    \x1b[0m | lmms_eval.__main__:cli_evaluate:516 - Verbosity set to INFO", flush=True)


def evaluate():
    if mode == "swallow":
        raise AssertionError("Do not support batch_size_per_gpu > 1 for now")
    if not model_args.get("device_map"):
        raise ValueError("When passing device_map as a string, the value needs to be a device name (e.g. cpu, cuda:0) "
                         "or 'auto', 'balanced', 'balanced_low_0', 'sequential' but found .")
    folder = Path(opts["--output_path"]) / "stub__model"
    folder.mkdir(parents=True, exist_ok=True)
    results = {task: {"alias": task, "exact_match,none": 0.5, "exact_match_stderr,none": 0.25, "anls,none": 0.75,
                      "submission,none": "n/a"} for task in opts["--tasks"].split(",")}
    (folder / f"{time.time_ns()}_results.json").write_text(json.dumps({"results": results}))
    print("|Tasks|Metric|Value|", flush=True)


if mode == "crash":
    sys.stderr.write("Model Responding:   0%|          | 0/3 [00:00<?, ?it/s]")
    raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")
try:
    evaluate()
except Exception as e:
    sys.stderr.write("Model Responding:   0%|          | 0/3 [00:00<?, ?it/s]")
    traceback.print_exc()
    sys.stderr.flush()
    print(ERROR.format(e), flush=True)
sys.exit(0)
'''

ADAPTER = '''
{imports}
from lmms_eval.api.registry import register_model


@register_model("{name}")
class Adapter:
    def __init__(self, {params}, **kwargs) -> None:
        assert kwargs == {{}}, f"Unexpected kwargs: {{kwargs}}"
'''

CHAT = '''
from lmms_eval.api.registry import register_model
from lmms_eval.models.simple.{name} import Adapter as Simple


@register_model("{name}_chat")
class Chat(Simple):
    is_simple = False
'''


def write_stub(root: Path, *, adapter: str = "llava_hf", params: tuple[str, ...] = ("pretrained", "device", "dtype", "device_map"),
               imports: tuple[str, ...] = ("import json",), chat: bool = True) -> Path:
    """Write the stub package into `root` (which then holds `lmms_eval/`) with one adapter: a simple class taking
    `params` after its `imports`, and (with `chat`) a chat class without `__init__` that inherits it, as
    lmms-eval's `llava_hf` does. Returns `root`."""
    pkg = Path(root) / "lmms_eval"
    for sub in ("api", "models/simple", "models/chat"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(MAIN)
    (pkg / "api" / "__init__.py").write_text("")
    (pkg / "api" / "registry.py").write_text("def register_model(*names):\n    return lambda cls: cls\n")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "simple" / f"{adapter}.py").write_text(
        ADAPTER.format(imports="\n".join(imports), name=adapter, params=", ".join(f"{p}=None" for p in params)))
    if chat:
        (pkg / "models" / "chat" / f"{adapter}.py").write_text(CHAT.format(name=adapter))
    return Path(root)


def use_stub(monkeypatch, root: Path) -> None:
    """Make the stub the `lmms_eval` found here (sys.path) and by child processes (PYTHONPATH)."""
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))


def fake_model_dir(path: Path, model_type: str = "llava") -> Path:
    """A folder that passes vlmctl's model-folder checks (config.json, processor, tokenizer) without weights: the
    stub never loads it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (path / "processor_config.json").write_text("{}")
    (path / "tokenizer.json").write_text("{}")
    return path
