"""The rollout engine: an in-process vLLM `LLM` that samples responses and takes new weights in memory.

Prompts and responses are token ids (`skip_tokenizer_init=True`): the trainer tokenizes once, the
dock stores ids, and the engine never looks up a tokenizer or the Hub. Weights move from the torch
policy into the running engine through the worker's `reload_weights` with an iterator of
(HF name, tensor) pairs, so no checkpoint is written and re-read between iterations.

The engine runs in the caller's process (VLLM_ENABLE_V1_MULTIPROCESSING=0): at most one engine per
Ray actor, no engine-core subprocess. At `rollout.tensor_parallel_size` 1 the executor is
uni-process too, so the weight iterator is handed to the worker directly instead of being pickled.
At generation TP > 1 vLLM's multiprocessing executor starts one worker process per TP rank, children
of this actor (on CPU they share its cores; on an accelerator each needs one of the replica's
devices), and new weights reach them through vLLM's RPC queue, pickled (see `update_weights`).
On Ascend, vllm-ascend registers itself as a vLLM platform plugin, so the same `vllm` API runs there.

Process-wide side effects of creating an engine (why `_prepare_process` exists):
- vLLM reads VLLM_* variables at import and engine creation, so they are set before `import vllm`.
- On CPU, vLLM drops torch to one intra-op thread unless OMP_NUM_THREADS is set, and its CPU worker
  replaces `torch.set_num_threads` with a no-op. A trainer sharing the process would silently train
  on one thread, so both are undone after start. (Setting OMP_NUM_THREADS instead would leak into
  every process started later, Ray workers included.) Ray sets OMP_NUM_THREADS to each actor's
  num_cpus, which is what bounds an engine's threads.
  vLLM's OpenMP core binding (VLLM_CPU_OMP_THREADS_BIND) is applied only by its multiprocessing
  executor, never in-process, so several engines on one node (one per data-parallel actor) need
  no binding settings: they do not pin themselves onto each other's cores. A TP > 1 engine does
  use that executor; its automatic binding wants one NUMA node per TP worker and refuses otherwise
  ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"), and it would pin onto
  cores Ray gave other actors, so it runs unbound ("nobind") unless the variable is set.
- vLLM seeds torch's CPU generator at start (its `set_random_seed`) and its CPU sampler draws from
  it at every step, one number per running request, seeded or not (`forward_cpu`'s per-row seeds).
  That generator is the trainer's stream too (the actor seeds it with seed + rank, the checkpoint's
  rng.pt saves it), and the number of tokens a rank samples depends on which prompt groups the dock
  dealt it, first come first served. So the engine keeps a stream of its own: every call that samples
  (the engine's start, `sample`, each step of `stream`, `step`) swaps it in and puts the caller's
  back (`_own_rng`), and the caller's stream advances only with the caller's own draws. The calls
  left outside the swap (enqueueing a request, abort, the weight reload, sleep and wake) draw
  nothing from it in vLLM 0.32 (read in its source); a vLLM upgrade should be checked for that.
  The swap assumes no other thread draws from that generator during an engine call: a seat's
  calls run one at a time on its own thread (workers/device_worker.py), and the seats that may
  share an actor's process (reference, critic) draw only in their constructors.
- vLLM runs five full garbage collections while it builds the engine (two around the weights' load, three
  before it freezes the heap for good, `freeze_gc_heap`, so that collections while serving skip what
  start-up made). Each walks every object the process holds: torch, transformers and vLLM's modules and,
  in an actor, Ray's and the trainer's. The engine freezes that heap once first, which leaves vLLM's
  collections the engine's own objects: the demo engine's build took 0.9-1.0 s against 1.8 s in a fresh
  interpreter here. vLLM leaves the heap frozen anyway once built. The freeze comes without a full
  collection before it, which would walk every object once more to free the cyclic garbage the process's
  imports left (their collections are paused, rldock.runtime.startup): in a fresh interpreter with
  collections off, after importing the actor's modules and vLLM, 0.56 s of CPU for 17,862 objects (12 MiB,
  shallow sizes); with SmolLM2-135M loaded beside them, 11,122 objects and no tensor. That garbage stays
  frozen instead.
- vLLM initialises torch.distributed in this process (a world of one over a FileStore) when no
  default group exists yet, and adopts the default group when one does (then every rank of that
  group must create its engine at the same time, since vLLM forms sub-groups collectively); see
  `rldock.runtime.engines.process_group` for the ordering this imposes on data-parallel actors.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rldock.config.rollout import RolloutSpec, generation_dtype
from rldock.runtime.device import VISIBLE_DEVICES_ENVS, DeviceInfo
from rldock.runtime.engines.cpu_weight_reload import (
    UNCHANGED,
    confirm_plan,
    forget_plan,
    load_by_new_plan,
    load_by_plan,
)
from rldock.runtime.engines.generation_memory import SleepCycle
from rldock.runtime.models.moe import unfuse_experts
from rldock.runtime.planning.cpu_kv_cache import cpu_kv_cache_bytes
from rldock.runtime.planning.dtypes import DTYPE_BYTES
from rldock.runtime.planning.shapes import shape_from_hf_config

logger = logging.getLogger(__name__)

_CPU_STEP_TOKENS = 4096  # vLLM's own CPU default for prompt tokens per engine step
_PROBE_PROMPT_TOKENS = 8  # the greedy generation that checks a weight-update plan (`_choose_the_way`)

# Set before vLLM is imported. In-process engine core: no subprocess per engine, and the only mode
# in which weights can be handed to the worker as live tensors.
_VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class Completion:
    """One sampled response: token ids (EOS included when generated) and each token's logprob.

    `logprobs` is the sampled tokens' log-probability under the model's raw distribution
    (before temperature and top-p), or None when it was not requested.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    finished_with_eos: bool


