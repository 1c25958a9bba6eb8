"""The vLLM rollout engine on CPU, and data-parallel Ray actor ranks that each host one.

Checks the contract the trainer relies on: token-id prompts in, n responses per prompt out with
EOS kept; an in-memory weight update after which vLLM's greedy output equals HF's and its sampled
token logprobs equal `response_logprobs`; and two actor ranks that form a gloo group, average
gradients exactly like one process on the whole batch, then run two engines side by side.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rldock.config.rollout import RolloutSpec
from rldock.runtime.device import detect_device
from rldock.runtime.engines.policy import response_logprobs

pytestmark = pytest.mark.integration

EOS = 1  # conftest's tokenizer: <pad>=0, <eos>=1, <bos>=2, then characters
PROMPTS = [[4, 5, 13, 6, 14], [7, 14], [9, 9, 9, 3]]
MAX_MODEL_LEN = 64


def _engine(model_dir: Path, *, seed: int = 0):
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine

    return VllmRolloutEngine(
        model_dir,
        rollout=RolloutSpec(temperature=1.0, top_p=1.0, cpu_kv_cache_gib=0.25),
        dtype="float32",
        seed=seed,
        max_model_len=MAX_MODEL_LEN,
        device=detect_device("cpu"),
    )


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    import torch.distributed as dist

    engine = _engine(tiny_model_dir)
    yield engine
    engine.shutdown()
    # vLLM made a world of one in this process; later tests may form their own group.
    assert not dist.is_initialized()


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _padded(rows: list[list[int]], length: int, *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(rows), length, dtype=torch.long)  # (B, length), pad id 0
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        span = slice(length - len(row), length) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        mask[i, span] = 1
    return ids, mask


def _score_with_hf(model, prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
    prompt_ids, prompt_mask = _padded(prompts, max(map(len, prompts)), left=True)
    response_ids, response_mask = _padded(responses, max(map(len, responses)), left=False)
    with torch.no_grad():
        return response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, micro_batch_size=2)


def test_generate_returns_n_responses_per_prompt(engine):
    out = engine.generate(PROMPTS, n=4, max_tokens=8, eos_token_id=EOS, seed=7)
    assert len(out) == len(PROMPTS)
    for group in out:
        assert len(group) == 4
        for response in group:
            assert 1 <= len(response) <= 8
            assert all(isinstance(t, int) and 0 <= t < 42 for t in response)
            # EOS, if sampled, ends the response and is kept.
            assert EOS not in response[:-1]
    # Responses of one prompt differ (sampled), and a seed reproduces them.
    assert len({tuple(r) for r in out[0]}) > 1
    assert engine.generate(PROMPTS, n=4, max_tokens=8, eos_token_id=EOS, seed=7) == out


def test_stream_yields_every_prompt_once_with_the_completions_sample_gives(engine):
    streamed = dict(engine.stream(PROMPTS, n=4, max_tokens=8, eos_token_id=EOS, seed=7, logprobs=True))
    assert sorted(streamed) == list(range(len(PROMPTS)))
    sampled = engine.sample(PROMPTS, n=4, max_tokens=8, eos_token_id=EOS, seed=7, logprobs=True)
    assert [[c.token_ids for c in streamed[i]] for i in range(len(PROMPTS))] == [
        [c.token_ids for c in group] for group in sampled
    ]
    # The same requests in one engine batch either way: the same logprobs up to the batched kernels'
    # order of summation (float32, a vocabulary of 42), far below a wrong token's gap (0.1 and up).
    for i, group in enumerate(sampled):
        for streamed_completion, completion in zip(streamed[i], group, strict=True):
            assert len(streamed_completion.logprobs) == len(completion.token_ids)
            assert streamed_completion.logprobs == pytest.approx(completion.logprobs, abs=1e-4)
    plain = dict(engine.stream(PROMPTS, n=1, max_tokens=2, eos_token_id=EOS, seed=7))  # consumed: none left queued
    assert all(c.logprobs is None for group in plain.values() for c in group)


def test_generating_leaves_the_callers_torch_rng_as_it_was(engine):
    # vLLM's CPU sampler draws from torch's CPU generator at every step, one number per running
    # request: the caller's stream (an actor rank's, which its checkpoint saves as rng.pt) must not
    # depend on how many tokens the engine sampled.
    torch.manual_seed(123)
    caller = torch.get_rng_state()
    unseeded = engine.generate(PROMPTS, n=4, max_tokens=8, eos_token_id=EOS, seed=None)
    dict(engine.stream(PROMPTS, n=2, max_tokens=8, eos_token_id=EOS, seed=7))
    assert torch.equal(torch.get_rng_state(), caller)
    # The engine's own stream goes on from call to call: unseeded requests do not repeat themselves.
    assert engine.generate(PROMPTS, n=4, max_tokens=8, eos_token_id=EOS, seed=None) != unseeded


def test_eos_stops_the_response_and_is_kept(engine):
    (free,) = engine.sample([PROMPTS[0]], n=1, max_tokens=12, eos_token_id=EOS, seed=None, greedy=True)
    tokens = free[0].token_ids
    # Declare a token greedy decoding emits as EOS: decoding must stop right after it.
    stop_at = next(i for i, t in enumerate(tokens) if i > 0 and t not in tokens[:i])
    (stopped,) = engine.sample([PROMPTS[0]], n=1, max_tokens=12, eos_token_id=tokens[stop_at], seed=None, greedy=True)
    assert stopped[0].token_ids == tokens[: stop_at + 1]
    assert stopped[0].finished_with_eos


def test_update_weights_in_memory_then_vllm_matches_hf(engine, tiny_model_dir):
    model = _hf_model(tiny_model_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)

    greedy = dict(n=1, max_tokens=10, eos_token_id=EOS, seed=None, greedy=True, logprobs=True)
    before = engine.sample(PROMPTS, **greedy)
    seconds = engine.update_weights(model.state_dict().items())
    after = engine.sample(PROMPTS, **greedy)
    assert seconds < 5.0

    for prompt, (completion,) in zip(PROMPTS, after):
        ids = torch.tensor([prompt])
        hf = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert completion.token_ids == hf

    responses = [c.token_ids for (c,) in after]
    hf_logprobs = _score_with_hf(model, PROMPTS, responses)  # (B, SL), padded batch
    for row, (completion,) in enumerate(after):
        got = torch.tensor(completion.logprobs)
        torch.testing.assert_close(got, hf_logprobs[row, : len(got)], atol=1e-4, rtol=0)

    # The engine really changed: what it scored before the update disagrees with the new weights.
    old_responses = [c.token_ids for (c,) in before]
    old_hf = _score_with_hf(model, PROMPTS, old_responses)
    gaps = [
        (torch.tensor(c.logprobs) - old_hf[row, : len(c.token_ids)]).abs().max().item()
        for row, (c,) in enumerate(before)
    ]
    assert max(gaps) > 1e-2


def test_update_weights_path_for_workers_without_reload_weights(engine, tiny_model_dir):
    """vllm-ascend's NPUWorker has no `reload_weights`; the core reload on its model must work."""
    from rldock.runtime.engines import vllm_rollout

    class WorkerWithoutReload:
        def __init__(self, worker):
            self.vllm_config = worker.vllm_config
            self.model_runner = worker.model_runner

    def reload_like_npu(worker, weights):
        vllm_rollout._reload_on_worker(WorkerWithoutReload(worker), weights)

    model = _hf_model(tiny_model_dir)  # the unperturbed weights, after the previous test's update
    engine._llm.collective_rpc(reload_like_npu, args=(iter(model.state_dict().items()),))
    engine._llm.reset_prefix_cache()
    out = engine.sample(PROMPTS, n=1, max_tokens=6, eos_token_id=EOS, seed=None, greedy=True, logprobs=True)
    hf_logprobs = _score_with_hf(model, PROMPTS, [c.token_ids for (c,) in out])
    for row, (completion,) in enumerate(out):
        got = torch.tensor(completion.logprobs)
        torch.testing.assert_close(got, hf_logprobs[row, : len(got)], atol=1e-4, rtol=0)


