"""Pure, jitted training steps: supervised warm start and the RL update of any loss composition.

`TrainState` is an explicit pytree; each step is `state, batch, ... -> state, metrics`, built by a `make_*`
function that closes over the static pieces (optimizer, loss terms) as PureJaxRL does.

The RL step takes one optimiser mini-batch and, with `micro_batches > 1`, accumulates gradients over
micro-batches in a `lax.scan`. Every loss term normalises by counts of the whole mini-batch
(`losses.Normalizers`), so the accumulated loss and gradient equal those of the unsplit mini-batch.

A mini-batch with a `plan` (`jaxrl.packing`) runs the models on packed rows instead, one token-budget micro-batch
after another; `packed_completion_logprobs` and `packed_critic_values` are the packed log-prob and value passes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxrl import models
from jaxrl import losses
from jaxrl import packing
from jaxrl.losses import Controls, LossInputs, Term
from jaxrl.kernels import token_logprobs
from jaxrl.models import Policy

Batch = dict[str, jax.Array]
StepFn = Callable[["TrainState", Batch], tuple["TrainState", dict[str, jax.Array]]]


@struct.dataclass
class Critic:
    """A value model: a copy of the policy's trunk and a linear head `[hidden] -> scalar`.

    params: `{"trunk": <policy params>, "head": {"kernel": [hidden], "bias": []}}`.
    """

    graphdef: Any = struct.field(pytree_node=False)
    config: models.ModelConfig = struct.field(pytree_node=False)
    params: dict
    layout: models.Layout | None = struct.field(pytree_node=False, default=None)  # its trunk's

    @property
    def trunk(self) -> Policy:
        return Policy(self.graphdef, self.config, self.params["trunk"], self.layout)


@struct.dataclass
class TrainState:
    """The policy (and optional critic) with their optax states: everything an optimizer step changes.

    The optimizer states are `optax.OptState` pytrees (annotated `Any`: optax's alias holds a forward
    reference that documentation tools cannot resolve).
    """

    policy: Policy
    opt_state: Any
    step: jax.Array  # optimizer steps taken
    critic: Critic | None = None
    critic_opt_state: Any = None


def make_optimizer(learning_rate: float, warmup_steps: int = 0, weight_decay: float = 0.0, b1: float = 0.9,
                   b2: float = 0.99, max_grad_norm: float = 1.0) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with a linear warmup to a constant learning rate: update i (1-based)
    uses `learning_rate * min(1, i / warmup_steps)`, so the first update already moves the parameters and
    update `warmup_steps` is the first at the full rate. Weight decay applies to matrices and embeddings
    only (`decay_matrices`)."""
    def warmup(count: jax.Array) -> jax.Array:  # count: updates taken before this one
        return learning_rate * jnp.minimum(1.0, (count + 1) / warmup_steps)
    return optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.chain(optax.scale_by_adam(b1=b1, b2=b2), decay_matrices(weight_decay),  # optax.adamw's order
                    optax.scale_by_learning_rate(warmup if warmup_steps else learning_rate)),
    )


def decay_matrices(weight_decay: float) -> optax.GradientTransformation:
    """`optax.add_decayed_weights` for parameters of 2 or more dimensions: norm scales, biases and the value
    head's vector are not decayed (as nanoGPT and transformers' Trainer do). Stateless, so the optimizer
    state is `optax.adamw`'s and checkpoints saved with it restore (an `optax.masked` would add a level)."""
    def update(updates, state, params=None):
        if not weight_decay:  # nothing to add: skip a pass over every parameter
            return updates, state
        if params is None:
            raise ValueError("weight decay needs the parameters: call update(updates, state, params)")
        return jax.tree.map(lambda u, p: u + weight_decay * p if p.ndim >= 2 else u, updates, params), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def init_critic(policy: Policy) -> Critic:
    """A critic initialised from the policy: a copy of its trunk weights (the two train apart, and a donating
    step cannot take one buffer twice) and a zero value head."""
    head = {"kernel": jnp.zeros((policy.config.hidden_size,), jnp.float32), "bias": jnp.zeros((), jnp.float32)}
    if policy.layout is not None:
        head = jax.device_put(head, policy.layout.replicated())
    return Critic(policy.graphdef, policy.config, {"trunk": copy_arrays(policy.params), "head": head},
                  policy.layout)


