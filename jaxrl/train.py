"""Pure, jitted training steps: supervised warm start and the GRPO update.

`TrainState` is an explicit pytree; each step is `state, batch -> state, metrics`, built by a `make_*`
function that closes over the static pieces (optimizer, loss settings) as PureJaxRL does.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

import models
from jaxrl import losses
from kernels import token_logprobs
from models import Policy

Batch = dict[str, jax.Array]
StepFn = Callable[["TrainState", Batch], tuple["TrainState", dict[str, jax.Array]]]


@struct.dataclass
class TrainState:
    policy: Policy
    opt_state: optax.OptState
    step: jax.Array  # optimizer steps taken


def make_optimizer(learning_rate: float, warmup_steps: int = 0, weight_decay: float = 0.0, b1: float = 0.9,
                   b2: float = 0.99, max_grad_norm: float = 1.0) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with a linear warmup to a constant learning rate."""
    schedule = optax.linear_schedule(0.0, learning_rate, warmup_steps) if warmup_steps else learning_rate
    return optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay),
    )


def init_train_state(policy: Policy, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(policy=policy, opt_state=optimizer.init(policy.params), step=jnp.zeros((), jnp.int32))


def completion_logprobs(
    policy: Policy, tokens: jax.Array, prompt_valid: jax.Array, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies of the completion tokens of a sampler-layout batch.

    Args:
      tokens: `[B, Lp + N]` left-padded prompt followed by the completion.
      prompt_valid: `[B, Lp]` bool.

    Returns:
      `(logp [B, N], entropy [B, N])` float32: position j scores `tokens[:, Lp + j]` given what precedes it.
    """
    prompt_len = prompt_valid.shape[1]
    inputs = tokens[:, :-1]
    valid = jnp.concatenate([prompt_valid, jnp.ones((tokens.shape[0], inputs.shape[1] - prompt_len), bool)], 1)
    hidden, _ = models.apply(policy, inputs, models.positions_from_mask(valid), valid)
    return token_logprobs(hidden[:, prompt_len - 1:], models.unembedding(policy), tokens[:, prompt_len:],
                          temperature)


def _apply_gradients(state, optimizer, grads) -> TrainState:
    updates, opt_state = optimizer.update(grads, state.opt_state, state.policy.params)
    params = optax.apply_updates(state.policy.params, updates)
    return TrainState(policy=state.policy.replace(params=params), opt_state=opt_state, step=state.step + 1)


def make_sft_step(optimizer: optax.GradientTransformation) -> StepFn:
    """Cross-entropy on completion tokens. Batch: `tokens`, `prompt_valid`, `completion_mask`."""

    def loss_fn(params, policy, batch):
        logp, _ = completion_logprobs(policy.replace(params=params), batch["tokens"], batch["prompt_valid"])
        mask = batch["completion_mask"].astype(jnp.float32)
        return -losses.token_mean(logp, mask, mask.sum())

    @jax.jit
    def sft_step(state: TrainState, batch: Batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.policy.params, state.policy, batch)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return _apply_gradients(state, optimizer, grads), metrics

    return sft_step


def make_grpo_step(
    optimizer: optax.GradientTransformation, loss_config: losses.GRPOLossConfig, temperature: float = 1.0
) -> StepFn:
    """One GRPO optimizer step on a (mini-)batch.

    Batch: `tokens [B, Lp+N]`, `prompt_valid [B, Lp]`, `completion_mask [B, N]`, `advantages [B]`,
    `old_logp [B, N]`, and `ref_logp [B, N]` when `loss_config.kl_coef > 0`.
    """

    def loss_fn(params, policy, batch):
        logp, entropy = completion_logprobs(policy.replace(params=params), batch["tokens"],
                                            batch["prompt_valid"], temperature)
        mask = batch["completion_mask"].astype(jnp.float32)
        advantages = jnp.broadcast_to(batch["advantages"][:, None], mask.shape)
        return losses.grpo_loss(logp, batch["old_logp"], advantages, mask, entropy, mask.sum(), loss_config,
                                ref_logp=batch.get("ref_logp"))

    @jax.jit
    def grpo_step(state: TrainState, batch: Batch):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.policy.params, state.policy, batch)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return _apply_gradients(state, optimizer, grads), metrics

    return grpo_step
