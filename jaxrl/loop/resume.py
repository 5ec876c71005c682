"""Resuming a run: which checkpoint to start from (the newest that restores; damaged newer ones are set
aside), what it holds (`checkpoint_state`), and the records that the resumed steps write again."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax

from jaxrl import configlib, registry
from jaxrl.checkpoint import Checkpointer
from jaxrl.config import Config
from jaxrl.losses import Controls
from jaxrl.metrics import read_metrics
from jaxrl.models.hf import CheckpointError
from jaxrl.sharding import replicate
from jaxrl.train import TrainState

log = logging.getLogger("jaxrl")


def resume_point(config: Config) -> int:
    """The RL step of the newest checkpoint of the run in `config.output_dir`, after checking that the run
    exists and that its model, critic and data stream are the ones `config` describes. Raises
    `CheckpointError`."""
    out = config.output_dir
    directory = os.path.join(out, "checkpoints")
    step = Checkpointer.newest(directory)
    if step is None:
        raise CheckpointError(f"resume=true, but {directory} holds no checkpoint: no earlier run to resume in "
                              f"output_dir {out} (run without resume=true to start one)")
    if step > config.rl.steps:  # nothing to run, and the final record would describe later parameters
        raise CheckpointError(f"resume=true: the run in {out} is already past rl.steps={config.rl.steps} (its "
                              f"newest checkpoint is after RL step {step}): set rl.steps to {step} or more")
    saved_path = os.path.join(out, "config.yaml")
    try:
        saved = configlib.load_config(Config, saved_path)
    except (OSError, configlib.ConfigError) as e:
        raise CheckpointError(f"resume=true: cannot read the resumed run's config {saved_path}: {e}") from None
    mismatches = config_mismatches(config, saved)
    if mismatches:
        raise CheckpointError(f"resume=true: the run in {out} does not match the config: " + "; ".join(mismatches))
    changed = registry.changed(saved.piece_sources, config.piece_sources)
    if changed and not config.resume_changed_pieces:
        raise CheckpointError(f"resume=true: the run in {out} used other pieces of its own than the config names "
                              f"now ({saved_path}: piece_sources): " + "; ".join(changed) +
                              "; resume_changed_pieces=true resumes with them anyway")
    return step


def config_mismatches(config: Config, saved: Config) -> list[str]:
    """What `config` changes that a checkpoint of a run made with `saved` cannot follow: the model, what the
    saved data position means (task, prompt files, prompts per step) and what the checkpoint holds."""
    now, then = configlib.to_dict(config), configlib.to_dict(saved)
    mismatches = [f"{section}.{key}: checkpoint {then[section].get(key)!r}, config {value!r}"
                  for section in ("model", "pretrained", "task", "data") for key, value in now[section].items()
                  if key not in ("attention_impl", "remat", "export_hf") and then[section].get(key) != value]
    for key in ("seed", "rl.critic.model", "rl.loss.preset", "rl.prompts_per_step"):
        a, b = now, then
        for part in key.split("."):
            a, b = a[part], b[part]
        if a != b:
            mismatches.append(f"{key}: checkpoint {b!r}, config {a!r}")
    # What else the checkpoint holds: a reference policy, the adaptive entropy coefficient's state.
    for what, held in (("a reference policy (rl.loss.kl_coef > 0, kl_target ref)", lambda c: c.rl.loss.needs_ref_logp),
                       ("an adaptive entropy state (rl.loss.entropy_target)",
                        lambda c: c.rl.loss.entropy_target is not None)):
        if held(config) != held(saved):
            mismatches.append(f"the checkpoint {'holds' if held(saved) else 'lacks'} {what}, which the config "
                              f"{'needs' if held(config) else 'does not use'}")
    return mismatches


def restore(checkpointer: Checkpointer, step: int, state: TrainState, controls: Controls, ref_policy):
    """The RL state, controls, reference policy and metadata saved at `step`, laid out like `state`."""
    like = checkpoint_state(state, controls, ref_policy)
    try:
        saved, metadata = checkpointer.restore(step, like)
    except Exception as e:  # orbax raises many types for missing or damaged files
        raise CheckpointError(f"resume=true: cannot restore checkpoint {step} in {checkpointer.directory}: "
                              f"{type(e).__name__}: {e}") from None
    state = state.replace(policy=state.policy.replace(params=saved["params"]), opt_state=saved["opt_state"],
                          step=saved["step"])
    if state.critic is not None:
        state = state.replace(critic=state.critic.replace(params=saved["critic_params"]),
                              critic_opt_state=saved["critic_opt_state"])
    controls = controls.replace(**saved["controls"])
    if ref_policy is not None:
        ref_policy = ref_policy.replace(params=saved["ref_params"])
    return state, controls, ref_policy, metadata


def restore_newest_intact(checkpointer: Checkpointer, state: TrainState, controls: Controls, ref_policy
                          ) -> tuple[int, tuple, list[int]]:
    """`(step, restore's result, damaged)`: the newest checkpoint that restores, after the newer ones that do
    not (`damaged`, each named in a warning). Raises `CheckpointError` with every checkpoint's error when none
    restores."""
    failures: list[tuple[int, CheckpointError]] = []
    for step in reversed(checkpointer.steps()):
        try:
            resumed = restore(checkpointer, step, state, controls, ref_policy)
        except CheckpointError as e:
            failures.append((step, e))
            continue
        for damaged, error in failures:
            log.warning("%s; resuming from the older checkpoint %d instead (the RL steps after it run again)",
                        error, step)
        return step, resumed, [damaged for damaged, _ in failures]
    if not failures:
        raise CheckpointError(f"resume=true, but {checkpointer.directory} holds no checkpoint")
    raise CheckpointError("; ".join(str(e) for _, e in failures))


def set_aside(directory: str, steps: list[int], destination: str) -> None:
    """Move the checkpoints of `steps` from `directory` to `destination/<step>` (`<step>.1`, ... when taken),
    where they stay for inspection."""
    os.makedirs(destination, exist_ok=True)
    for step in steps:
        target, n = os.path.join(destination, str(step)), 0
        while os.path.exists(target):
            n += 1
            target = os.path.join(destination, f"{step}.{n}")
        os.replace(os.path.join(directory, str(step)), target)
        log.warning("moved the damaged checkpoint %d to %s", step, target)


def truncate_metrics(path: str, step: int) -> None:
    """Keep the records (and timings) up to RL step `step`: those written after the checkpoint are written
    again by the resumed run."""
    for file in (path, os.path.join(os.path.dirname(path), "timings.jsonl")):
        if not os.path.exists(file):
            continue
        kept = [r for r in read_metrics(file, torn_tail_ok=True)  # a crash may have cut the last write short
                if r.get("phase") != "rl" or (r["step"] <= step and not r.get("final"))]
        tmp = file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, file)


def recorded_evaluation(path: str) -> dict[str, Any]:
    """The held-out evaluation after the warm start, as the resumed run recorded it (step 0)."""
    for record in read_metrics(path, torn_tail_ok=True):  # read before truncate_metrics: a kill may cut the tail
        held_out = "eval/accuracy" in record or "eval/reward" in record
        if record.get("phase") == "rl" and record.get("step") == 0 and held_out:
            return {k: v for k, v in record.items() if k.startswith("eval/")}
    raise CheckpointError(f"resume=true: {path} has no evaluation after the warm start (RL step 0)")


def checkpoint_state(state: TrainState, controls: Controls, ref_policy=None) -> dict[str, Any]:
    """The arrays a checkpoint holds: parameters, optimizer state, step, controls, the critic's, and the
    frozen reference policy's parameters of KL terms (`ref_policy`, when kept)."""
    controls = {"entropy_coef": controls.entropy_coef, "temperature": controls.temperature,
                **({} if controls.entropy_below_target is None
                   else {"entropy_below_target": controls.entropy_below_target})}
    if state.policy.layout is not None:  # host values: on the mesh, so that every process saves them alike
        controls = replicate(jax.device_get(controls), state.policy.layout.mesh)
    saved = {"params": state.policy.params, "opt_state": state.opt_state, "step": state.step,
             "controls": controls}
    if state.critic is not None:
        saved.update(critic_params=state.critic.params, critic_opt_state=state.critic_opt_state)
    if ref_policy is not None:  # the frozen reference of KL terms: the warm-started policy
        saved["ref_params"] = ref_policy.params
    return saved