def copy_policy(policy: Policy) -> Policy:
    """`policy` with its trainable parameters copied (`copy_arrays`), a frozen LoRA base (`Policy.frozen`) shared:
    the base is never donated (`make_rl_step`), and a copy of it would be a second model in memory."""
    return policy.replace(params=copy_arrays(policy.params))


def copy_arrays(tree: Any) -> Any:
    """`tree` with every array copied to new buffers of the same sharding: a pytree that must outlive a donating
    step (`donate=True`) while sharing arrays with the state it is given, such as a frozen reference policy."""
    return jax.tree.map(jnp.copy, tree)


def param_shardings(layout: models.Layout, params: Any) -> Any:
    """Shardings of policy params or of critic params `{"trunk": ..., "head": ...}` (head replicated), by the
    layout of their model (`Policy.layout`, `Critic.layout`)."""
    if isinstance(params, dict) and set(params) == {"trunk", "head"}:
        return {"trunk": layout.param_shardings(params["trunk"]),
                "head": jax.tree.map(lambda _: layout.replicated(), params["head"])}
    return layout.param_shardings(params)


def opt_state_shardings(layout: models.Layout, optimizer: optax.GradientTransformation, params: Any) -> Any:
    """Shardings of `optimizer`'s state for `params`: moments as their parameters, counters replicated."""
    abstract_state = jax.eval_shape(optimizer.init, params)
    return optax.tree_map_params(optimizer, lambda _, sharding: sharding, abstract_state,
                                 param_shardings(layout, params),
                                 transform_non_params=lambda _: layout.replicated())


def _init_opt_state(optimizer: optax.GradientTransformation, params: Any, layout: models.Layout | None):
    if layout is None:
        return optimizer.init(params)
    return jax.jit(optimizer.init, out_shardings=opt_state_shardings(layout, optimizer, params))(params)


def _constrain(layout: models.Layout | None, tree: Any, optimizer=None, params=None) -> Any:
    """`tree` (params or gradients; optimizer state when `optimizer` and `params` are given) held at its
    sharding inside a jitted step: FSDP's gradients reduce-scattered, not all-reduced; the state keeps the
    layout it came in with, so the next step reuses the compiled program."""
    if layout is None:
        return tree
    shardings = (param_shardings(layout, tree) if optimizer is None
                 else opt_state_shardings(layout, optimizer, params))
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def _constrain_trainable(state: TrainState, tree: dict) -> dict:
    """`{"policy": ..., "critic": ...}` (gradients, or their sums) each held at its own model's sharding."""
    layouts = {"policy": state.policy.layout, "critic": None if state.critic is None else state.critic.layout}
    return {name: _constrain(layouts[name], part) for name, part in tree.items()}


def init_train_state(policy: Policy, optimizer: optax.GradientTransformation, critic: Critic | None = None,
                     critic_optimizer: optax.GradientTransformation | None = None) -> TrainState:
    if (critic is None) != (critic_optimizer is None):
        raise ValueError("a critic needs its optimizer and an optimizer its critic")
    layout = policy.layout
    critic_opt_state = None if critic is None else _init_opt_state(critic_optimizer, critic.params, critic.layout)
    step = jnp.zeros((), jnp.int32) if layout is None else jax.device_put(jnp.zeros((), jnp.int32),
                                                                             layout.replicated())
    return TrainState(policy=policy, opt_state=_init_opt_state(optimizer, policy.params, layout), step=step,
                      critic=critic, critic_opt_state=critic_opt_state)


def _completion_hidden(policy: Policy, tokens: jax.Array, prompt_valid: jax.Array) -> jax.Array:
    """`[B, N, hidden]` final hidden states at the positions that predict the N completion tokens."""
    prompt_len = prompt_valid.shape[1]
    inputs = tokens[:, :-1]
    valid = jnp.concatenate([prompt_valid, jnp.ones((tokens.shape[0], inputs.shape[1] - prompt_len), bool)], 1)
    hidden, _ = models.apply(policy, inputs, models.positions_from_mask(valid), valid)
    return hidden[:, prompt_len - 1:]


