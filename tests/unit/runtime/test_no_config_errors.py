"""The runtime trusts a validated config (issue 65): no `raise ValueError(...)` under
runtime/src/rldock/runtime names a config field (`section.field` of JobConfig) unless `REMAINING`
says why the runtime must check it itself.

`rldock validate` and `rldock train` run the config's checks (rldock.config: pydantic's bounds and
each section's `problems`) before any runtime code, and the operator before it starts a job, so a
user error in the config is reported once, there, with every other problem. What the config alone
guarantees the runtime states as an `assert` (an invariant); what it cannot know (the model's
shapes and experts, the devices Ray hands out, the data rows, the tokenizer, a checkpoint) the
runtime still refuses with a ValueError naming the field, listed in REMAINING with that reason.

REMAINING is keyed by file and enclosing function (not line), so edits elsewhere leave it alone; an
entry that no longer matches a site fails the test, so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rldock.config import JobConfig
from rldock.runtime import registry

RUNTIME = Path(registry.__file__).parent

# "path/from/runtime.py:enclosing.function" -> why the runtime checks it, not the config.
REMAINING = {
    "agent/examples/cabinet.py:task_of": "needs the data rows (a row's extra_info)",
    "data/dataset.py:PromptDataset.preference_pairs": "needs the data rows (a generated file may lack a pair)",
    "data/files.py:_row": "needs the data rows (the extra_info column's type)",
    "data/rendering.py:render_prompt": "needs the tokenizer's chat template and the prompt it renders",
    "data/sampler.py:PromptSampler.load_state_dict": "needs the checkpoint's saved sampler state",
    "data/word_problems.py:generate_word_problems": "needs the generated rows (distinct held-out questions)",
    "driver/evaluation.py:Evaluator.__init__": "needs the held-out rows (all may be dropped or absent)",
    "driver/warmup.py:_Demonstrations.targets": "needs the demonstrations' tokens (their length)",
    "engines/expert_parallel.py:check_experts_divide": "needs the model's experts (a built model has no config yet)",
    "engines/expert_parallel.py:apply_expert_parallel": "needs the model's experts",
    "engines/expert_parallel.py:ExpertParallelExperts.__init__": "needs the model's experts' layout",
    "engines/fsdp_sharding.py:check_mixed_precision": "needs the device (bf16 support)",
    "engines/replica_devices.py:engine_environments": "needs the device ids and nodes Ray assigned",
    "models/__init__.py:ensure_model": "needs the model folder (config.json on the worker's filesystem)",
    "models/loading.py:encode_prompts": "needs the tokenizer (a prompt's length in tokens)",
    "models/lora.py:add_lora": "needs the model's Linear modules",
    "models/pipeline_stage.py:stage_layers": "needs the model's layer count (a built model has no config yet)",
    "models/pipeline_stage.py:cut_stage": "needs the model's class and its layer_types",
    "models/routing_replay.py:_hooked": "needs the model's routers",
    "models/routing_replay.py:recording_routes": "needs the model's config (an MoE shape)",
    "planning/shapes.py:load_shape": "needs the model folder (config.json), read by `rldock plan` unvalidated",
}


def config_field_paths() -> set[str]:
    """Every `section.field` of JobConfig: its sections' own fields (a section that may be None too)."""
    paths = set()
    for section, field in JobConfig.model_fields.items():
        for kind in getattr(field.annotation, "__args__", (field.annotation,)):
            paths |= {f"{section}.{name}" for name in getattr(kind, "model_fields", {})}
    return paths


def _enclosing_names(tree: ast.Module) -> dict[ast.AST, str]:
    """Each node -> the dotted name of the classes and functions around it ("Class.method")."""
    names: dict[ast.AST, str] = {}

    def visit(node: ast.AST, name: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = name
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{name}.{child.name}" if name else child.name
            names[child] = inner
            visit(child, inner)

    visit(tree, "")
    return names


def config_error_sites(root: Path) -> dict[str, list[str]]:
    """ "file:function" -> "line: fields" of each `raise ValueError(...)` under `root` whose text names a field."""
    paths = config_field_paths()
    sections = sorted({path.split(".")[0] for path in paths})
    named = re.compile(r"\b(?:" + "|".join(sections) + r")\.[a-z_]+")
    sites: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        enclosing = _enclosing_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            if not (isinstance(node.exc.func, ast.Name) and node.exc.func.id == "ValueError"):
                continue
            text = " ".join(
                c.value for c in ast.walk(node.exc) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
            fields = sorted({m.group(0) for m in named.finditer(text)} & paths)
            if fields:
                key = f"{path.relative_to(root).as_posix()}:{enclosing[node] or '<module>'}"
                sites.setdefault(key, []).append(f"line {node.lineno}: {', '.join(fields)}")
    return sites


def test_the_runtime_raises_no_config_error_the_config_checks_make():
    sites = config_error_sites(RUNTIME)
    unlisted = {key: lines for key, lines in sites.items() if key not in REMAINING}
    assert not unlisted, (
        "the runtime raises ValueError naming a config field: make it an assert where the config's checks "
        "(api/src/rldock/config) guarantee it, add the check there where the config alone can tell, or list "
        f"the site in REMAINING with what runtime fact it needs: {unlisted}"
    )


def test_every_remaining_entry_still_names_a_site():
    stale = sorted(set(REMAINING) - set(config_error_sites(RUNTIME)))
    assert not stale, f"REMAINING lists sites that no longer raise a config error; remove them: {stale}"


def test_the_scan_finds_a_field_named_in_an_f_string(tmp_path):
    (tmp_path / "m.py").write_text(
        "class C:\n"
        "    def f(self, n):\n"
        "        if n:\n"
        "            raise ValueError(f'dock.max_staleness must be >= 0, got {n}')\n"
        "        raise ValueError('dock.nothing_here is no field')\n"
    )
    assert config_error_sites(tmp_path) == {"m.py:C.f": ["line 4: dock.max_staleness"]}