def test_on_cpu_the_sleep_cycle_runs_without_engine_calls(engine):
    """vLLM refuses sleep mode on CPU: the cycle goes through its states and the engine keeps its
    weights and KV cache, so generating after a sleep needs nothing reloaded."""
    engine.sleep()
    assert engine.memory.state == "asleep"
    assert len(engine.generate([PROMPTS[1]], n=2, max_tokens=4, eos_token_id=EOS, seed=0)[0]) == 2
    assert engine.memory.state == "awake" and not engine.memory.enabled
    assert engine.memory.log[-3:] == ["sleep(level=1)", "wake_up(tags=['weights'])", "wake_up(tags=['kv_cache'])"]


def test_a_first_update_at_sleep_level_2_checks_its_plan_without_waking_the_engine(engine, tiny_model_dir):
    """The first update's check of its plan of copies generates mid-update (engines/cpu_weight_reload.py). At
    rollout.sleep_level 2 a wake-up after a sleep pushes the weights again, and that push would be a first
    update too: the check generates without the sleep cycle, so the update neither wakes the engine nor recurses."""
    from rldock.runtime.engines.generation_memory import SleepCycle

    model, kept, pushes = _hf_model(tiny_model_dir), engine.memory, []
    engine.memory = SleepCycle(engine._llm, level=2, enabled=False)
    engine.memory.reload = lambda: pushes.append(engine.update_weights(model.state_dict().items()))
    moved = {name: tensor + 0.01 for name, tensor in model.state_dict().items()}  # weights the engine lacks
    try:
        engine.weights_by_plan = None  # as at an engine's first update
        engine.sleep()  # at level 2 the weights are stale until pushed
        engine.update_weights(moved.items())
        assert engine.weights_by_plan is True and pushes == [] and engine.memory.state == "weights"
        engine.generate([PROMPTS[0]], n=1, max_tokens=2, eos_token_id=EOS, seed=0)
        assert pushes == [] and engine.memory.state == "awake"  # the update's weights were not stale
    finally:
        engine.memory = kept
        engine.update_weights(model.state_dict().items())  # the unperturbed weights again, for the tests after