def completion_logprobs(policy: Policy, tokens: jax.Array, prompt_valid: jax.Array,
                        temperature: float | jax.Array = 1.0) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies of the completion tokens of a sampler-layout batch.

    Args:
      tokens: `[B, Lp + N]` left-padded prompt followed by the completion.
      prompt_valid: `[B, Lp]` bool.
      temperature: scalar (may be traced): log-probs of the distribution sampled at this temperature.

    Returns:
      `(logp [B, N], entropy [B, N])` float32: position j scores `tokens[:, Lp + j]` given what precedes it.
    """
    hidden = _completion_hidden(policy, tokens, prompt_valid)
    return token_logprobs(hidden, models.unembedding(policy), tokens[:, prompt_valid.shape[1]:], temperature,
                          softcap=policy.config.final_logit_softcap)


def critic_values(critic: Critic, tokens: jax.Array, prompt_valid: jax.Array) -> jax.Array:
    """`[B, N]` float32 value of the state before each completion token."""
    return _value_head(critic, _completion_hidden(critic.trunk, tokens, prompt_valid))


def _packed_hidden(policy: Policy, tokens: jax.Array, rows: dict, plan: packing.PackPlan
                   ) -> tuple[jax.Array, jax.Array]:
    """`(hidden [r, S, hidden], targets [r, S])` of packed rows (`rows`: `plan`'s `gather`, `segments`,
    `positions`, each `[r, S]`): final hidden states, and at each position the token it predicts."""
    inputs, targets = packing.pack_rows(tokens, rows["gather"], plan.shards)
    hidden, _ = models.apply(policy, inputs, rows["positions"], rows["segments"], max_segments=plan.max_segments)
    return hidden, targets


def _plan_micro_batches(plan: packing.PackPlan) -> tuple[dict, jax.Array]:
    """`(rows, unpack)`: a plan's row arrays `[M, r, S]` and unpack indices `[M, B, N]`, by micro-batch."""
    m = plan.micro_batches
    rows = {name: packing.split_rows(getattr(plan, name), m) for name in ("gather", "segments", "positions")}
    return rows, plan.unpack


def _over_plan(fn: Callable, model, plan: packing.PackPlan) -> Any:
    """`fn(model, rows, unpack_index)` -> `[B, N]` arrays (0 where the index is -1) over a plan's micro-batches
    one after another (`lax.scan`: the activations of one micro-batch), summed: each completion token comes
    from exactly one micro-batch, so the sum is exact."""
    rows, index = _plan_micro_batches(plan)
    if plan.micro_batches == 1:
        return fn(model, jax.tree.map(lambda x: x[0], rows), index[0])

    def body(model, xs):  # the model carried, not closed over: NNX's lifted remat wants it traced here
        return model, fn(model, *xs)

    _, out = jax.lax.scan(body, model, (rows, index))
    return jax.tree.map(lambda x: x.sum(0), out)


def packed_completion_logprobs(policy: Policy, tokens: jax.Array, prompt_valid: jax.Array,
                               temperature: float | jax.Array = 1.0, *, plan: packing.PackPlan
                               ) -> tuple[jax.Array, jax.Array]:
    """`completion_logprobs` computed on the packed rows of `plan` (`jaxrl.packing.plan_packing` of this batch):
    the model and the LM head run on `[R, S]` packed positions instead of `[B, Lp + N]` padded ones.

    Returns `(logp [B, N], entropy [B, N])` float32, equal to `completion_logprobs` on every completion token the
    plan packed (up to each sequence's last real token) and 0 elsewhere. `prompt_valid` is not read (the plan
    holds the prompt lengths); it keeps the padded function's signature.
    """
    shards = plan.shards

    def micro(policy, rows, index):
        hidden, targets = _packed_hidden(policy, tokens, rows, plan)
        logp, entropy = token_logprobs(hidden, models.unembedding(policy), targets, temperature,
                                       softcap=policy.config.final_logit_softcap)
        return packing.unpack(logp, index, shards), packing.unpack(entropy, index, shards)

    return _over_plan(micro, policy, plan)