def _prepare_process(device: DeviceInfo) -> None:
    """Set the process environment vLLM reads at import and engine start (see module docstring)."""
    for key, value in _VLLM_ENV.items():
        previous = os.environ.setdefault(key, value)
        if previous != value:
            raise RuntimeError(
                f"{key}={previous!r} is set in the environment, but the rollout engine runs vLLM "
                f"in-process and needs {key}={value!r}"
            )
    if device.engine_kind != "cpu":
        return
    # kv cache size comes from planning/cpu_kv_cache.py (as bytes, so fractions of a GiB work);
    # vLLM lets the legacy whole-GiB variable override it, so a stray one is dropped loudly.
    stray = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if stray is not None:
        logger.warning("ignoring VLLM_CPU_KVCACHE_SPACE=%s; rollout.cpu_kv_cache_gib or its default sizes it", stray)
    if "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS" not in os.environ:
        # vLLM compiles a few small sampler kernels with inductor even in eager mode (the rank of
        # each sampled token when logprobs are asked for). Inductor's precompiled header lives in
        # one machine-wide directory (/tmp/torchinductor_<user>), shared by every process and
        # keyed by compiler flags only; a mismatched one there broke every later kernel build
        # ("'at::vec' has not been declared"). Without it these kernels still build in seconds.
        import torch._inductor.config as inductor_config

        inductor_config.cpp_cache_precompile_headers = False


def _cpu_kv_cache_bytes(rollout: RolloutSpec, model_config: dict, dtype: str, max_model_len: int) -> int:
    """The KV cache of a CPU engine (planning/cpu_kv_cache.py): of the model's shape, per TP rank."""
    sized = functools.partial(
        cpu_kv_cache_bytes,
        rollout,
        dtype_bytes=DTYPE_BYTES[dtype],
        generation_tp=rollout.tensor_parallel_size,
        max_model_len=max_model_len,
    )
    try:
        size = sized(shape_from_hf_config(model_config, name=model_config.get("model_type", "")))
    except (KeyError, TypeError, ValueError, ArithmeticError) as error:  # a shape the planner does not read
        logger.info("the KV cache takes its cap: config.json gives no model shape the planner reads (%r)", error)
        size = sized(None)
    logger.info("KV cache %.1f MiB per device", size / 2**20)
    return size


