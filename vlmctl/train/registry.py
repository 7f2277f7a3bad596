"""The objective registry: `train.objective` -> `ObjectiveSpec`, one entry per objective module.

    from vlmctl.train.registry import get_objective
    spec = get_objective(train.objective)
    objective = spec.build(tm, train, ctx, cfg, run_dir)       # the run's Objective
    collator = spec.collate(processor, family, packed=True, tokens_per_batch=4096)

Each objective module (`objectives` for SFT, `dpo`, `grpo`, `orpo`) defines its objective class and its `SPEC`;
`BUILT_IN` below lists them once. Every other module asks the spec what it needs (data kind, collator, frozen
models, bench workload, hooks, step line, plotted curves, run name) instead of comparing `train.objective` with a
name; a test greps the source tree for such comparisons. Adding an objective = its module, its line here, its
config section (`vlmctl.config.objective`), its tests and docs (docs/architecture.md, "Adding an objective").
"""

from __future__ import annotations

from vlmctl.errors import ConfigError
from vlmctl.train import dpo, grpo, objectives, orpo
from vlmctl.train.objectives import HOOKS, ObjectiveSpec

BUILT_IN = (objectives, dpo, grpo, orpo)
"""The built-in objective modules, in the order of `OBJECTIVES`: each holds one `SPEC`."""

OBJECTIVES: dict[str, ObjectiveSpec] = {}
"""Registered objectives by name, in registration order."""


def register(entry: ObjectiveSpec) -> ObjectiveSpec:
    """Add `entry` (an objective's spec) to the registry and return it. Raises ConfigError when its name is taken,
    when it declares a hook (`objectives.HOOKS`) its class does not implement, when its class has a hook's method
    it does not declare (nothing would call it), or when the class's `spec` is not `entry`."""
    if entry.name in OBJECTIVES:
        raise ConfigError(f"objective {entry.name!r} is registered twice", hint="give the new objective another name")
    unknown = set(entry.hooks) - set(HOOKS)
    if unknown:
        raise ConfigError(f"objective {entry.name}: unknown hooks {sorted(unknown)}", hint=f"hooks are {', '.join(HOOKS)}")
    for hook, methods in HOOKS.items():
        present = [m for m in methods if callable(getattr(entry.objective, m, None))]
        if hook in entry.hooks and len(present) != len(methods):
            raise ConfigError(f"objective {entry.name} declares the hook {hook} but {entry.objective.__name__} lacks "
                              f"{', '.join(sorted(set(methods) - set(present)))}", hint="implement it, or do not declare it")
        if hook not in entry.hooks and present:
            raise ConfigError(f"{entry.objective.__name__} has {', '.join(present)} but objective {entry.name} does not "
                              f"declare the hook {hook}", hint=f"add {hook!r} to its spec's hooks")
    if getattr(entry.objective, "spec", None) is not entry:
        raise ConfigError(f"{entry.objective.__name__}.spec is not the spec of objective {entry.name}",
                          hint="set the class's spec where the spec is made: SPEC = Cls.spec = ObjectiveSpec(...)")
    OBJECTIVES[entry.name] = entry
    return entry


def get_objective(name: str) -> ObjectiveSpec:
    """The spec of objective `name` (a `train.objective` value). Raises ConfigError listing the known ones."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ConfigError(f"unknown train.objective {name!r}", hint=f"use one of: {', '.join(OBJECTIVES)}") from None


for _module in BUILT_IN:
    register(_module.SPEC)

__all__ = ["BUILT_IN", "OBJECTIVES", "get_objective", "register"]