def _value_head(critic: Critic, hidden: jax.Array) -> jax.Array:
    return hidden.astype(jnp.float32) @ critic.params["head"]["kernel"] + critic.params["head"]["bias"]


def packed_critic_values(critic: Critic, tokens: jax.Array, prompt_valid: jax.Array, *,
                         plan: packing.PackPlan) -> jax.Array:
    """`critic_values` on the packed rows of `plan`: `[B, N]` float32, 0 where the plan packed no token."""
    shards = plan.shards

    def micro(critic, rows, index):
        hidden, _ = _packed_hidden(critic.trunk, tokens, rows, plan)
        return packing.unpack(_value_head(critic, hidden), index, shards)

    return _over_plan(micro, critic, plan)


def by_micro_batches(fn: Callable, micro_batches: int) -> Callable:
    """`fn(model, tokens [B, L], prompt_valid [B, Lp], *rest)`, whose outputs are `[B, ...]` per row, run on
    `micro_batches` groups of rows one after another (`lax.map`): its activations are those of `B /
    micro_batches` rows. Rows are grouped as the train step's micro-batches are (`_split_micro_batches`: each
    group spans every data-parallel shard); the result equals `fn` on the whole batch."""
    if micro_batches == 1:
        return fn

    def mapped(model, tokens, prompt_valid, *rest):
        split = _split_micro_batches({"tokens": tokens, "prompt_valid": prompt_valid}, micro_batches)

        def body(model, micro):  # the model carried, not closed over: NNX's lifted remat wants it traced here
            return model, fn(model, micro["tokens"], micro["prompt_valid"], *rest)

        _, out = jax.lax.scan(body, model, split)
        return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(tokens.shape[0], *x.shape[2:]), out)

    return mapped


def _log_softmax(policy: Policy, hidden: jax.Array, temperature) -> jax.Array:
    """`[..., vocab]` log-probs of the next token from final hidden states `[..., hidden]`."""
    return jax.nn.log_softmax(models.logits_from_hidden(policy, hidden) / temperature, axis=-1)


def _full_kl_to_reference(policy: Policy, ref_policy: Policy, tokens, prompt_valid, temperature) -> jax.Array:
    """`[B, N]` exact KL(pi || ref) over the vocabulary at each completion position (ref: no gradient)."""
    def log_probs(p):
        hidden = _completion_hidden(p, tokens, prompt_valid)
        logits = models.logits_from_hidden(p, hidden) / temperature
        return jax.nn.log_softmax(logits, axis=-1)
    return losses.kl_full(log_probs(policy), jax.lax.stop_gradient(log_probs(ref_policy)))


def _apply_gradients(state: TrainState, optimizer, grads, critic_optimizer=None) -> TrainState:
    layout, params = state.policy.layout, state.policy.params
    updates, opt_state = optimizer.update(grads["policy"], state.opt_state, params)
    new = state.replace(
        policy=state.policy.replace(params=_constrain(layout, optax.apply_updates(params, updates))),
        opt_state=_constrain(layout, opt_state, optimizer, params), step=state.step + 1)
    if state.critic is not None:
        params = state.critic.params
        updates, critic_opt = critic_optimizer.update(grads["critic"], state.critic_opt_state, params)
        layout = state.critic.layout  # its own model's: a separately loaded critic may have other head sizes
        critic = state.critic.replace(params=_constrain(layout, optax.apply_updates(params, updates)))
        new = new.replace(critic=critic, critic_opt_state=_constrain(layout, critic_opt, critic_optimizer, params))
    return new


def all_finite(tree: Any) -> jax.Array:
    """Scalar bool: no NaN or infinity in any floating-point array of `tree` (integer arrays are finite)."""
    checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


# A state of up to this many bytes (parameters and optimizer state) is updated in one pass, its old value kept
# beside the new one until the finite check: twice a small state for a moment costs nothing, and the step compiles
# the optimizer once. A larger one is updated in two passes, so that a donated state is still written in place.
ONE_PASS_MAX_STATE_BYTES = 1 << 28


