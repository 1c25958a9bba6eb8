"""A test double of the rollout engine for the gateway's tests (tests/README: the real vLLM engine serves
the gateway in tests/integration/test_harness_job.py): it answers request `r` of sample `k` with
`script[k][r-1]` (text; EOS appended unless it ends in '…'), one request per step, and counts what it was
asked. A resumed request (key `(k, r, done)`: a turn cut after `done` tokens, chat/cut_turns.py) gets that
turn's tokens after the first `done`; every logprob is -(`version` + 1), so a logprob says which weights
sampled its token."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from rldock.runtime.engines.vllm_rollout import Completion


class ScriptedEngine:
    seed = 0

    def __init__(self, tokenizer, script: Mapping[int, list[str]], *, hold: threading.Event | None = None):
        self.tokenizer, self.script = tokenizer, script
        self.queue: list[tuple[str, list[int], int, tuple[int, ...], bool]] = []
        self.prompts: dict[tuple[int, ...], list[int]] = {}
        self.submitted = 0
        self.aborted: list[str] = []
        self.hold = hold  # while set... cleared: steps wait until it is set (a turn held in the engine)
        self.version = 0  # the weights' policy version
        self._ids = 0

    def _turn(self, key: tuple[int, ...], limit: int) -> Completion:
        text = self.script[key[0]][key[1] - 1]
        tokens = self.tokenizer(text.removesuffix("…"), add_special_tokens=False)["input_ids"]
        if not text.endswith("…"):
            tokens.append(self.tokenizer.eos_token_id)
        done = key[2] if len(key) > 2 else 0
        tokens = tokens[done : done + limit]
        logprobs = [-(self.version + 1.0)] * len(tokens)
        return Completion(tokens, logprobs, bool(tokens) and tokens[-1] == self.tokenizer.eos_token_id)

    def submit(self, prompts, *, max_tokens, eos_token_id, seed, request_keys, greedy=False, logprobs=False):
        ids = []
        for prompt, limit, key in zip(prompts, max_tokens, request_keys):
            self._ids += 1
            self.submitted += 1
            ids.append(str(self._ids))
            self.queue.append((str(self._ids), list(prompt), limit, tuple(key), logprobs))
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def abort(self, request_ids):
        self.aborted.extend(request_ids)
        self.queue = [item for item in self.queue if item[0] not in request_ids]

    def step(self, eos_token_id):
        if self.hold is not None:
            self.hold.wait()
        request_id, prompt, limit, key, logprobs = self.queue.pop(0)
        self.prompts[key] = prompt
        completion = self._turn(key, limit)
        if not logprobs:
            completion = Completion(completion.token_ids, None, completion.finished_with_eos)
        return [(request_id, completion)]

    def sample(self, prompts, *, n, max_tokens, eos_token_id, seed, greedy=False, logprobs=False, prompt_keys=None):
        return [[self._turn((key, 1), max_tokens)] for key in prompt_keys or []]