def test_engine_leaves_torch_thread_control_to_the_process(engine):
    # vLLM's CPU worker replaces torch.set_num_threads with a no-op; the engine puts it back.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


def test_joining_a_group_after_the_engine_started_is_refused(engine):
    # The engine took the default group (a world of one); a trainer group can no longer be formed.
    from rldock.runtime.engines.process_group import Rendezvous, init_process_group

    with pytest.raises(RuntimeError, match="join the group first"):
        init_process_group(detect_device("cpu"), rank=0, world_size=1, rendezvous=Rendezvous("127.0.0.1", 1))


# ---- data-parallel actor ranks -------------------------------------------------------------------

WORLD_SIZE = 2


def _ddp_reference_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def _ddp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(8, 6, generator=generator).double(), torch.randn(8, 1, generator=generator).double()


@pytest.fixture(scope="module")
def dp_ranks(tiny_model_dir):
    """Two Ray actor ranks (one CPU each) that joined one gloo group; engines come later."""
    ray = pytest.importorskip("ray")

    @ray.remote(num_cpus=1)
    class Rank:
        def __init__(self, rank: int) -> None:
            self.rank = rank
            self.device = detect_device("cpu")

        def rendezvous(self):
            from rldock.runtime.engines.process_group import open_rendezvous

            rendezvous, self.store = open_rendezvous(WORLD_SIZE)
            return rendezvous

        def join(self, rendezvous) -> None:
            from rldock.runtime.engines.process_group import init_process_group

            init_process_group(
                self.device,
                rank=self.rank,
                world_size=WORLD_SIZE,
                rendezvous=rendezvous,
                store=getattr(self, "store", None),
            )

        def all_reduce(self) -> list[float]:
            import torch.distributed as dist

            tensor = torch.full((3,), float(self.rank + 1))
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # the group the ranks formed carries a sum
            return tensor.div_(dist.get_world_size()).tolist()

        def ddp_gradients(self) -> list[torch.Tensor]:
            from rldock.runtime.engines.process_group import wrap_ddp

            model = wrap_ddp(_ddp_reference_model(), self.device)
            x, y = _ddp_batch()
            rows = slice(self.rank * 4, (self.rank + 1) * 4)  # this rank's half of the batch
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            return [p.grad.clone() for p in model.parameters()]

        def start_engine(self, model_dir: str) -> dict:
            import os

            import torch.distributed as dist

            threads_before = torch.get_num_threads()
            start = time.perf_counter()
            self.engine = _engine(Path(model_dir), seed=self.rank)
            return {
                "seconds": time.perf_counter() - start,
                "world_size": dist.get_world_size(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "threads_before": threads_before,
                "threads_after": torch.get_num_threads(),
            }

        def generate(self) -> tuple[float, list[list[list[int]]]]:
            start = time.perf_counter()
            out = self.engine.generate(PROMPTS * 4, n=4, max_tokens=16, eos_token_id=EOS, seed=11)
            return time.perf_counter() - start, out

    with pytest.MonkeyPatch.context() as patch:
        # Not the tier's shared head (conftest.py): its address and token stay out of the GCS and raylet
        # this starts, whose authentication mode then matches the one this process's Ray read when it
        # was first imported, which may have been before conftest set RAY_AUTH_MODE.
        for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
            patch.delenv(key, raising=False)
        ray.init(
            # A private cluster: a bare ray.init() joins any `ray start` cluster on this machine.
            address="local",
            num_cpus=WORLD_SIZE,
            include_dashboard=False,
            log_to_driver=False,
            # The actor class lives in this test module, which workers import by name.
            runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}},
        )
    try:
        ranks = [Rank.remote(r) for r in range(WORLD_SIZE)]
        rendezvous = ray.get(ranks[0].rendezvous.remote())
        ray.get([r.join.remote(rendezvous) for r in ranks])
        yield ranks
    finally:
        ray.shutdown()


