"""The run, as a table of contents: prepare (everything that can refuse the config) -> take over the output
directory -> warm start -> held-out evaluation -> RL -> held-out evaluation -> HF export -> summary."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from typing import Any

import jax

from jaxrl import configlib, models, registry
from jaxrl.checkpoint import Checkpointer
from jaxrl.config import Config
from jaxrl.errors import RunConfigError
from jaxrl.envs.pool import EnvPool
from jaxrl.extras import check_extras
from jaxrl.loop import adapters, held_out, outputs, progress, resume, rl, setup
from jaxrl.loop.episodes import EpisodeGenerator
from jaxrl.loop.generate import Generator
from jaxrl.loop.warm_start import warm_start
from jaxrl.models import lora
from jaxrl.metrics import MetricsWriter, build_mirrors, plot_run, read_metrics
from jaxrl.rewards.scoring import RewardScorer
from jaxrl.samples import open_sample_log
from jaxrl.sharding import (allgather, data_shard, initialize_distributed, is_primary, layout_from,
                            wait_for_all_processes)

log = logging.getLogger("jaxrl")


@dataclasses.dataclass
class Prepared:
    """What `prepare` read and checked, before the output directory changes."""

    train_problems: list
    eval_problems: list
    data_totals: dict[str, int]
    mesh: jax.sharding.Mesh
    policy: models.Policy
    tokenizer: Any
    tokenizer_file: str | None
    generate: Generator
    critic_trunk: models.Policy | None
    resume_step: int | None = None  # with resume=true: the checkpoint the run goes on from
    resumed: tuple | None = None  # `resume.restore`'s result for it
    damaged: list[int] = dataclasses.field(default_factory=list)  # newer checkpoints that did not restore
    before: dict[str, Any] | None = None  # the resumed run's evaluation after its warm start
    quantized_start: dict[str, Any] = dataclasses.field(default_factory=dict)  # `adapters.quantized_start`'s
    checkpointer: Checkpointer | None = None  # opened to resume


def run(config: Config, config_source: str = "") -> dict[str, Any]:
    """Train the recipe end to end; writes everything under `config.output_dir`.

    Every piece the run uses is named in `config` (built-in or the user's own: `reward.function`,
    `reward.extra`, `rl.loss.objective`, `rl.loss.advantage.estimator`, ...; see `jaxrl.registry`), so the
    run's `config.yaml` reproduces it. With `rl.steps=0` the run saves the warm-started policy as checkpoint
    0, so that later runs can start from it with `pretrained.path=<output_dir> sft.steps=0` (the run's
    tokenizer comes with it).
    """
    config = checked(config)
    wall_start = time.perf_counter()
    initialize_distributed(config.distributed)  # a no-op unless this is one process of a multi-host job
    resume_step = resume.resume_point(config) if config.resume else None
    if resume_step is None:
        outputs.check_fresh_output_dir(config)
    t0 = time.perf_counter()
    ready = prepare(config, resume_step)
    metrics_path, checkpointer = take_output_dir(config, ready)
    times = {"data_time_s": time.perf_counter() - t0}
    if ready.resume_step is None:
        checkpointer = Checkpointer(os.path.join(config.output_dir, "checkpoints"), keep=config.checkpoint.keep)
    with contextlib.ExitStack() as finally_close:
        finally_close.callback(checkpointer.close)  # on an error too: an async save in flight is finished
        resources = open_resources(config, ready, metrics_path, checkpointer, finally_close)
        if resources.env_pool is not None:  # multi-turn: episodes with the environment's workers
            ready = dataclasses.replace(ready, generate=EpisodeGenerator(ready.generate, resources.env_pool,
                                                                         config.env))
        policy, before = warm_start_and_evaluate(config, ready, resources, times)
        if config.rl.lora.enabled and ready.resume_step is None:  # (a resumed run's policy is adapted already)
            base, policy = policy, adapters.start(config, policy, setup.hf_files(config.pretrained.path)
                                                  if config.pretrained.path else None)
            if config.rl.lora.quantize:
                ready.quantized_start = adapters.quantized_start(config, base, policy, ready.generate,
                                                                 ready.eval_problems, resources.evaluator)
                resources.writer.write({"phase": adapters.QUANTIZED_PHASE, "step": 0, **ready.quantized_start})
            del base  # (its projections' unquantized weights, with a quantized base)
        t0 = time.perf_counter()
        state, _, totals = rl.train(policy, config, (ready.train_problems, ready.eval_problems), ready.generate,
                                    resources, ready.resume_step, ready.resumed, ready.critic_trunk)
        times["rl_time_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        after = held_out.final_evaluation(state.policy, ready.generate, ready.eval_problems, resources.evaluator,
                                          config)
        times["eval_after_time_s"] = time.perf_counter() - t0
        resources.writer.write({"phase": "rl", "step": config.rl.steps, "final": True, **after})
    export_hf(config, state.policy)
    times["total_wall_time_s"] = time.perf_counter() - wall_start
    summary = make_summary(config, config_source, ready, state.policy, (before, after), resources.evaluator,
                           {**times, **totals})
    if is_primary():
        write_summary(config, summary)
    return summary


def checked(config: Config) -> Config:
    """`config` with `~` expanded in `output_dir` and the run's own pieces recorded (`piece_sources`), after
    checking that the optional extras it uses are installed and its tokenizer settings fit a training run."""
    check_extras(config)
    setup.check_tokenizer_settings(config)
    return dataclasses.replace(config, output_dir=os.path.expanduser(config.output_dir),  # "~/runs/x"
                               piece_sources=registry.record(config.pieces()))


def open_resources(config: Config, ready: Prepared, metrics_path: str, checkpointer: Checkpointer,
                   finally_close: contextlib.ExitStack) -> rl.RunResources:
    """The run's writers (metrics.jsonl and its mirrors, samples.jsonl), reward scorer and evaluation reward,
    closed by `finally_close`."""
    mirrors = build_mirrors(config, config.output_dir) if is_primary() else ()
    writer = finally_close.enter_context(MetricsWriter(
        metrics_path, os.path.join(os.path.dirname(metrics_path), "timings.jsonl"), mirrors))
    samples = finally_close.enter_context(open_sample_log(config, config.output_dir, ready.resume_step,
                                                          is_primary()))
    scorer = finally_close.enter_context(RewardScorer.from_config(config))
    pool = held_out.evaluation_pool(config, scorer)
    if pool is not scorer.pools["correct"]:
        finally_close.enter_context(pool)
    env_pool = None
    if config.env.multi_turn:
        env_pool = finally_close.enter_context(EnvPool(config.env, startup_timeout_s=config.reward.startup_timeout_s))
    return rl.RunResources(writer, scorer, held_out.Evaluator.of(config, pool), samples, checkpointer, env_pool)


def prepare(config: Config, resume_step: int | None) -> Prepared:
    """Everything that can refuse the config, before the output dir changes: data, mesh and batch sizes,
    policy, tokenizer, prompt rendering, the critic and, to resume, the checkpoint itself."""
    train_problems, eval_problems, corpus, data_totals = setup.load_task(config)
    layout = layout_from(config.mesh)
    mesh = layout.mesh
    setup.check_batch_sizes(config, dict(mesh.shape), data_shard(mesh)[1])
    if config.rl.staleness and jax.process_count() > 1:
        field = "rl.max_staleness" if config.rl.max_staleness else "rl.overlap"
        raise RunConfigError(f"{field} runs the sampling of later steps in a background thread, which is "
                             f"single-process for now; this run has {jax.process_count()} processes: set "
                             f"{field}={'0' if config.rl.max_staleness else 'false'}")
    policy, tokenizer, tokenizer_file = setup.policy_and_tokenizer(config, corpus, layout)
    if tokenizer.vocab_size > policy.config.vocab_size:
        raise RunConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                             f"{policy.config.vocab_size} embeddings")
    generate = setup.make_generator(train_problems + eval_problems, tokenizer, mesh, config)
    ready = Prepared(train_problems, eval_problems, data_totals, mesh, policy, tokenizer, tokenizer_file, generate,
                     setup.critic_trunk(config, policy))
    if resume_step is not None:  # the warm-started policy, its evaluation and the RL state come from the run
        restore_run(config, ready)
    return ready


def restore_run(config: Config, ready: Prepared) -> None:
    """Open the run's checkpoints and restore the newest intact one into `ready` (with the evaluation its
    warm start recorded); the checkpointer is closed again if that fails."""
    checkpointer = Checkpointer(os.path.join(config.output_dir, "checkpoints"), keep=config.checkpoint.keep)
    if config.rl.lora.enabled:  # the adapters the checkpoint restores, on the base they were trained on
        ready.policy = adapters.adapt(config, adapters.resume_base(config, ready.policy))
    state, controls = setup.rl_start(config, ready.policy, ready.critic_trunk)
    keep_ref = config.rl.loss.needs_ref_logp or config.rl.loss.needs_full_kl
    try:
        ready.resume_step, ready.resumed, ready.damaged = resume.restore_newest_intact(
            checkpointer, state, controls, state.policy if keep_ref else None)
        ready.before = resume.recorded_evaluation(os.path.join(config.output_dir, "metrics.jsonl"))
        ready.quantized_start = adapters.recorded_quantized_start(os.path.join(config.output_dir, "metrics.jsonl"))
    except BaseException:
        checkpointer.close()
        raise
    ready.checkpointer = checkpointer


def take_output_dir(config: Config, ready: Prepared) -> tuple[str, Checkpointer | None]:
    """Create or take over `output_dir`: damaged checkpoints set aside, this process's records emptied (fresh)
    or cut back to the resumed step, and (primary process) the run's files written. Returns this process's
    metrics path and the resumed run's checkpointer (None for a fresh run)."""
    out, checkpointer = config.output_dir, ready.checkpointer
    os.makedirs(out, exist_ok=True)
    if ready.resume_step is not None and ready.damaged:  # out of the manager's sight, or it would not save below them
        checkpointer.close()
        if is_primary():
            resume.set_aside(checkpointer.directory, ready.damaged, os.path.join(out, "damaged_checkpoints"))
        wait_for_all_processes("jaxrl: damaged checkpoints set aside")
        checkpointer = Checkpointer(os.path.join(out, "checkpoints"), keep=config.checkpoint.keep,
                                    intact=[ready.resume_step])
    metrics_path = outputs.metrics_path(out)  # each process keeps its own records: process_<i>/ for i > 0
    if ready.resume_step is None:
        outputs.remove_records(metrics_path)
    else:
        resume.truncate_metrics(metrics_path, ready.resume_step)
    if is_primary():
        outputs.write_run_files(config, ready.policy, ready.tokenizer, ready.tokenizer_file,
                                fresh=ready.resume_step is None)
    return metrics_path, checkpointer


