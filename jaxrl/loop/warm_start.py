"""The supervised warm start: `sft.steps` steps on demonstrations before RL."""

from __future__ import annotations

import jax

from jaxrl.config import Config
from jaxrl.data import arithmetic
from jaxrl.data.demonstrations import demonstrations
from jaxrl.loop import progress, setup
from jaxrl.loop.generate import Generator
from jaxrl.metrics import MetricsWriter
from jaxrl.sharding import shard_batch
from jaxrl.tokenizer import encode_examples
from jaxrl.train import TrainState, init_train_state, make_sft_step


def warm_start(policy, config: Config, generate: Generator, train_problems, writer: MetricsWriter) -> TrainState:
    """Supervised steps on demonstrations: the data file's solutions (`data.solution_field`, or the last
    assistant message of a chat row: `jaxrl.data.demonstrations`), or for the built-in task a sloppy teacher's
    (`jaxrl.data.arithmetic`; with `task.tool_rate`, some are calculator episodes). A solution is a text or a
    multi-turn episode's segments `(("model", call), ("observation", result), ("model", answer))`: observation
    tokens are context, not targets (`jaxrl.tokenizer.encode_completion`).

    The steps donate their state, so `policy`'s arrays are consumed: use the returned state's policy.
    """
    optimizer = setup.optimizer_from(config.sft.optim)
    state = init_train_state(policy, optimizer)
    step_fn = make_sft_step(optimizer, donate=True)
    if not config.sft.steps:
        return state
    examples = (demonstrations(train_problems, config.seed) if config.data.train_file is not None
                else arithmetic.teacher_examples(train_problems, config.task, config.seed))
    # step n: the record of the n-th update, counted from 1 as RL's steps are
    bar = progress.steps(1, config.sft.steps, "warm start", config.progress)
    for step in bar:
        prompts, solutions = zip(*(next(examples) for _ in range(config.sft.batch_size)))
        tokens, prompt_valid, mask = encode_examples(generate.tokenizer, [generate.render(p) for p in prompts],
                                                     solutions, generate.prompt_length,
                                                     templated=generate.chat_template)
        batch = shard_batch({"tokens": tokens, "prompt_valid": prompt_valid, "completion_mask": mask},
                            generate.mesh)
        state, metrics = step_fn(state, batch)
        if step % 25 == 0 or step in (1, config.sft.steps):
            metrics = jax.device_get(metrics)
            writer.write({"phase": "sft", "step": step, **metrics})
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")
    return state