def _check_visible_devices(device: DeviceInfo, tp: int) -> None:
    """An accelerator engine at TP `tp` starts `tp` worker processes, each on one of the devices
    this process's environment makes visible to its children. Ray shows an actor only its own
    device; the trainer widens an engine rank's list to its replica's before the engine starts
    (rldock.runtime.engines.replica_devices). This process's own device count was fixed when it
    opened its device, so the variable is what counts here."""
    name = VISIBLE_DEVICES_ENVS[device.kind]
    listed = os.environ.get(name)
    device_type = torch.device(device.torch_device).type
    visible = len(listed.split(",")) if listed else torch.get_device_module(device_type).device_count()
    if visible < tp:
        raise RuntimeError(
            f"rollout.tensor_parallel_size={tp} needs {tp} {device_type} devices visible to the "
            f"engine's actor, which sees {visible} ({name}={listed!r}); the trainer hands a "
            "replica's devices to its first rank, so start the engine through it (`rldock train`), "
            "or make the devices visible yourself"
        )


def _restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def mixed_seed(engine_seed: int, call_seed: int, key: int | Sequence[int]) -> int:
    """A 31-bit seed mixed from (engine seed, a call's seed, a key): a request's, or an environment
    reset's (agent/episode_loop.py)."""
    # SeedSequence mixes the numbers so nearby keys land far apart; 31 bits leave room for
    # vLLM's seed + j per response. A key of several numbers: (sample, turn) in a multi-turn rollout.
    entropy = [engine_seed, call_seed, *([key] if isinstance(key, int) else key)]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint32)[0] >> 1)


def _completions(out, eos_token_id: int) -> list[Completion]:
    """The Completions of one finished vLLM RequestOutput (one prompt's `n` responses)."""
    return [
        Completion(
            token_ids=list(c.token_ids),
            logprobs=None if c.logprobs is None else [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)],
            finished_with_eos=bool(c.token_ids) and c.token_ids[-1] == eos_token_id,
        )
        for c in out.outputs
    ]


def _repack_cpu_experts(model: torch.nn.Module) -> int:
    """Prepack an MoE model's reloaded expert weights for vLLM's CPU kernel; returns the layers done.

    vLLM 0.32's CPU MoE experts (`CPUUnquantizedExperts`) prepack w13/w2 into their grouped-GEMM
    layout once, at the first load. An in-place reload copies the new weights into those parameters
    in the checkpoint's plain layout and skips the prepack (`UnquantizedFusedMoEMethod._setup_kernel`
    runs the experts' `process_weights_after_loading` only when no kernel exists yet), so the kernel
    would read plain rows as packed ones: generation after a weight update scores nothing like the
    pushed model (tests/integration/test_architectures_in_vllm.py, tiny-qwen3-moe). Running the
    experts' prepack again on the plain rows gives the first load's layout. No-op for dense models
    and other devices' kernels."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    done = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            done += 1
    return done


def _reload_on_worker(worker, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Runs inside the vLLM worker: reload weights in place from `weights`."""
    if hasattr(worker, "reload_weights"):
        # vLLM's GPU and CPU workers: the reload plus resetting caches derived from weights.
        worker.reload_weights(weights_iterator=weights)
        _repack_cpu_experts(worker.model_runner.get_model())
        return
    # Platform workers that lack the method (vllm-ascend's NPUWorker derives from WorkerBase):
    # the same core reload, on the runner's model.
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    with set_current_vllm_config(worker.vllm_config):
        reload_weights(
            worker.vllm_config,
            worker.model_runner.get_model(),
            weights_iterator=weights,
            weights_path=None,
            is_checkpoint_format=True,
        )