def test_actor_ranks_all_reduce(dp_ranks):
    import ray

    assert ray.get([r.all_reduce.remote() for r in dp_ranks]) == [[1.5] * 3, [1.5] * 3]


def test_ddp_averages_gradients_like_one_process_on_the_whole_batch(dp_ranks):
    import ray

    per_rank = ray.get([r.ddp_gradients.remote() for r in dp_ranks])
    model = _ddp_reference_model()
    x, y = _ddp_batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    for grads in per_rank:
        for got, p in zip(grads, model.parameters()):
            torch.testing.assert_close(got, p.grad, atol=1e-6, rtol=0)


def test_two_engines_run_side_by_side_in_two_ranks(dp_ranks, tiny_model_dir):
    """Each DP rank hosts its own in-process engine; created after joining the group, as required."""
    import ray

    infos = ray.get([r.start_engine.remote(str(tiny_model_dir)) for r in dp_ranks], timeout=300)
    for info in infos:
        # vLLM adopted the trainer's group instead of making a world of one.
        assert info["world_size"] == WORLD_SIZE
        # Ray bounds each actor's threads by its num_cpus; the engine leaves the count alone.
        assert info["threads_after"] == info["threads_before"] == int(info["omp_num_threads"])
    results = ray.get([r.generate.remote() for r in dp_ranks], timeout=120)
    outputs = [out for _, out in results]
    for out in outputs:
        assert len(out) == len(PROMPTS) * 4 and all(len(group) == 4 for group in out)
    # Same prompts and call seed, different engine seeds: the ranks sample different responses.
    assert outputs[0] != outputs[1]
