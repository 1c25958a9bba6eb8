"""tensordict imported without torch's compiler stack (rldock.runtime.tensordict_import), each case in a
fresh interpreter: what a process has loaded decides what the import does."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def _run(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_REPORT = """
    import json, sys
    import torch.compiler
    import tensordict.base, tensordict.utils
    from tensordict import TensorDict
    from rldock.runtime import tensordict_import

    batch = TensorDict({"x": torch.arange(6.0).reshape(3, 2)}, batch_size=[3])
    print(json.dumps({
        "compiler_loaded": "torch._dynamo" in sys.modules,
        "marks_skipped": tensordict.base.allow_in_graph is tensordict_import._unchanged,
        "torch_restored": torch.compiler.allow_in_graph is not tensordict_import._unchanged
            and torch.compiler.assume_constant_result is not tensordict_import._unchanged,
        "finder_left": any(type(f).__name__ == "_Finder" for f in sys.meta_path),
        "works": torch.stack([batch[0:2], batch[1:3]])["x"].sum().item(),
    }))
"""


def test_the_runtime_imports_tensordict_without_the_compiler_and_leaves_torch_as_it_was():
    report = _run("import torch, rldock.runtime\n" + textwrap.dedent(_REPORT))
    assert report == {
        "compiler_loaded": False,
        "marks_skipped": True,
        "torch_restored": True,
        "finder_left": False,
        "works": 20.0,  # rows 0-1 (0+1+2+3) and rows 1-2 (2+3+4+5)
    }


def test_a_process_that_loaded_the_compiler_first_gets_tensordict_unchanged():
    report = _run("import torch, torch._dynamo, rldock.runtime\n" + textwrap.dedent(_REPORT))
    assert report["compiler_loaded"] and not report["marks_skipped"] and report["torch_restored"]