def _state_bytes(state: TrainState) -> int:
    leaves = jax.tree.leaves((state.policy.params, state.opt_state,
                              None if state.critic is None else state.critic.params, state.critic_opt_state))
    return sum(x.size * np.dtype(x.dtype).itemsize for x in leaves
               if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))


def _apply_if_finite(state: TrainState, update: Callable[[], TrainState], finite: jax.Array
                     ) -> tuple[TrainState, jax.Array]:
    """`(update(), True)` when `finite` (the loss and gradients were) and every parameter and optimizer-state
    array of `update()` is finite, else `(state, False)`: an update that overflows (a huge learning rate,
    float16) is dropped whole, as optax's `apply_if_finite` drops non-finite gradients.

    Up to `ONE_PASS_MAX_STATE_BYTES`: one pass and a select. Above: two passes, each a `lax.cond` inside the
    jitted step (so it holds when the step donates `state`): the first computes the update only to reduce it to
    one bool, the second computes it again and writes it. A select would need the old and the new state alive
    at once, undoing the donation's saving (measured: +0.8x the state's bytes of temporaries); the second pass
    costs one more pass over the state, and the optimizer is compiled twice (+1 to 2 s for a tiny model)."""
    def is_finite(new: TrainState) -> jax.Array:
        return all_finite((new.policy.params, new.opt_state, None if new.critic is None else new.critic.params,
                           new.critic_opt_state))
    if _state_bytes(state) <= ONE_PASS_MAX_STATE_BYTES:
        new = update()
        ok = finite & is_finite(new)
        return jax.lax.cond(ok, lambda: new, lambda: state), ok
    ok = jax.lax.cond(finite, lambda: is_finite(update()), lambda: jnp.bool_(False))
    return jax.lax.cond(ok, update, lambda: state), ok


def make_sft_step(optimizer: optax.GradientTransformation, *, donate: bool = False) -> StepFn:
    """Cross-entropy on completion tokens. Batch: `tokens`, `prompt_valid`, `completion_mask`.

    `donate=True`: the input state's buffers are reused for the output state (`make_rl_step`).
    Metrics: `loss`, `grad_norm` and `skipped`: 1.0 when the loss, the gradient or the updated parameters or
    optimizer state were not finite, in which case the state is returned unchanged.
    """

    def loss_fn(params, policy, batch):
        logp, _ = completion_logprobs(policy.replace(params=params), batch["tokens"], batch["prompt_valid"])
        mask = batch["completion_mask"]
        return -losses.aggregate(logp, mask, "token-mean", losses.normalizers(mask))

    @functools.partial(jax.jit, donate_argnames=("state",) if donate else ())
    def sft_step(state: TrainState, batch: Batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.policy.params, state.policy, batch)
        grads = _constrain(state.policy.layout, grads)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        finite = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
        state, applied = _apply_if_finite(state, lambda: _apply_gradients(state, optimizer, {"policy": grads}),
                                          finite)
        metrics["skipped"] = 1.0 - applied.astype(jnp.float32)
        return state, metrics

    return sft_step