class VllmRolloutEngine:
    """Samples N responses per prompt with vLLM and accepts in-memory policy weight updates."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        rollout: RolloutSpec,
        dtype: str,
        seed: int,
        max_model_len: int,
        device: DeviceInfo,
        kv_cache_bytes: int | None = None,
    ) -> None:
        """`dtype`: model.dtype, the trainer's; the engine runs `rollout.dtype` when set (see
        `generation_dtype`). `kv_cache_bytes`: the KV cache's size on an accelerator
        (generation_memory.kv_cache_budget); None leaves vLLM to size it from
        rollout.gpu_memory_utilization. Ignored on CPU, sized there by planning/cpu_kv_cache.py."""
        _prepare_process(device)
        from vllm import LLM

        self.tensor_parallel_size = tp = rollout.tensor_parallel_size

        self._rollout = rollout
        self._seed = seed
        self._device = device
        self.dtype = generation_dtype(
            model_dtype=dtype, rollout_dtype=rollout.dtype, on_cpu=device.engine_kind == "cpu"
        )
        if self.dtype != dtype:
            logger.info("vLLM generates in %s (model.dtype %s is the trainer's)", self.dtype, dtype)
        model_config = json.loads((Path(model_dir) / "config.json").read_text())
        self.model_type = model_config.get("model_type", "")
        text_config = model_config.get("text_config", {})
        self._vocab_size = int(
            model_config.get("vocab_size") or text_config.get("vocab_size", _PROBE_PROMPT_TOKENS + 2)
        )
        # Whether weight updates go by a plan of copies (cpu_weight_reload.py): None until the first update that
        # changes the weights decided it, which only an in-process CPU engine does (an accelerator's sleeps
        # between phases, and the check's generation would wake it in the middle of an update)
        self.weights_by_plan: bool | None = None if device.engine_kind == "cpu" and tp == 1 else False
        engine_args: dict = dict(
            model=str(model_dir),
            dtype=self.dtype,
            skip_tokenizer_init=True,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=rollout.enforce_eager,
            disable_log_stats=True,
        )
        if rollout.enable_prefix_caching is not None:  # unset: vLLM's own default for the device
            engine_args.update(enable_prefix_caching=rollout.enable_prefix_caching)
        if tp > 1 and device.is_accelerator:  # the npu twin too: its workers get the replica's list
            _check_visible_devices(device, tp)
        if tp > 1:  # vLLM splits the weights over TP worker processes of its own ("ray" inside a
            # Ray placement group by default, which would ask Ray for more devices than the job holds)
            engine_args.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        if device.engine_kind == "cpu":
            engine_args.update(
                kv_cache_memory_bytes=_cpu_kv_cache_bytes(rollout, model_config, self.dtype, max_model_len)
            )
            # No chunked prefill: when a step's prompt tokens outgrow its budget (G*N real prompts
            # do), vLLM splits one prompt's prefill, discards the token sampled for it and rewinds
            # that request's seeded generator, which a CPU generator refuses ("CPU Generator does
            # not use offset"). Unchunked, a prompt that does not fit waits for the next step.
            engine_args.update(
                enable_chunked_prefill=False, max_num_batched_tokens=max(_CPU_STEP_TOKENS, max_model_len)
            )
            if "kv_lora_rank" in model_config and self.dtype != "bfloat16":
                # Latent attention (DeepSeek's): vLLM prefers its AMX kernel where the CPU has AMX, and that
                # kernel takes bfloat16 only; its portable kernel takes float32 too.
                engine_args.update(attention_config={"backend": "CPU_MLA"})
        else:
            engine_args.update(
                gpu_memory_utilization=rollout.gpu_memory_utilization,
                # Frees weights and KV cache while the trainer uses the same device.
                enable_sleep_mode=True,
            )
            if kv_cache_bytes is not None:  # vLLM then ignores gpu_memory_utilization
                engine_args.update(kv_cache_memory_bytes=kv_cache_bytes)

        num_threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        ld_preload = os.environ.get("LD_PRELOAD")
        cpu_bind = os.environ.get(_CPU_BIND)
        if tp > 1 and device.engine_kind == "cpu" and cpu_bind is None:
            os.environ[_CPU_BIND] = "nobind"  # read by the TP workers at start (module docstring)
        start = time.perf_counter()
        self._rng_state: torch.Tensor | None = None  # the engine's CPU stream: vLLM seeds it at start
        gc.freeze()  # vLLM's own collections then walk the engine's objects only (module docstring)
        try:
            with self._own_rng():
                self._llm = LLM(**engine_args)
        finally:
            _restore_env(_CPU_BIND, cpu_bind)
        # The engine shares this process with the trainer, which keeps its thread count (see the
        # module docstring); vLLM's per-step CPU work is the same speed either way here.
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        # vLLM's CPU platform adds torch's libgomp (and tcmalloc) to LD_PRELOAD for the worker
        # processes it would spawn; in-process it spawns none. Left set, every process started
        # later (Ray workers included) loads OpenMP before Ray sets OMP_NUM_THREADS, and each
        # actor then runs one thread per core.
        _restore_env("LD_PRELOAD", ld_preload)
        self.start_seconds = time.perf_counter() - start
        # Sleep and wake around generation; on CPU the same sequence with no engine calls (vLLM
        # refuses sleep mode there). The actor sets `memory.reload` for level 2.
        self.memory = SleepCycle(self._llm, level=rollout.sleep_level, enabled=device.engine_kind != "cpu")
        logger.info("vLLM engine for %s on %s started in %.1f s", model_dir, device.torch_device, self.start_seconds)

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        max_tokens: int,
        eos_token_id: int,
        seed: int | None,
        greedy: bool = False,
        logprobs: bool = False,
        prompt_keys: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """Per prompt, `n` completions, in prompt order.

        With a `seed`, prompt i gets its own seed mixed from (engine seed, seed, key_i) and vLLM
        gives its j-th response that seed + j; key_i is `prompt_keys[i]` when given (a stable id
        such as the prompt's group index, so a prompt samples the same responses whichever rank or
        batch it lands in), else the position i. A shared seed, or seed + i, would hand different
        prompts the same random streams, and a near-uniform policy then samples the same tokens
        for all of them.
        `greedy` ignores the rollout temperature/top_p (for evaluation and tests).
        """
        if not prompts:
            return []
        requests, params = self._requests(
            prompts,
            n=n,
            max_tokens=max_tokens,
            eos_token_id=eos_token_id,
            seed=seed,
            greedy=greedy,
            logprobs=logprobs,
            prompt_keys=prompt_keys,
        )
        self.memory.before_generation()
        with self._own_rng():
            outputs = self._llm.generate(requests, params, use_tqdm=False)
        return [_completions(out, eos_token_id) for out in outputs]

    def _requests(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        max_tokens: int | Sequence[int],
        eos_token_id: int,
        seed: int | None,
        greedy: bool = False,
        logprobs: bool = False,
        prompt_keys: Sequence[int | Sequence[int]] | None = None,
    ) -> tuple[list, list]:
        """vLLM's prompts and per-prompt sampling parameters for `sample`, `stream` and `submit`
        (`max_tokens` one for all prompts or one per prompt)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        keys = list(range(len(prompts))) if prompt_keys is None else list(prompt_keys)
        if len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} prompt_keys for {len(prompts)} prompts")
        limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        temperature, top_p = (0.0, 1.0) if greedy else (self._rollout.temperature, self._rollout.top_p)
        params = [
            SamplingParams(
                n=n,
                max_tokens=limits[i],
                temperature=temperature,
                top_p=top_p,
                seed=None if seed is None else mixed_seed(self._seed, seed, keys[i]),
                # Without a tokenizer vLLM knows no EOS; as a stop token it stays in the output.
                stop_token_ids=[eos_token_id],
                detokenize=False,
                logprobs=0 if logprobs else None,
            )
            for i in range(len(prompts))
        ]
        return [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        max_tokens: int,
        eos_token_id: int,
        seed: int | None,
        logprobs: bool = False,
        prompt_keys: Sequence[int] | None = None,
    ) -> Iterator[tuple[int, list[Completion]]]:
        """`sample` in one engine batch, but yielding (prompt position, its `n` completions) as each
        prompt's last response finishes, so a caller can pass finished groups on while the others
        still generate. Same seeds, hence the same responses, as `sample`."""
        if not prompts:
            return
        requests, params = self._requests(
            prompts,
            n=n,
            max_tokens=max_tokens,
            eos_token_id=eos_token_id,
            seed=seed,
            logprobs=logprobs,
            prompt_keys=prompt_keys,
        )
        position = {request_id: i for i, request_id in enumerate(self._enqueue(requests, params))}
        engine = self._llm.llm_engine
        while engine.has_unfinished_requests():
            with self._own_rng():  # per step: the caller runs between the yields on its own stream
                outputs = engine.step()
            for out in outputs:
                if out.finished:
                    yield position[out.request_id], _completions(out, eos_token_id)

    def _enqueue(self, requests: list, params: list) -> list[str]:
        """Wake the engine and queue `requests` without running it; the ids its outputs carry."""
        self.memory.before_generation()
        # enqueue returns vLLM's internal ids ("<external>-<8 random chars>"); outputs carry the
        # external id, vLLM's request counter.
        return [request_id.rsplit("-", 1)[0] for request_id in self._llm.enqueue(requests, params, use_tqdm=False)]

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: Sequence[int],
        eos_token_id: int,
        seed: int,
        request_keys: Sequence[Sequence[int]],
        greedy: bool = False,
        logprobs: bool = False,
    ) -> list[str]:
        """Queue one response per prompt without running the engine (a multi-turn rollout adds turns
        while others generate); returns the ids `step` reports them under. Each request's seed is mixed
        from (engine seed, `seed`, its key), as in `sample`."""
        if not prompts:
            return []
        requests, params = self._requests(
            prompts,
            n=1,
            max_tokens=max_tokens,
            eos_token_id=eos_token_id,
            seed=seed,
            greedy=greedy,
            logprobs=logprobs,
            prompt_keys=request_keys,
        )
        return self._enqueue(requests, params)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop queued requests (by the ids `submit` returned) that nobody will wait for."""
        if request_ids:
            self._llm.llm_engine.abort_request(list(request_ids))

    def step(self, eos_token_id: int) -> list[tuple[str, Completion]]:
        """One engine step over every queued request; the (id, response) of those it finished."""
        with self._own_rng():
            outputs = self._llm.llm_engine.step()
        return [(out.request_id, _completions(out, eos_token_id)[0]) for out in outputs if out.finished]

    @contextmanager
    def _own_rng(self) -> Iterator[None]:
        """Run vLLM on the engine's own torch CPU stream and give the caller's back after (module
        docstring): what the engine draws never moves the trainer's stream, which then depends on the
        trainer's draws alone (rng.pt byte-identical run to run, and a resume continuing it)."""
        caller = torch.get_rng_state()
        if self._rng_state is not None:
            torch.set_rng_state(self._rng_state)
        try:
            yield
        finally:
            self._rng_state = torch.get_rng_state()
            torch.set_rng_state(caller)

    @property
    def seed(self) -> int:
        """The engine's own seed (the job's), mixed into every request's."""
        return self._seed

    def has_unfinished(self) -> bool:
        return self._llm.llm_engine.has_unfinished_requests()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        max_tokens: int,
        eos_token_id: int,
        seed: int | None,
        prompt_keys: Sequence[int] | None = None,
    ) -> list[list[list[int]]]:
        """Per prompt, `n` response token id lists sampled with the rollout temperature/top_p."""
        completions = self.sample(
            prompts, n=n, max_tokens=max_tokens, eos_token_id=eos_token_id, seed=seed, prompt_keys=prompt_keys
        )
        return [[c.token_ids for c in group] for group in completions]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Load new policy weights into the running engine in memory; returns seconds taken.

        `named_tensors` are HF parameter names and tensors, as in the unwrapped torch model's
        `state_dict()` (no DDP `module.` prefix), on any device and dtype (cast here to the engine's,
        so a float32 master pushes bfloat16 into a bfloat16 engine); every parameter must be
        included, since a layer given only part of its weights is rebuilt from that part. vLLM's
        own `load_weights` maps them (fused qkv / gate_up, tied embeddings) inside the reload
        wrapper, which first restores the weight loaders that post-load processing strips (a bare
        `load_weights` on the running model fails: "'Parameter' object has no attribute
        'weight_loader'") and re-runs that processing after. An in-process CPU engine goes by a plan of
        copies instead once its first update showed the plan leaves the engine as that reload does
        (cpu_weight_reload.py). Cached KV blocks were computed with the old weights, so the prefix cache is
        dropped.
        """
        start = time.perf_counter()
        # MoE: the Hub's per-expert tensors, as vLLM loads them
        named_tensors = unfuse_experts(named_tensors, model_type=self.model_type)
        self.memory.before_weight_update()  # weights back in place (the KV cache stays freed)
        with torch.no_grad():  # trainer tensors may require grad; the copies must not record it
            dtype = getattr(torch, self.dtype)
            if self.tensor_parallel_size == 1:
                # In-process executor: the callable runs on the worker here, so the iterator
                # reaches it as is (no pickling of tensors); each tensor is cast as it is loaded.
                weights: Iterable[tuple[str, torch.Tensor]] = (
                    (name, tensor.to(dtype)) for name, tensor in named_tensors
                )
                if self.weights_by_plan is None:  # a CPU engine's first update chooses the way (weights held at once)
                    pairs = list(weights)
                    self._choose_the_way(lambda: iter(pairs))
                else:  # streamed: a gathered or merged tensor is freed once loaded
                    rpc = load_by_plan if self.weights_by_plan else _reload_on_worker
                    self._llm.collective_rpc(rpc, args=(weights,))
            else:
                # Worker processes: the pairs are pickled once per worker. Each tensor is copied
                # into its own host storage first: pickling a view (of the gathered buffer, or a
                # DDP bucket) writes its whole storage, and a device tensor would be rebuilt in the
                # worker on that device kind (pickling reads it through the host anyway). vLLM's
                # loaders narrow each to their rank and copy it onto the worker's device.
                weights = [(name, tensor.detach().to("cpu", dtype=dtype, copy=True)) for name, tensor in named_tensors]
                self._llm.collective_rpc(_reload_on_worker, args=(iter(weights),))
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self.memory.after_weight_update()
        seconds = time.perf_counter() - start
        logger.debug("vLLM weight update took %.3f s", seconds)
        return seconds

    def _choose_the_way(self, weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> None:
        """The first update of an in-process CPU engine that changes its weights: load `weights()` (a fresh
        iterator per call) by a plan of copies over the previous weights, then through vLLM's reload, and keep the
        plan for later updates if both left the same parameters and the same greedy generation
        (cpu_weight_reload.py). The engine ends as vLLM's reload leaves it either way."""
        reason = self._llm.collective_rpc(load_by_new_plan, args=(list(weights()),))[0]
        by_plan = self._probe() if reason is None else None
        self._llm.collective_rpc(_reload_on_worker, args=(weights(),))
        if reason is None:
            reason = self._llm.collective_rpc(confirm_plan)[0]
        if reason is None and self._probe() != by_plan:
            reason = "a greedy generation differed from vLLM's reload's"
            self._llm.collective_rpc(forget_plan)
        if reason == UNCHANGED:  # decided at the first update that changes the weights
            return
        self.weights_by_plan = reason is None
        if reason is None:
            logger.info(
                "weight updates go by a plan of copies: it left the parameters and a greedy generation as vLLM's reload"
            )
        else:
            logger.info("weight updates go through vLLM's reload: %s", reason)

    def _probe(self) -> list[tuple[list[int], list[float] | None]]:
        """Tokens and logprobs of a short greedy generation, drawing nothing from the engine's stream (the
        stream is put back: what the job samples next is what it would have sampled without the probe)."""
        stream = None if self._rng_state is None else self._rng_state.clone()
        prompt = list(range(1, min(_PROBE_PROMPT_TOKENS, self._vocab_size - 1) + 1))
        requests, params = self._requests(
            [prompt], n=1, max_tokens=4, eos_token_id=0, seed=0, greedy=True, logprobs=True
        )
        # not `sample`: its sleep cycle's wake-up would push the weights again (rollout.sleep_level 2) mid-update
        with self._own_rng():
            (out,) = self._llm.generate(requests, params, use_tqdm=False)
        self._rng_state = stream
        return [(c.token_ids, c.logprobs) for c in _completions(out, eos_token_id=0)]

    def shutdown(self) -> None:
        """Stop the engine and free its memory; call it last in the process.

        vLLM's teardown destroys torch.distributed's default group whether it created it or
        adopted the trainer's, so no collective can follow. Safe to call twice.
        """
        self._llm.llm_engine.engine_core.shutdown()

    def sleep(self) -> None:
        """After a generation phase: free the engine's device memory for training (KV cache freed,
        weights offloaded at rollout.sleep_level 1 or discarded at 2); the next `sample` or
        `update_weights` wakes what it needs. On CPU the sequence runs with no engine calls."""
        self.memory.after_generation()

    def wake_up(self) -> None:
        """Weights and KV cache back (what `sample` does itself first)."""
        self.memory.before_generation()
