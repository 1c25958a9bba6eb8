"""The memory planner behind `rldock plan`: per-device bytes of a job's training and generation
phases from its config, its worker states (rldock.runtime.flow.states) and the model's shape:
arithmetic, no model loaded (docs/scaling.md)."""

from rldock.runtime.planning.memory import MemoryPlan, PhaseBytes, plan_memory
from rldock.runtime.planning.shapes import PRESETS, ModelShape, load_shape
from rldock.runtime.planning.verdict import Verdict, check_fit

__all__ = ["PRESETS", "MemoryPlan", "ModelShape", "PhaseBytes", "Verdict", "check_fit", "load_shape", "plan_memory"]
