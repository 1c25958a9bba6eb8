"""Each process of a job imports what it uses (issue 60): a structural check, not a timing.

Every process kind's modules are imported in a fresh interpreter, as Ray imports them to unpickle
the actor's class (the driver: as `rldock train` does), and the heavy packages it must not have
loaded are looked up in sys.modules. Measured in a fresh interpreter on the 2-core machine: vLLM
~11 s of CPU, transformers' model classes ~3 s, peft ~2 s beyond them, FastAPI ~0.5 s,
torch's compiler stack ~1.5 s, math-verify with SymPy's LaTeX parser ~1 s (rldock.runtime.startup's
figures show what a job pays).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# What the demo's kind of job (GRPO, rule reward, no LoRA, plain rollout) does not use in a process.
VLLM = "vllm"
PEFT = "peft"
MODEL_CODE = "transformers.modeling_utils"  # any model class (AutoModelForCausalLM, Qwen2ForCausalLM, ...)
GATEWAY = "fastapi"  # the agent gateway's server: harness jobs only
TENSORDICT = "tensordict"
MATH = "math_verify"  # with SymPy's LaTeX parser: the math_verify reward term only
# torch's compiler stack: tensordict's import reached it (~1.5 s), rldock.runtime.tensordict_import
# keeps it out; transformers' model code (its generation module) and vLLM load it where they are used
COMPILER = "torch._dynamo"
TORCH = "torch"  # ~1.8 s: the dock's actors move numpy arrays and name the torch dtype (dock/wire.py)
HEAVY = (VLLM, PEFT, MODEL_CODE, GATEWAY, TENSORDICT, MATH, COMPILER, TORCH)

# kind -> (modules Ray or `rldock train` imports for it, heavy modules it must not have loaded)
PROCESS_KINDS = {
    # `rldock train`'s own process: the warm-up, where a job has one, imports model code when it runs.
    "driver": (
        ["rldock.runtime.cli", "rldock.runtime.driver.trainer"],
        {VLLM, PEFT, MODEL_CODE, GATEWAY, MATH, COMPILER},
    ),
    # actor and reference seats: vLLM is imported when an engine is built (engine ranks only), peft
    # under training.lora, FastAPI by the harness rollout.
    "device worker": (
        [
            "rldock.runtime.workers.device_worker",
            "rldock.runtime.workers.actor",
            "rldock.runtime.workers.reference",
        ],
        {VLLM, PEFT, GATEWAY, MATH},
    ),
    # a rule reward decodes with the tokenizer and loads no model
    "reward worker": (["rldock.runtime.workers.reward"], {VLLM, PEFT, MODEL_CODE, GATEWAY, MATH, COMPILER}),
    # the dock's actors hold columns and metadata
    "dock actors": (
        ["rldock.runtime.dock.host", "rldock.runtime.dock.warehouse"],
        {VLLM, PEFT, MODEL_CODE, GATEWAY, TENSORDICT, MATH, COMPILER, TORCH},
    ),
}

_LOADED = textwrap.dedent("""
    import importlib, json, sys
    for name in json.loads(sys.argv[1]):
        importlib.import_module(name)
    print(json.dumps(sorted(name for name in json.loads(sys.argv[2]) if name in sys.modules)))
""")


def loaded_heavy_modules(modules: list[str]) -> set[str]:
    """The HEAVY modules in sys.modules of a fresh interpreter after importing `modules`."""
    done = subprocess.run(
        [sys.executable, "-c", _LOADED, json.dumps(modules), json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("kind", sorted(PROCESS_KINDS))
def test_a_process_imports_only_what_it_uses(kind):
    modules, forbidden = PROCESS_KINDS[kind]
    loaded = loaded_heavy_modules(modules) & forbidden
    assert not loaded, (
        f"the {kind} process ({', '.join(modules)}) imports {sorted(loaded)} at start: import it where it is used "
        "(python -X importtime -c 'import <module>' shows which import brings it)"
    )


def test_the_check_sees_a_heavy_import():
    """The check can fail: the gateway, which serves the harness's requests, imports FastAPI, as it must."""
    assert GATEWAY in loaded_heavy_modules(["rldock.runtime.gateway.dispatch"])
