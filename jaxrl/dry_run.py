"""`jaxrl train CONFIG --print-config` and `jaxrl train CONFIG --dry-run`: look at a run before starting it.

`describe_config(config)`: every key with its type, bounds, default and value (`configlib.describe`), and for
the fields that name registry pieces the registered choices.

`dry_run(config)`: checks what a run would refuse, without loading weights or writing anything: the optional
extras, the output directory, the data files, the batch sizes against the mesh, the tokenizer and the prompt
template (the first rendered prompt exactly as the model sees it, chat template included), the rewards (the
first train row's reference scored as a completion through a one-worker pool) and the loss. Without
`pretrained.path` the run's sentencepiece tokenizer is trained on the task's text, as the run would (a few
seconds). It returns the report's lines and whether every check passed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from jaxrl import configlib, registry

__all__ = ["describe_config", "registry_choices", "dry_run", "report", "Check"]


def registry_choices(config) -> dict[str, str]:
    """Dotted field -> `one of <registered names>, or module:function`, for every field that names a piece (the
    self-rewards, `reward.extra` only, are not offered for the verifiable reward fields)."""
    return {field: f"one of {', '.join(_choices(field, entry.kind))}, or module:function"
            for field, entry in config.pieces().items()}


def _choices(field: str, kind: str) -> list[str]:
    names = registry.names(kind)
    if field in ("reward.function", "eval.reward"):
        names = [n for n in names if not registry.resolve(kind, n, field).info.get("self_reward")]
    return names


def describe_config(config) -> str:
    """The resolved config as YAML-like lines: each key's value, type, bounds and default, values that differ
    from the default marked `(changed)`, and the choices of fields that name registry pieces."""
    return configlib.describe(config, registry_choices(config))


@dataclasses.dataclass
class Check:
    """One line of the dry run's report: `ok` (or failed), what was checked and what it found."""

    name: str
    ok: bool
    detail: str
    lines: tuple[str, ...] = ()  # shown below the line (e.g. the rendered prompt)


def _check(name: str, checks: list[Check], step: Callable[[], tuple[str, tuple[str, ...]] | str]) -> bool:
    """Run `step`; record its result (a detail, or a detail and extra lines) or its error as a failed check."""
    try:
        result = step()
    except Exception as e:  # noqa: BLE001 - every refusal of a check is a failed line of the report
        checks.append(Check(name, False, f"{type(e).__name__}: {e}" if not str(e) else str(e)))
        return False
    detail, lines = (result, ()) if isinstance(result, str) else result
    checks.append(Check(name, True, detail, tuple(lines)))
    return True


