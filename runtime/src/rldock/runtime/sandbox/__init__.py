"""The `python` tool's sandbox, a program the model wrote run in a confined child process: the runner
outside the child (runner.py: limits, the wall clock, the disk watchdog, the outcome, which layers held),
the child's boot (boot.py, loaded by path: it cannot import rldock), the kernel layers (kernel.py) and the
audit hook (hook.py)."""
