"""Trace what compiles while `vlmctl bench` measures: with VLMCTL_TRACE=FILE and this folder first on PYTHONPATH,
every Python process started appends one tab-separated line per event to FILE: wall time (s), pid, event, name,
seconds. Events: Triton's JIT compiles of plain `@triton.jit` kernels (`triton.jit_do_compile`: liger-kernel's,
say), inductor's precompiles and autotuning of its own kernels (`inductor.*`, in its compile workers too), and the
bench's step boundaries (`bench.mark`: one at each warm-up step's start, two per measured step). Calls under 2 ms
(cache hits) are left out. `report.py` lines the events up with the measured steps.

    VLMCTL_TRACE=/tmp/trace.tsv PYTHONPATH=benchmarks/compile_trace:$PYTHONPATH OUT=/tmp/b \
        TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc STEPS=8 bash benchmarks/bench_fp8_gpu.sh 7b-bf16
    python benchmarks/compile_trace/report.py /tmp/trace.tsv /tmp/b/fp8_gpu.jsonl

The hooks wrap private functions of Triton (`JITFunction._do_compile`) and inductor (`CachingAutotuner`'s
`precompile`, `benchmark_all_configs`, ...) where they exist (Triton 3.x, torch 2.11); a failed hook is logged as
`trace.error` and never breaks the import it rides on.
"""

import os

_PATH = os.environ.get("VLMCTL_TRACE")

if _PATH:
    import functools
    import importlib
    import importlib.util
    import sys
    import time

    def _log(event: str, name: str, seconds: float = 0.0) -> None:
        with open(_PATH, "a") as f:
            f.write(f"{time.time():.3f}\t{os.getpid()}\t{event}\t{name}\t{seconds:.4f}\n")

    def _wrap(owner, attr: str, event: str, namer) -> None:
        fn = getattr(owner, attr, None)
        if fn is None or getattr(fn, "_traced", False):
            return

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - t0
                if seconds > 0.002:
                    try:
                        name = namer(args)
                    except Exception:  # noqa: BLE001 - a name is a nicety
                        name = "?"
                    _log(event, name, seconds)

        traced._traced = True
        setattr(owner, attr, traced)

    def _inductor(module) -> None:
        for attr in ("precompile", "_precompile_config", "benchmark_all_configs", "autotune_to_one_config",
                     "coordinate_descent_tuning"):
            _wrap(module.CachingAutotuner, attr, "inductor." + attr, lambda args: args[0].fn.__name__)

    def _triton_jit(module) -> None:
        _wrap(module.JITFunction, "_do_compile", "triton.jit_do_compile", lambda args: args[0].fn.__name__)

    def _bench(module) -> None:
        counted = module._compiled_graphs  # called at every step's start and every measured step's end

        def marked():
            _log("bench.mark", "step")
            return counted()

        module._compiled_graphs = marked

    _HOOKS = {"torch._inductor.runtime.triton_heuristics": _inductor, "triton.runtime.jit": _triton_jit,
              "vlmctl.bench": _bench}

    class _Loaded:
        """A loader that hands back a module already imported (and hooked)."""

        def __init__(self, module):
            self.module = module

        def create_module(self, spec):  # noqa: ARG002
            return self.module

        def exec_module(self, module):  # noqa: ARG002
            pass

    class _Finder:
        """Import each hooked module the normal way, hook it, and give the import system that module."""

        def find_spec(self, name, path, target=None):  # noqa: ARG002
            if name not in _HOOKS:
                return None
            sys.meta_path.remove(self)
            try:
                module = importlib.import_module(name)
                try:
                    _HOOKS[name](module)
                except Exception as exc:  # noqa: BLE001 - tracing must never break an import
                    _log("trace.error", f"{name}: {exc!r}")
            finally:
                sys.meta_path.insert(0, self)
            sys.modules.pop(name, None)  # else the import system would run the module's own loader again
            return importlib.util.spec_from_loader(name, _Loaded(module))

    sys.meta_path.insert(0, _Finder())
