"""The run plan (`vlmctl.config.plan`): every `auto` of the train section decided in one module, with a reason,
for a device described by hand (a GPU machine planned on a CPU one), and nowhere else in the source tree."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from vlmctl.config import TrainSection
from vlmctl.config.plan import PROBE, DeviceFacts, RunPlan, build_plan, check_plan, plan_text, read_plan, write_plan
from vlmctl.errors import ConfigError

GIB = 2**30
H100 = DeviceFacts(kind="cuda", memory_bytes=80 * GIB, torchao=True, triton=True, varlen=True)
SOURCE = Path(__file__).resolve().parents[2] / "vlmctl"

# `train` keys whose `auto` is a run decision: a comparison of one of them with the word decides it
DECISION_KEYS = ("strategy", "precision", "master_weights", "stochastic_rounding", "compile", "compile_vision",
                 "attn_implementation", "liger", "balance", "tokens_per_batch", "micro_batch_size",
                 "activation_checkpointing", "nproc_per_node", "fp8", "fsdp_reshard_after_forward", "fsdp_prefetch")
# modules that take training decisions: any comparison with "auto" there decides something
TRAINING_MODULES = ("train/", "distributed/", "bench.py", "models/summary.py", "config/train.py", "cli/train.py",
                    "cli/bench.py", "cli/model.py")
# what the plan reads of the train section: set after planning, the run and its plan.json would disagree
PLAN_INPUTS = (*DECISION_KEYS, "packing", "sequence_parallel", "lora", "fsdp_sharding", "nnodes", "launcher")
TRAIN_NAMES = ("train", "train_cfg", "cfg.train", "self.train")  # how modules name a train section


def mutations(source: str) -> list[int]:
    """Lines of `source` that assign a plan input of a train section (`train.packing = False`, `setattr(train,
    "packing", ...)`)."""
    import ast

    lines = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr in PLAN_INPUTS and ast.unparse(target.value) in TRAIN_NAMES:
                lines.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and len(node.args) >= 2
                and ast.unparse(node.args[0]) in TRAIN_NAMES and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in PLAN_INPUTS):
            lines.append(node.lineno)
    return sorted(set(lines))


# reading the machine to size a run: the plan's `visible_gpus` and `DeviceFacts.here` do it
COUNTS_DEVICES = re.compile(r"torch\.cuda\.device_count\(\)")
# the packed row's budget computed again: `config.plan.row_tokens` is the one place
ROW_BUDGET = re.compile(r"tokens_per_batch\)?\s*\*\s*\w|(?:tokens|budget)\w*\)?\s*\*\s*(?:\w+\.)*(?:sequence_parallel|sp)\b")
# a comparison with the word: == / != on either side, or membership in a literal tuple, list or set holding it
COMPARES_AUTO = re.compile(r"""(==|!=)\s*["']auto["']|["']auto["']\s*(==|!=)|\bin\s*[(\[{][^)\]}]*["']auto["']""")
KEY = re.compile(r"\b(" + "|".join(DECISION_KEYS) + r")\b")
ALLOWED = {  # (module, text of the line): why it is not a run decision
    ("config/train.py", 'self.activation_checkpointing == "auto"'): "the older gradient_checkpointing key, validated",
    ("train/setup.py", 'lora.target_modules == "auto"'): "LoRA's module pattern, from the model's layer names",
    ("train/launch.py", 'train.resume not in (None, "auto")'): "resume: auto names the run folder to continue",
    ("train/launch.py", 'train.resume in (None, "auto")'): "resume: auto names the run folder to continue",
    ("train/checkpoint.py", 'resume == "auto"'): "resume: auto names the checkpoint to continue from",
    ("bench.py", 'kind == "auto"'): "bench's --workload flag, not a train setting",
    ("distributed/deepspeed.py", '"auto") == "auto"'): "DeepSpeed's own JSON word: the generated config fills it",
    ("inference/runner.py", 'kernels not in ("auto"'): "the decoding engine's kernels argument, not a train setting",
    ("inference/runner.py", 'kernels in ("auto", "liger")'): "the decoding engine's kernels argument, not a train setting",
    ("distributed/deepspeed.py", 'zero.get(key) == "auto"'): "DeepSpeed's own JSON word: the generated config fills it",
}
COUNT_ALLOWED = {"inference/load.py": "checks that an asked-for CUDA device exists (--device cuda:N), decides nothing"}


def auto_decisions() -> list[str]:
    """`module:line: text` of each comparison with "auto" outside config/plan.py that decides a run setting: in a
    training module, or on a line naming a decision key; comments and docstrings' prose do not count (a line
    must compare), validation and other words (`ALLOWED`) do not either."""
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        module = path.relative_to(SOURCE).as_posix()
        if module == "config/plan.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if not COMPARES_AUTO.search(code):
                continue
            if not (module.startswith(TRAINING_MODULES) or KEY.search(code)):
                continue
            if any(module == m and text in code for m, text in ALLOWED):
                continue
            found.append(f"{module}:{number}: {line.strip()}")
    return found


def plan_bypasses() -> list[str]:
    """`module:line: text` of each line outside config/plan.py that changes a setting the plan reads after it was
    planned (`mutations`: the run would train with what plan.json does not say), counts the machine's GPUs itself
    (`COUNTS_DEVICES`: a second `nproc_per_node` rule) or multiplies out a packed row's budget (`ROW_BUDGET`: a
    second `row_tokens`)."""
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        module = path.relative_to(SOURCE).as_posix()
        if module == "config/plan.py":
            continue
        source = path.read_text()
        changed = set(mutations(source))
        for number, line in enumerate(source.splitlines(), 1):
            code = line.split("#", 1)[0]
            if (number in changed or (COUNTS_DEVICES.search(code) and module not in COUNT_ALLOWED)
                    or ROW_BUDGET.search(code)):
                found.append(f"{module}:{number}: {line.strip()}")
    return found


def test_no_module_but_the_plan_resolves_auto():
    found = auto_decisions()
    assert not found, "decide these in vlmctl/config/plan.py and read the plan instead:\n" + "\n".join(found)


def test_no_module_changes_what_the_plan_read_or_counts_gpus_itself():
    found = plan_bypasses()
    assert not found, "decide these in vlmctl/config/plan.py and read the plan instead:\n" + "\n".join(found)


def test_the_guards_catch_fsdp_nproc_and_mutations_decided_outside_the_plan(tmp_path, monkeypatch):
    fake = tmp_path / "vlmctl"
    for folder in ("distributed", "train", "cli", "config"):
        (fake / folder).mkdir(parents=True)
    # the leftovers this plan replaced: FSDP2's rules at wrap time, GPUs counted for nproc, packing set at set-up
    (fake / "distributed" / "fsdp.py").write_text('def resolve_prefetch(setting):\n    if setting == "auto":\n        return 1\n')
    (fake / "cli" / "model.py").write_text('n = 1 if t.nproc_per_node != "auto" else 2\ngpus = torch.cuda.device_count()\n')
    (fake / "train" / "setup.py").write_text('if not family.supports_packing:\n    train.packing = False\n'
                                             'setattr(train, "tokens_per_batch", 2)\ntrain.run_name = "x"\n'
                                             'budget = train.tokens_per_batch * ctx.dims.sp\n')
    (fake / "config" / "plan.py").write_text('train.packing = False\nx = torch.cuda.device_count()\n')
    monkeypatch.setattr(__import__(__name__), "SOURCE", fake)
    assert [f.split(": ", 1)[0] for f in auto_decisions()] == ["cli/model.py:1", "distributed/fsdp.py:2"]
    assert [f.split(": ", 1)[0] for f in plan_bypasses()] == ["cli/model.py:2", "train/setup.py:2", "train/setup.py:3",
                                                             "train/setup.py:5"]


def test_the_grep_sees_a_resolution_and_ignores_other_words(tmp_path, monkeypatch):
    # the rule must catch what it is for, or it passes whatever the tree holds
    fake = tmp_path / "vlmctl"
    (fake / "train").mkdir(parents=True)
    (fake / "config").mkdir()
    (fake / "train" / "x.py").write_text('if train.compile == "auto":\n    pass\nx = y if ac not in ("off", "auto") else 1\n')
    (fake / "serve.py").write_text('if device == "auto":\n    pass\nif cfg.strategy != "auto":\n    pass\n')
    (fake / "config" / "plan.py").write_text('if strategy != "auto":\n    pass\n')
    monkeypatch.setattr(__import__(__name__), "SOURCE", fake)
    assert [f.split(": ", 1)[0] for f in auto_decisions()] == ["serve.py:3", "train/x.py:1", "train/x.py:3"]


def test_qlora_is_planned_for_a_gpu_on_any_machine():
    train = TrainSection(lora={"r": 8, "quantize": "4bit"})
    plan = build_plan(train, H100)
    # QLoRA replicates its 4-bit base (ddp) and is not compiled; the stored dtype is the compute dtype
    assert (plan.strategy.value, plan.compile.value, plan.master_weights.value, plan.stored.value) == (
        "ddp", "off", "fp32", "bf16")
    assert "QLoRA" in plan.strategy.reason and plan.strategy.auto
    check_plan(plan, train)  # a GPU takes it
    with pytest.raises(ConfigError, match="QLoRA"):
        check_plan(build_plan(train, DeviceFacts(kind="cpu")), train)
    # LoRA without quantization on two GPUs shards (fsdp): the QLoRA flag is what makes the difference
    assert build_plan(TrainSection(lora={"r": 8}), DeviceFacts(kind="cuda", processes=2)).strategy.value == "fsdp"
    assert build_plan(train, DeviceFacts(kind="cuda", processes=2)).strategy.value == "ddp"


def test_every_decision_has_a_value_and_a_reason_and_the_config_is_untouched():
    train = TrainSection()
    before = train.model_dump()
    plan = build_plan(train, H100)
    assert train.model_dump() == before
    for key, decision in plan.decisions().items():
        assert decision.value != "auto" and decision.reason, key
    assert plan.probing == {"tokens_per_batch", "activation_checkpointing"} and plan.row_tokens is None
    assert (plan.strategy.value, plan.compile.value, plan.compile_vision.value, plan.attention.value) == (
        "ddp", "on", "blocks", "varlen")  # one GPU storing bf16 weights: ddp (nothing to shard)
    two = build_plan(TrainSection(sequence_parallel=2, tokens_per_batch=4096), DeviceFacts(kind="cuda", processes=4))
    assert (two.row_tokens, two.dp_size, two.balance.value) == (8192, 2, True)  # the row is split over 2 ranks
    assert not two.probing  # no probe with sequence parallelism: the fixed checkpointing
    assert two.activation_checkpointing.value == "full"


def test_tensor_parallel_ranks_are_not_data_parallel_and_keep_their_own_loss():
    gpus = DeviceFacts(kind="cuda", processes=8, memory_bytes=141 * GIB, torchao=True, triton=True, varlen=True,
                       liger=True, capability=(9, 0))
    tp = build_plan(TrainSection(strategy="fsdp", tensor_parallel=2, precision="bf16", compile="on"), gpus)
    assert (tp.tensor_parallel, tp.dp_size) == (2, 4)
    # liger's fused loss reads the whole LM head: it steps aside, saying why; float8 auto does not run its start-up
    # trial under tensor parallelism, while a recipe set in the config trains the split layers in float8
    assert not tp.liger.value and "tensor parallelism" in tp.liger.reason
    assert tp.fp8.value == "off" and "tensor_parallel" in tp.fp8.reason and "fp8=tensorwise" in tp.fp8.reason
    section = TrainSection(strategy="fsdp", tensor_parallel=2, precision="bf16", compile="on", fp8="tensorwise")
    check_plan(recipe := build_plan(section, gpus), section)
    assert recipe.fp8.value == "tensorwise"
    whole = build_plan(TrainSection(strategy="fsdp", precision="bf16", compile="on"), gpus)
    assert whole.liger.value and whole.dp_size == 8
    assert RunPlan.from_json(tp.to_json()).tensor_parallel == 2


def test_the_plan_round_trips_through_plan_json(tmp_path):
    plan = build_plan(TrainSection(strategy="zero3", liger="auto"), H100)
    path = write_plan(tmp_path, plan)
    assert path.name == "plan.json" and not list(tmp_path.glob(".*.tmp"))
    again = read_plan(tmp_path)
    assert again == plan and isinstance(again, RunPlan)
    assert plan_text(again) == plan_text(plan)
    assert "tokens_per_batch" in plan_text(plan) and PROBE in plan_text(plan)
    (tmp_path / "plan.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a run plan"):
        read_plan(tmp_path)


def test_a_family_without_packed_rows_is_planned_padded():
    class Family:  # the FamilySpec fields the plan reads
        name, supports_packing, liger_patch = "nopack", False, None

    plan = build_plan(TrainSection(), DeviceFacts(kind="cuda", liger=True, flash_attn=True), family=Family)
    assert (plan.packing.value, plan.attention.value, plan.liger.value) == (False, "flash_attn", False)
    assert plan.probing == {"micro_batch_size", "activation_checkpointing"}
    with pytest.raises(ConfigError, match="liger"):
        check_plan(build_plan(TrainSection(liger="on"), DeviceFacts(kind="cuda", liger=True), family=Family),
                   TrainSection(liger="on"))


def test_tokens_per_batch_auto_on_cpu_follows_what_data_prepare_measured(tmp_path):
    import json

    from vlmctl.config import load_config
    from vlmctl.config.plan import prepared_row_tokens
    from vlmctl.train.launch import launch_plan

    prepared = tmp_path / "data" / "prepared"
    prepared.mkdir(parents=True)
    assert prepared_row_tokens(prepared) is None  # no manifest: the default
    (prepared / "manifest.json").write_text(json.dumps({"tokens": {"suggested_packing_length": 1024}}))
    assert prepared_row_tokens(prepared) == 1024
    plan = build_plan(TrainSection(), DeviceFacts(kind="cpu"), data_tokens=1024)
    assert plan.tokens_per_batch.value == 1024 and "data prepare" in plan.tokens_per_batch.reason and plan.row_tokens == 1024
    assert build_plan(TrainSection(), DeviceFacts(kind="cpu"), data_tokens=32768).tokens_per_batch.value == 8192
    assert build_plan(TrainSection(tokens_per_batch=2048), DeviceFacts(kind="cpu"), data_tokens=1024).tokens_per_batch.value == 2048
    assert build_plan(TrainSection(), H100, data_tokens=1024).tokens_per_batch.value == PROBE  # a GPU measures
    (tmp_path / "vlmctl.yaml").write_text("project: {name: p}\ntrain: {launcher: none}\n")
    launched = launch_plan(load_config(tmp_path / "vlmctl.yaml"))  # the launcher reads the project's manifest
    assert (launched.tokens_per_batch.value, launched.data_tokens) == (1024, 1024)
    path = write_plan(tmp_path, launched)
    assert read_plan(tmp_path) == launched and path.is_file()


def test_processes_per_node_and_fsdp2s_overlap_are_decided_in_the_plan(tmp_path):
    from vlmctl.config.plan import RANK, settle_reshard

    four = DeviceFacts(kind="cuda", memory_bytes=80 * GIB, gpus=4, processes=4, torchao=True)
    plan = build_plan(TrainSection(strategy="fsdp"), four)
    assert (plan.nproc_per_node.value, plan.nproc_per_node.auto) == (4, True) and "4 visible GPUs" in plan.nproc_per_node.reason
    assert plan.fsdp_prefetch.value == 1 and plan.fsdp_reshard_after_forward.value == RANK  # the model's size decides
    settled = settle_reshard(plan, False, "auto: 4 shard ranks <= 8, gathered layers 0.1 GiB <= 1/4 of 80.0 GiB")
    assert settled.fsdp_reshard_after_forward.value is False and settled.fsdp_reshard_after_forward.reason.startswith("4 shard")
    one = build_plan(TrainSection(strategy="fsdp", fsdp_prefetch="off"), replace(four, gpus=1, processes=1))
    assert one.fsdp_reshard_after_forward.value is True and "1 shard rank" in one.fsdp_reshard_after_forward.reason
    assert one.fsdp_prefetch.value == 0 and one.train_section(TrainSection(fsdp_prefetch="off")).fsdp_prefetch == "off"
    with pytest.raises(ConfigError, match="the plan decided True"):
        settle_reshard(one, False, "a rank that disagrees")
    wide = build_plan(TrainSection(strategy="fsdp", nnodes=2, nproc_per_node=8), replace(four, processes=16))
    assert wide.fsdp_reshard_after_forward.value is True and "16 shard ranks > 8" in wide.fsdp_reshard_after_forward.reason
    assert build_plan(TrainSection(launcher="none"), four).nproc_per_node.value == 1
    assert "not used: ddp" in build_plan(TrainSection(strategy="ddp"), four).fsdp_prefetch.reason
    slurm = TrainSection(launcher="slurm")
    assert build_plan(slurm, four).nproc_per_node.value is None
    with pytest.raises(ConfigError, match="train.launcher=slurm needs train.nproc_per_node"):
        check_plan(build_plan(slurm, four), slurm)
    write_plan(tmp_path, plan)
    assert read_plan(tmp_path) == plan  # the new decisions round-trip through plan.json
