"""Bounded-staleness rollouts: which policy version samples each step, and the producer that runs ahead.

Version v is the policy after v RL updates (the warm start is version 0). Step s's rollout is sampled by

    sampling_version(s) = max(s - 1 - depth, restart(s))

`depth` = `rl.sampling_depth` (`rl.max_staleness`, less `partial_rollouts.max_carry` with partial rollouts);
`restart(s)` is the last step before s after which a checkpoint was saved (or the step the run started or
resumed from). So the schedule is fixed by the config alone: the same seed gives the same run, and a run
resumed from a checkpoint draws what the uninterrupted one drew. A step whose rollout comes from version v is
started on the producer's thread as soon as version v exists (`publish`); its update then runs while later
steps sample. Sampling, scoring (and partial rollouts' carrying) happen on that one thread, in step order;
the trainer recomputes the log-probs with the parameters it updates (`rollout.rollout_batch`).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from jaxrl.loop import partial
from jaxrl.loop.rollout import RolloutResult, Sampler, sample_rollout, score_rollout
from jaxrl.sampling import compiled_programs


@dataclasses.dataclass(frozen=True)
class Produced:
    """A step's rollout, the version that sampled it (per token: `result.versions`), and the producer's state
    after it: the prompt iterator's position and the partial rollouts' carry (None without them)."""

    result: RolloutResult
    version: int
    iterator_state: dict
    carry: partial.Carry | None
    compiled: int  # sampler programs compiled so far, counted when this step's sampling ended


def sampling_version(step: int, depth: int, start: int, checkpoint_every: int) -> int:
    """The policy version that samples `step`'s rollout (see the module docstring); `start`: the step the run
    started from (0, or the resumed checkpoint's)."""
    restart = start
    if checkpoint_every:
        restart = max(start, (step - 1) // checkpoint_every * checkpoint_every)
    return max(step - 1 - depth, restart)


class Producer:
    """Samples (and scores) steps `start + 1 .. last` in order: on its own thread when the run allows staleness,
    else inline when the step is taken. `publish(v, state, controls)` hands it version v; `take(step)` returns
    the step's `Produced`, waiting for it."""

    def __init__(self, sampler: Sampler, prompts, start: int, last: int, carry: partial.Carry | None):
        rl = sampler.config.rl
        self.sampler, self.prompts, self.start, self.last = sampler, prompts, start, last
        self.depth, self.every = rl.sampling_depth, sampler.config.checkpoint.every
        self.carry = carry if carry is not None or not rl.partial_rollouts.enabled else partial.Carry()
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="jaxrl-rollout") if rl.staleness else None
        self.submitted = start
        self.pending: dict[int, Future | tuple] = {}

    def version_of(self, step: int) -> int:
        return sampling_version(step, self.depth, self.start, self.every)

    def publish(self, version: int, state, controls) -> None:
        """Version `version` exists (`state`, `controls` its parameters and sampling temperature): start every
        step it samples."""
        while self.submitted < self.last and self.version_of(self.submitted + 1) == version:
            self.submitted += 1
            job = (self.submitted, version, state, controls)
            self.pending[self.submitted] = job if self.thread is None else self.thread.submit(self._produce, *job)

    def take(self, step: int) -> Produced:
        job = self.pending.pop(step, None)
        if job is None:
            raise RuntimeError(f"RL step {step}'s rollout was never started (sampled by version "
                               f"{self.version_of(step)}, which was not published)")
        return job.result() if isinstance(job, Future) else self._produce(*job)

    def wait(self) -> None:
        """Until every started rollout is done (evaluation and checkpoints share the reward pool and device)."""
        for job in self.pending.values():
            if isinstance(job, Future):
                job.result()

    def close(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=True, cancel_futures=True)

    def _produce(self, step: int, version: int, state, controls) -> Produced:
        sampler = self.sampler
        if self.carry is None:
            result = sample_rollout(sampler, step, state, next(self.prompts), controls, self.prompts,
                                    background=self.thread is not None)
            versions = np.where(result.generation.local.completion_mask, version, -1).astype(np.int32)
        else:
            generation, problems, versions, self.carry, metrics, sample_s = partial.rollout(
                sampler, step, version, state.policy, controls.temperature, self.prompts, self.carry)
            t0 = time.perf_counter()
            scored = score_rollout(sampler, problems, generation.texts)
            result = RolloutResult(problems, generation, scored, sample_s, time.perf_counter() - t0, metrics)
        # counted here, on the producer's thread before it starts the next step: counted on the update side,
        # later steps' compilations would show or not depending on how long the update takes
        compiled = compiled_programs()
        result = dataclasses.replace(result, versions=versions)
        return Produced(result, version, self.prompts.get_state(), self.carry, compiled)


def staleness_metrics(versions: np.ndarray, step: int, bound: int) -> dict[str, float]:
    """`offpolicy/*` of step's batch from its tokens' `versions [B, N]` (-1 off the completion): the mean and
    largest staleness (versions between the sampling policy and the one updated, `step - 1`) and the share of
    tokens at each staleness 0..bound. Raises `RuntimeError` for a token older than `bound`."""
    ages = (step - 1) - versions[versions >= 0]
    if ages.size and (ages.max() > bound or ages.min() < 0):
        raise RuntimeError(f"RL step {step}: a sampled token is {ages.max()} policy versions old, beyond "
                           f"rl.max_staleness = {bound} (or from a future version: {ages.min()})")
    metrics = {"offpolicy/staleness_mean": float(ages.mean()) if ages.size else 0.0,
               "offpolicy/staleness_max": float(ages.max()) if ages.size else 0.0}
    if bound:
        counts = np.bincount(ages, minlength=bound + 1) / max(ages.size, 1)
        metrics.update({f"offpolicy/staleness_{k}_frac": float(counts[k]) for k in range(bound + 1)})
    return metrics
