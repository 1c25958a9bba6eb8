"""The rldock job API: typed config models, cross-field checks and YAML loading."""

from rldock.config.algorithm import AlgorithmSpec
from rldock.config.data import DataSpec, GeneratorSpec
from rldock.config.job import (
    CheckpointSpec,
    DockSpec,
    JobConfig,
    ModelSpec,
    ResourcesSpec,
    WarmupSpec,
)
from rldock.config.loading import ConfigError, load_job_config, parse_job_config, resolve_job_config
from rldock.config.problems import Problem, find_local_problems, find_problems, find_warnings
from rldock.config.reward import RewardSpec, RewardTermSpec
from rldock.config.rollout import RolloutSpec
from rldock.config.training import TrainingSpec

__all__ = [
    "AlgorithmSpec",
    "CheckpointSpec",
    "ConfigError",
    "DataSpec",
    "DockSpec",
    "GeneratorSpec",
    "JobConfig",
    "ModelSpec",
    "Problem",
    "ResourcesSpec",
    "RewardSpec",
    "RewardTermSpec",
    "RolloutSpec",
    "TrainingSpec",
    "WarmupSpec",
    "find_local_problems",
    "find_problems",
    "find_warnings",
    "load_job_config",
    "parse_job_config",
    "resolve_job_config",
]