def warm_start_and_evaluate(config: Config, ready: Prepared, resources: rl.RunResources, times: dict
                            ) -> tuple[models.Policy | None, dict[str, Any]]:
    """The policy RL starts from and its held-out evaluation (recorded as RL step 0): warm-started and
    evaluated now, or for a resumed run the evaluation it recorded (its policy comes from the checkpoint)."""
    if ready.resume_step is not None:
        log.info("resuming %s after RL step %d", config.output_dir, ready.resume_step)
        return ready.policy, ready.before
    t0 = time.perf_counter()
    # only the policy is kept: the warm start's optimizer state would otherwise live through RL
    policy = warm_start(ready.policy, config, ready.generate, ready.train_problems, resources.writer).policy
    times["sft_time_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    evaluator = resources.evaluator
    before = held_out.evaluate(policy, ready.generate, ready.eval_problems, evaluator,
                               batch_size=config.eval.batch_size, max_new_tokens=config.rl.sampling.max_new_tokens)
    times["eval_before_time_s"] = time.perf_counter() - t0
    resources.writer.write({"phase": "rl", "step": 0, **before})
    when = "after the warm start" if config.sft.steps else "before RL"
    log.info("held-out greedy %s %s: %.3f (reward %s)", evaluator.metric, when, before[evaluator.key], evaluator.reward)
    return policy, before


def export_hf(config: Config, policy: models.Policy) -> None:
    """With `pretrained.export_hf`, the trained policy as an HF directory `<output_dir>/hf` (with the
    pretrained checkpoint's tokenizer and config files); with LoRA, merged into its base, and the adapters alone
    as a PEFT directory `<output_dir>/adapter` (`adapters.export`)."""
    if config.pretrained.path is None or not config.pretrained.export_hf:
        return
    if lora.is_adapted(policy):
        adapters.export(config, policy, progress.bars(config.progress))
        return
    exported = policy.replace(params=allgather(policy.params), layout=None)  # whole on each process
    if is_primary():
        models.save_pretrained(exported, os.path.join(config.output_dir, "hf"),
                               base=setup.hf_files(config.pretrained.path), progress=progress.bars(config.progress))


def make_summary(config: Config, config_source: str, ready: Prepared, policy: models.Policy,
                 evaluations: tuple[dict, dict], evaluator: held_out.Evaluator, totals: dict) -> dict[str, Any]:
    """`summary.json`: the held-out metric (accuracy, or mean reward for a non-binary evaluation reward) before
    and after RL, times and totals, the run's devices, its own pieces and its config."""
    before, after = evaluations
    metric, key = evaluator.metric, evaluator.key
    return {
        f"{metric}_before_rl": before[key],
        f"{metric}_after_rl": after[key],
        f"{metric}_gain": after[key] - before[key],
        "eval_reward": evaluator.reward,
        "num_eval_problems": len(ready.eval_problems),
        "completion_length_before_rl": before["eval/completion_length"],
        "completion_length_after_rl": after["eval/completion_length"],
        **{k.removeprefix("eval/") + "_after_rl": v for k, v in after.items()
           if k.startswith(("eval/pass@", "eval/maj@"))},
        **adapters.summary_fields(ready.quantized_start, evaluator),
        **totals,
        **ready.data_totals,
        "num_parameters": models.num_parameters(policy.config),
        "devices": [str(d) for d in jax.devices()],
        "processes": jax.process_count(),
        "mesh": dict(ready.mesh.shape),
        "seed": config.seed,
        "config_source": config_source,
        "piece_sources": [list(piece) for piece in config.piece_sources],
        "config": configlib.to_dict(config),
    }


def write_summary(config: Config, summary: dict[str, Any]) -> None:
    """`summary.json` and the reward/accuracy plot of `metrics.jsonl`."""
    out = config.output_dir
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot_run(read_metrics(os.path.join(out, "metrics.jsonl")), os.path.join(out, "reward_accuracy.png"),
             title=f"RL ({config.rl.loss.preset or 'custom'} loss) on "
                   f"{os.path.basename(config.data.train_file or '') or 'arithmetic chains'} "
                   f"(seed {config.seed})")
