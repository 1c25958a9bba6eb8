"""WorkerGroups.launch with a rollout pool (driver/attempt.py), on doubles that log the calls in submission order:
actor rank 0 is asked for the published weights before its own rollout (the pool's engines, which wait for that
answer, must not wait for the actor's whole rollout: Ray runs one actor's calls in order), the pool's rollouts
join the state's futures, and an update tells the pool that a new version is coming."""

from __future__ import annotations

from rldock.runtime.driver.attempt import WorkerGroups
from rldock.runtime.flow.states import ACTOR, REFERENCE, REFERENCE_INFERENCE, ROLLOUT, UPDATE, StageCall


class HandleDouble:
    """A Ray actor handle whose method calls append (who, method) to a shared log and return a label."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __getattr__(self, method: str):
        handle = self

        class _Method:
            @staticmethod
            def remote(*args, **kwargs):
                handle.log.append((handle.name, method))
                return f"{handle.name}.{method}"

        return _Method()


class PoolDouble:
    def __init__(self, log: list) -> None:
        self.log = log

    def publish(self) -> None:
        self.log.append(("pool", "publish"))

    def launch_rollout(self, call: StageCall) -> list[str]:
        self.log.append(("pool", "launch_rollout"))
        return ["pool.generate"]

    def update_launched(self) -> None:
        self.log.append(("pool", "update_launched"))

    def processes(self) -> list:
        return []


def test_the_pool_is_published_to_before_the_actor_ranks_rollout_and_hears_of_each_update():
    log: list = []
    actors = [HandleDouble(f"actor {rank}", log) for rank in range(2)]
    references = [HandleDouble(f"reference {rank}", log) for rank in range(2)]
    groups = WorkerGroups({ACTOR.name: actors, REFERENCE.name: references}, pool=PoolDouble(log))
    launched = groups.launch(StageCall(3), [ROLLOUT])
    assert log == [("pool", "publish"), ("actor 0", "generate"), ("actor 1", "generate"), ("pool", "launch_rollout")]
    assert launched == {ROLLOUT.name: ["actor 0.generate", "actor 1.generate", "pool.generate"]}
    log.clear()
    groups.launch(StageCall(3), [UPDATE])
    assert log == [("actor 0", "update"), ("actor 1", "update"), ("pool", "update_launched")]
    log.clear()
    groups.launch(StageCall(3), [REFERENCE_INFERENCE])  # not the pool's business
    assert log == [("reference 0", "compute_ref_logprobs"), ("reference 1", "compute_ref_logprobs")]
