"""The RL run, one job per module. From `jaxrl train` to the jitted step in four hops:

    jaxrl.cli._train                 parses the command line and loads the config
    -> loop.experiment.run           setup -> warm start -> held-out eval -> RL -> eval -> export -> summary
    -> loop.rl.train                 the RL driver: steps, periodic evaluation, checkpoints, preemption
    -> loop.rl.rl_step               one step: rewards -> advantages -> update, as (LoopState) -> (LoopState, record)
    -> train.make_rl_step's step     the jitted optimizer step (called through `rl.rl_update`)

Beside them: `setup` (data, policy, tokenizer, programs), `generate` (the sampler front end), `rollout`
(sampling and scoring a step's batch), `warm_start`, `held_out` (evaluation, `jaxrl eval`), `resume`
(checkpoints to go on from) and `outputs` (the output directory), `progress` (bars or log lines),
`self_rewards` (TTRL, RENT and self-certainty rewards from the rollout's groups and its log-prob pass).
"""

from jaxrl.errors import Preempted, TrainingDiverged
from jaxrl.loop.experiment import run
from jaxrl.loop.generate import Generation, Generator, prompt_length_buckets
from jaxrl.loop.held_out import evaluate, evaluate_checkpoint, evaluate_sampled
from jaxrl.loop.resume import resume_point
from jaxrl.loop.rl import LoopState, prompt_statistics, rl_step, rl_update, step_timing, update_controls
from jaxrl.loop.rollout import RolloutResult, rollout_batch, shaped_rewards
from jaxrl.loop.setup import check_batch_sizes, load_task, optimizer_from
from jaxrl.loop.warm_start import warm_start

__all__ = ["Generation", "Generator", "LoopState", "Preempted", "RolloutResult",
           "TrainingDiverged", "check_batch_sizes", "evaluate", "evaluate_checkpoint", "evaluate_sampled",
           "load_task", "optimizer_from", "prompt_length_buckets", "prompt_statistics", "resume_point",
           "rl_step", "rl_update", "rollout_batch", "run", "shaped_rewards", "step_timing", "update_controls",
           "warm_start"]