def _split_micro_batches(batch: Batch, micro_batches: int) -> Batch:
    """`[B, ...]` -> `[M, B/M, ...]`; micro-batch j holds rows j, j+M, ... so that each one spans every
    data-parallel shard of a batch split into contiguous blocks."""
    def split(x):
        if x.shape[0] % micro_batches:
            raise ValueError(f"a mini-batch of {x.shape[0]} rows does not split into {micro_batches} "
                             "micro-batches")
        return x.reshape(x.shape[0] // micro_batches, micro_batches, *x.shape[1:]).swapaxes(0, 1)
    return jax.tree.map(split, batch)


def _adaptive_clip_fields(clip_bounds: Callable, state: TrainState, batch: Batch, controls: Controls,
                          micro_batches: int) -> Batch:
    """`loss.clip_bounds` (`losses.compose.adaptive_clip_fields`) of the whole mini-batch: one forward pass of the
    current policy (micro-batch by micro-batch) for its log-probs, then the bounds of all its tokens, as `[B, N]`
    fields that split with the batch. Not with packed rows (their log-probs come per packed micro-batch)."""
    if "plan" in batch:
        raise ValueError("rl.packing.enabled: an adaptive clip (objective 'bapo') needs the current policy's log-probs "
                         "of the whole mini-batch before the update, which the packed path does not compute; set "
                         "rl.packing.enabled: false")
    policy = state.policy

    def logp_of(piece):
        return jax.lax.stop_gradient(completion_logprobs(policy, piece["tokens"], piece["prompt_valid"],
                                                         controls.temperature)[0])

    rows = {"tokens": batch["tokens"], "prompt_valid": batch["prompt_valid"]}
    if micro_batches > 1:
        per_piece = jax.lax.map(logp_of, _split_micro_batches(rows, micro_batches))  # [M, B/M, N]
        logp = per_piece.swapaxes(0, 1).reshape(batch["old_logp"].shape)  # the inverse of the split
    else:
        logp = logp_of(rows)
    counted = batch["loss_mask"].astype(jnp.float32)
    if batch.get("token_weights") is not None:
        counted = counted * batch["token_weights"]
    return clip_bounds(logp, batch["old_logp"], batch["advantages"], counted)


def make_rl_gradients(loss: Term, *, micro_batches: int = 1, norm_length: float = 1.0, full_kl: bool = False):
    """`(state, batch, controls, ref_policy) -> (grads, metrics)` of `loss` over one mini-batch.

    Batch (all `[B, ...]`): `tokens [B, Lp+N]`, `prompt_valid [B, Lp]`, `loss_mask`, `advantages`,
    `old_logp` `[B, N]`, and optionally `ref_logp`, `token_weights`, `kl_cov_mask`, `old_values`,
    `returns` `[B, N]`. `grads` is `{"policy": ..., "critic": ...}` (critic only with a critic).
    `ref_policy` is needed only for the exact (`full_kl`) KL.

    A batch with a `plan` (`jaxrl.packing.PackPlan` of its `prompt_valid` and `loss_mask`) runs the models on
    its packed rows, one micro-batch of the plan's token budget after another (`micro_batches` is then unused).
    Each micro-batch's log-probs (entropies, values) are unpacked to `[B, N]` and its loss computed there with
    the loss mask of its own sequences, so every loss piece sees the sampler layout; outside the micro-batch the
    log-probs are the old ones (ratio 1, masked out) and the values the old values.
    """

    def loss_on(trainable, state: TrainState, micro: Batch, norm, controls: Controls, logp, entropy, values, kl,
                mask):
        inputs = LossInputs(logp=logp, old_logp=micro["old_logp"], advantages=micro["advantages"], mask=mask,
                            entropy=entropy, ref_logp=micro.get("ref_logp"),
                            token_weights=micro.get("token_weights"), kl_cov_mask=micro.get("kl_cov_mask"),
                            kl_full=kl, values=values, old_values=micro.get("old_values"),
                            returns=micro.get("returns"), clip_low=micro.get("clip_low"),
                            clip_high=micro.get("clip_high"))
        return loss(inputs, norm, controls)

    def micro_loss(trainable, state: TrainState, micro: Batch, norm, controls: Controls, ref_policy):
        policy = state.policy.replace(params=trainable["policy"])
        tokens, prompt_valid = micro["tokens"], micro["prompt_valid"]
        logp, entropy = completion_logprobs(policy, tokens, prompt_valid, controls.temperature)
        values = None
        if state.critic is not None:
            values = critic_values(state.critic.replace(params=trainable["critic"]), tokens, prompt_valid)
        kl = None
        if full_kl:
            kl = _full_kl_to_reference(policy, ref_policy, tokens, prompt_valid, controls.temperature)
        return loss_on(trainable, state, micro, norm, controls, logp, entropy, values, kl, micro["loss_mask"])

    def packed_loss(trainable, state: TrainState, batch: Batch, piece, norm, controls: Controls, ref_policy):
        rows, index = piece
        plan = batch["plan"]
        shards = plan.shards
        policy = state.policy.replace(params=trainable["policy"])
        hidden, targets = _packed_hidden(policy, batch["tokens"], rows, plan)
        logp, entropy = token_logprobs(hidden, models.unembedding(policy), targets, controls.temperature,
                                       softcap=policy.config.final_logit_softcap)
        logp = packing.unpack(logp, index, shards, fill=batch["old_logp"])
        entropy = packing.unpack(entropy, index, shards)
        values = kl = None
        if state.critic is not None:
            critic = state.critic.replace(params=trainable["critic"])
            critic_hidden, _ = _packed_hidden(critic.trunk, batch["tokens"], rows, plan)
            values = packing.unpack(_value_head(critic, critic_hidden), index, shards,
                                    fill=batch.get("old_values", 0.0))
        if full_kl:
            ref_hidden, _ = _packed_hidden(ref_policy, batch["tokens"], rows, plan)
            kl = losses.kl_full(_log_softmax(policy, hidden, controls.temperature),
                                jax.lax.stop_gradient(_log_softmax(ref_policy, ref_hidden, controls.temperature)))
            kl = packing.unpack(kl, index, shards)
        mask = batch["loss_mask"] * (index >= 0)
        return loss_on(trainable, state, batch, norm, controls, logp, entropy, values, kl, mask)

    def gradients(state: TrainState, batch: Batch, controls: Controls, ref_policy: Policy | None = None):
        if full_kl and ref_policy is None:
            raise ValueError("the exact ('full') KL needs the reference policy")
        trainable = {"policy": state.policy.params}
        if state.critic is not None:
            trainable["critic"] = state.critic.params
        norm = losses.normalizers(batch["loss_mask"], norm_length, batch.get("token_weights"))
        clip_bounds = getattr(loss, "clip_bounds", None)
        if clip_bounds is not None:  # adaptive clip bounds (BAPO) of this whole mini-batch, before it is split
            batch = {**batch, **_adaptive_clip_fields(clip_bounds, state, batch, controls, micro_batches)}
        if "plan" in batch:
            pieces = _plan_micro_batches(batch["plan"])
            count = batch["plan"].micro_batches

            def piece_loss(trainable, piece):
                return packed_loss(trainable, state, batch, piece, norm, controls, ref_policy)
        else:
            count = micro_batches
            pieces = _split_micro_batches(batch, micro_batches) if micro_batches > 1 else None

            def piece_loss(trainable, piece):
                return micro_loss(trainable, state, piece, norm, controls, ref_policy)

        grad_fn = jax.value_and_grad(piece_loss, has_aux=True)
        if count == 1:
            (_, metrics), grads = grad_fn(trainable, batch if pieces is None else jax.tree.map(lambda x: x[0],
                                                                                                pieces))
            return _constrain_trainable(state, grads), metrics

        first = jax.tree.map(lambda x: x[0], pieces)
        (_, shapes), _ = jax.eval_shape(grad_fn, trainable, first)
        start = {name: jnp.full(s.shape, -jnp.inf if name.endswith("_max") else jnp.inf if name.endswith("_min")
                                else 0.0, s.dtype) for name, s in shapes.items()}

        def accumulate(carry, piece):
            grads, metrics = carry
            (_, mb_metrics), mb_grads = grad_fn(trainable, piece)
            grads = _constrain_trainable(state, jax.tree.map(lambda g, m: g + m.astype(jnp.float32), grads, mb_grads))
            return (grads, losses.reduce_metrics(metrics, mb_metrics)), None

        # summed in float32 whatever the parameters' dtype (bf16 sums would round after every micro-batch)
        zeros = _constrain_trainable(state, jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable))
        (grads, metrics), _ = jax.lax.scan(accumulate, (zeros, start), pieces)
        return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trainable), metrics

    return gradients