def dry_run(config) -> tuple[list[Check], bool]:
    """`(checks, all passed)`: the checks of a run of `config` that need no model weights (see the module
    docstring). Writes nothing."""
    from jaxrl.loop import outputs, setup
    from jaxrl.loop.resume import resume_point

    load_task, check_batch_sizes = setup.load_task, setup.check_batch_sizes
    check_fresh_output_dir = outputs.check_fresh_output_dir
    checkpoint_tokenizer, generator = setup.load_checkpoint_tokenizer, setup.make_generator
    from jaxrl import losses
    from jaxrl.extras import check_extras
    from jaxrl.metrics import enabled_writers
    from jaxrl.loop.rollout import row_of
    from jaxrl.rewards.scoring import RewardScorer
    from jaxrl.sharding import data_shard, layout_from
    from jaxrl.tokenizer import train_tokenizer

    config = dataclasses.replace(config, output_dir=os.path.expanduser(config.output_dir))
    checks: list[Check] = []
    state: dict[str, Any] = {}

    _check("extras", checks, lambda: (check_extras(config), "installed: " + (
        ", ".join(name for _, name in enabled_writers(config)) or "none needed"))[1])
    _check("output_dir", checks, lambda: _output_dir(config, check_fresh_output_dir, resume_point))

    def data():
        state["train"], state["eval"], state["corpus"], counts = load_task(config)
        if config.data.train_file is None:
            return f"built-in arithmetic task: {len(state['train'])} train, {len(state['eval'])} held-out problems"
        return (f"{config.data.train_file}: {counts['data_train_rows']} rows ({counts['data_train_bad_rows_skipped']}"
                f" bad skipped); {config.data.eval_file}: {counts['data_eval_rows']} rows "
                f"({counts['data_eval_bad_rows_skipped']} bad skipped)")

    has_data = _check("data", checks, data)

    def batches():
        mesh = layout_from(config.mesh).mesh
        state["mesh"] = mesh
        check_batch_sizes(config, dict(mesh.shape), data_shard(mesh)[1])
        return (f"mesh {dict(mesh.shape)}: {config.rl.prompts_per_step} prompts x {config.rl.group_size} "
                f"samples per step, eval batch {config.eval.batch_size}")

    has_mesh = _check("batch sizes", checks, batches)

    def template():
        setup.check_tokenizer_settings(config)
        if config.pretrained.path is None:
            tokenizer, where = train_tokenizer(state["corpus"], config.tokenizer.vocab_size,
                                               stop_tokens=config.tokenizer.stop_tokens), "trained on the task"
        else:
            tokenizer, where = checkpoint_tokenizer(config.pretrained.path, config, "pretrained.path")
        generate = generator(state["train"] + state["eval"], tokenizer, state["mesh"], config)
        first = generate.render(state["train"][0])
        return (f"tokenizer {where} ({tokenizer.vocab_size} tokens); prompts padded to "
                f"{list(generate.prompt_lengths)} tokens; the first prompt as the model sees it:",
                tuple("    | " + line for line in first.split("\n")))

    if has_data and has_mesh:
        _check("template", checks, template)

    def reward():
        first = state["train"][0]
        config_one = dataclasses.replace(config, reward=dataclasses.replace(config.reward, num_workers=1))
        with RewardScorer.from_config(config_one) as scorer:
            scored = scorer.score([str(first.reference)], [first.reference], prompts=[first.prompt],
                                  rows=[row_of(first)])
        failed = [f"{name}: an item {r.first_failure}" for name, r in scored.results.items() if r.first_failure]
        if failed:
            raise ValueError("rewards failed on the first train row's reference: " + "; ".join(failed))
        values = ", ".join(f"{config.reward.function if name == 'correct' else name} = {float(v[0]):g}"
                           for name, v in scored.components.items())
        zero = float(scored.rewards[0]) == 0
        return (f"the first train row's reference, scored as a completion: {values}" +
                (" (a reward that wants a format, such as '#### 7', scores the bare reference 0)" if zero else ""))

    if has_data:
        _check("reward", checks, reward)

    def environment():
        from jaxrl.envs.pool import EnvPool, ResetFailed

        env = config.env
        with EnvPool(dataclasses.replace(env, num_workers=1),
                     startup_timeout_s=config.reward.startup_timeout_s) as pool:
            (episode_state, first), = pool.reset([row_of(state["train"][0])])
            stops = pool.stop_strings
        if isinstance(episode_state, ResetFailed):
            raise ValueError(f"the environment's reset of the first train row failed: {episode_state.error}")
        return (f"{env.name} ({', '.join(env.tools) or 'no tools'}; {env.tool_format} calls): turns end at "
                f"{', '.join(map(repr, stops)) or 'EOS only'}; at most {env.max_turns} turns, {env.max_tokens} "
                f"episode tokens, {env.turn_tokens} per turn; first observation of the first train row: {first!r}")

    if has_data and config.env.multi_turn:
        _check("environment", checks, environment)

    def loss():
        losses.build_loss(config.rl.loss, with_critic=config.rl.critic.model != "none")
        pieces = {f: e.name for f, e in config.pieces().items() if f != "reward.function"}
        return ", ".join(f"{field.removeprefix('rl.loss.')}={name}" for field, name in pieces.items())

    _check("loss", checks, loss)

    def adapters():
        from jaxrl import models
        from jaxrl.models import lora
        model = models.load_config(config.pretrained.path) if config.pretrained.path else config.model
        try:
            paths = lora.target_paths(model, tuple(config.rl.lora.targets))
        except ValueError as e:
            raise ValueError(f"rl.lora.targets: {e}") from None
        names = sorted({p.rsplit("/", 1)[-1] for p in paths}, key=lora.PROJECTIONS.index)
        return (f"rank {config.rl.lora.rank} on {len(paths)} projections ({', '.join(names)})"
                + (f", base in {config.rl.lora.quantize}" if config.rl.lora.quantize else ""))

    if config.rl.lora.enabled:
        _check("lora", checks, adapters)
    return checks, all(c.ok for c in checks)


def _output_dir(config, check_fresh_output_dir, resume_point) -> str:
    out = config.output_dir
    if config.resume:
        step = resume_point(config)
        what = f"resumes the run in {out} after RL step {step}"
    else:
        check_fresh_output_dir(config)
        what = f"a fresh run in {out}" + (" (replacing the run there: overwrite=true)" if config.overwrite else "")
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"output_dir {out}: {existing} is not a writable directory")
    return what + ("" if existing == os.path.abspath(out) else f" (created in {existing})")


def report(checks: list[Check]) -> str:
    """The dry run's report: one line per check (`ok` or `FAILED`), extra lines below."""
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{'ok    ' if c.ok else 'FAILED'} {c.name:<{width}}  {c.detail}")
        lines.extend(c.lines)
    passed = sum(c.ok for c in checks)
    lines.append(f"{passed}/{len(checks)} checks passed" + ("" if passed == len(checks) else
                                                            "; the run would stop at the first failed one"))
    return "\n".join(lines) + "\n"