def make_rl_step(optimizer: optax.GradientTransformation, loss: Term, *, micro_batches: int = 1,
                 norm_length: float = 1.0, critic_optimizer: optax.GradientTransformation | None = None,
                 full_kl: bool = False, update_policy: bool = True, donate: bool = False):
    """One optimizer step of `loss` (any composition of `jaxrl.losses` terms, or your own) on a mini-batch.

    Returns jitted `step(state, batch, controls, ref_policy=None) -> (state, metrics)`; see
    `make_rl_gradients` for the batch (with a `plan`: packed rows). Metrics: the loss terms' metrics,
    `grad_norm` (policy, before clipping), `critic_grad_norm` with a critic, `skipped`: 1.0 when the loss or a
    gradient was not finite or the update would make a parameter or optimizer-state array non-finite
    (`_apply_if_finite`), in which case the state is returned unchanged (parameters, optimizer state and step
    count), `nonfinite_update`: 1.0 for the latter cause alone (finite loss and gradients, non-finite result),
    and `loss_tokens`: the mini-batch's loss tokens (weights for averaging updates, `jaxrl.loop.rl_update`).
    `update_policy=False` trains only the critic (PPO's critic warm-up): the policy and its optimizer state
    stay as they are.

    `donate=True` donates the input state to the step (`jax.jit`'s `donate_argnames`): the new parameters and
    optimizer state are written over the old ones instead of beside them, which takes the state's size (3x the
    parameters with Adam) off the step's peak memory. The input state, and every pytree that shares its
    arrays, is then deleted: keep a frozen reference policy as a copy (`copy_arrays`).
    """
    gradients = make_rl_gradients(loss, micro_batches=micro_batches, norm_length=norm_length, full_kl=full_kl)

    @functools.partial(jax.jit, donate_argnames=("state",) if donate else ())
    def rl_step(state: TrainState, frozen, batch: Batch, controls: Controls, ref_policy: Policy | None = None):
        state = state.replace(policy=state.policy.replace(frozen=frozen))
        state, metrics = _rl_step(state, batch, controls, ref_policy)
        return state.replace(policy=state.policy.replace(frozen=None)), metrics

    def _rl_step(state: TrainState, batch: Batch, controls: Controls, ref_policy: Policy | None):
        grads, metrics = gradients(state, batch, controls, ref_policy)
        metrics["grad_norm"] = optax.tree.norm(grads["policy"])
        finite = jnp.isfinite(metrics["grad_norm"]) & jnp.isfinite(metrics.get("loss", 0.0))
        if state.critic is not None:
            metrics["critic_grad_norm"] = optax.tree.norm(grads["critic"])
            finite &= jnp.isfinite(metrics["critic_grad_norm"])
        metrics["loss_tokens"] = batch["loss_mask"].sum()
        def apply():
            new = _apply_gradients(state, optimizer, grads, critic_optimizer)
            if not update_policy:
                new = new.replace(policy=state.policy, opt_state=state.opt_state)
            return new
        state, applied = _apply_if_finite(state, apply, finite)
        metrics["skipped"] = 1.0 - applied.astype(jnp.float32)
        metrics["nonfinite_update"] = (finite & ~applied).astype(jnp.float32)
        return state, metrics

    return FrozenAside(rl_step)


class FrozenAside:
    """`step(state, *args)` for a jitted `fn(state, frozen, *args)`: an adapted policy's frozen base
    (`Policy.frozen`, `models.lora`) goes in as an argument of its own, so that donating the state donates the
    adapters and their optimizer state but never the base, which the reference policy and the caller share.
    `lower(state, *args)` lowers the same way; its `compile()` is called like the step."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, state: TrainState, *args):
        new, metrics = self.fn(*_frozen_aside(state), *args)
        return new.replace(policy=new.policy.replace(frozen=state.policy.frozen)), metrics

    def lower(self, state: TrainState, *args) -> "_LoweredAside":
        return _LoweredAside(self.fn.lower(*_frozen_aside(state), *args))

    def __getattr__(self, name):  # a compiled step's memory_analysis, cost_analysis, as_text, ...
        return getattr(self.fn, name)


def _frozen_aside(state: TrainState) -> tuple[TrainState, Any]:
    return state.replace(policy=state.policy.replace(frozen=None)), state.policy.frozen


class _LoweredAside:
    def __init__(self, lowered):
        self.lowered = lowered

    def compile(self) -> FrozenAside:
        return FrozenAside(self.lowered.compile())

    def __getattr__(self, name):
        return getattr(self.lowered, name)
