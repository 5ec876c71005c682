"""Loss terms and their composition, in the manner of `optax.chain`.

A *term* is a pure function `(LossInputs, Normalizers, Controls) -> (scalar, metrics)`. `combine` adds
terms; `build_loss(config)` assembles the terms a `LossConfig` names. A new variant is a new per-token
objective (used by `policy_term`) or a new term, registered by name and named in the config; nothing in the
trainer changes:

    from jaxrl import registry

    @registry.register("objective", "tanh_surrogate")
    def tanh_surrogate(log_ratio, advantages, logp, mask, eps_low, eps_high, dual_clip_c):
        ratio = jnp.exp(log_ratio)
        return -jnp.tanh(ratio * advantages), {}

    @registry.register("term", "sq_log_ratio")
    def sq_log_ratio(inputs, norm, controls):
        per_token = 0.5 * jnp.square(inputs.logp - jax.lax.stop_gradient(inputs.old_logp))
        return 0.05 * aggregate(per_token, inputs.mask, "token-mean", norm), {}

    # YAML: imports: [my_losses]   rl: {loss: {objective: tanh_surrogate, terms: [sq_log_ratio]}}

Metrics of a (micro-)batch are normalised by whole-batch counts (`Normalizers`), so the trainer adds them
up over micro-batches (`_max`/`_min` names are maxed/minned, see `aggregation.reduce_metrics`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxrl.losses.aggregation import Normalizers, aggregate, masked_max, masked_min, token_mean
from jaxrl.losses.config import LossConfig
from jaxrl import registry
from jaxrl.losses.policy import clamped_ratio, token_log_ratio
from jaxrl.losses.regularizers import K1_AS_LOSS, kl_estimate, kl_k3, value_loss
from jaxrl.losses.updates import bapo_clip_bounds, policy_drift

sg = jax.lax.stop_gradient
Metrics = dict[str, jax.Array]


@struct.dataclass
class LossInputs:
    """Per-token inputs of one (micro-)batch, all `[B, N]` float32 (B sequences, N completion tokens).

    Gradients flow only through `logp`, `entropy`, `values` and `kl_full`; everything else is data.
    """

    logp: jax.Array  # current policy's log-probs of the sampled tokens
    old_logp: jax.Array  # log-probs under the parameters that sampled the batch
    advantages: jax.Array
    mask: jax.Array  # loss mask: completion tokens of kept sequences
    entropy: jax.Array | None = None  # current policy's entropy at each position
    ref_logp: jax.Array | None = None  # frozen reference policy
    token_weights: jax.Array | None = None  # batch-level selections and IS weights multiplying the policy loss
    kl_cov_mask: jax.Array | None = None  # tokens KL-Cov penalises
    kl_full: jax.Array | None = None  # exact per-token KL to the reference (kl_estimator 'full')
    values: jax.Array | None = None  # critic's current values
    old_values: jax.Array | None = None
    returns: jax.Array | None = None
    # Per-token ratio bounds of an adaptive clip (BAPO: `updates.bapo_clip_bounds` over the whole optimized batch,
    # computed by the trainer before the batch is split), replacing the objective's constant 1 - eps_low, 1 + eps_high.
    clip_low: jax.Array | None = None
    clip_high: jax.Array | None = None


@struct.dataclass
class Controls:
    """Coefficients that controllers change between rollout batches (scalars, traced, so no recompiles)."""

    entropy_coef: jax.Array
    temperature: jax.Array
    # With an entropy target: 1.0 while the last measured entropy was below it, else 0.0 (Skywork-OR1 applies
    # its adaptive bonus only then). The bonus is entropy_coef times this. None without a target.
    entropy_below_target: jax.Array | None = None

    @classmethod
    def initial(cls, config: LossConfig, temperature: float) -> "Controls":
        below = None if config.entropy_target is None else jnp.float32(1.0)
        return cls(entropy_coef=jnp.float32(config.entropy_coef), temperature=jnp.float32(temperature),
                   entropy_below_target=below)

    @property
    def entropy_bonus(self) -> jax.Array:
        """The adaptive entropy coefficient in force: `entropy_coef`, switched off above the target."""
        if self.entropy_below_target is None:
            return self.entropy_coef
        return self.entropy_coef * self.entropy_below_target


Term = Callable[[LossInputs, Normalizers, Controls], tuple[jax.Array, Metrics]]
ObjectiveFn = Callable[..., tuple[jax.Array, Metrics]]


def _require(value, name: str, term: str):
    if value is None:
        raise ValueError(f"the {term} term needs LossInputs.{name}, which this batch does not have")
    return value


def policy_term(objective: str | ObjectiveFn = "ppo_clip", ratio: str | Callable = "token",
                aggregation: str = "token-mean", eps_low: float = 0.2, eps_high: float = 0.28,
                dual_clip_c: float | None = None) -> Term:
    """The policy-gradient term: ratio -> per-token objective -> token weights -> aggregation.

    `objective` is a registered objective's name (`jaxrl.registry`, kind `objective`), `module:function`, or a
    function `(log_ratio, advantages, logp, mask, eps_low, eps_high, dual_clip_c) -> (loss [B, N], metrics [B, N])`.
    Metrics: `policy_loss`, the objective's per-token indicators (token means), `ratio_mean`, `ratio_max`,
    `ratio_min`, `approx_kl_old` (k3 of the old policy to the current), `masked_frac` (valid tokens whose
    weight is 0) and `entropy` when available. With token weights, the objective's indicators and the ratio
    and KL metrics describe only the valid tokens of non-zero weight, those the loss counts, normalised by
    `norm.num_counted_tokens` (take the `Normalizers` with `normalizers(..., token_weights=...)`; without that
    count they describe all valid tokens); `masked_frac` and `entropy` describe all valid tokens.
    """
    adaptive = False
    if isinstance(objective, str):
        entry = registry.resolve("objective", objective, "objective")
        objective, adaptive = entry.fn, bool(entry.info.get("adaptive_clip"))
    ratio_fn = registry.resolve("ratio", ratio, "ratio").fn if isinstance(ratio, str) else ratio

    def term(inputs: LossInputs, norm: Normalizers, controls: Controls):
        mask = inputs.mask.astype(jnp.float32)
        log_ratio = ratio_fn(inputs.logp, inputs.old_logp, mask)
        low, high = eps_low, eps_high
        if adaptive:  # bounds of the whole optimized batch, as eps arrays
            low = 1.0 - _require(inputs.clip_low, "clip_low", "adaptive-clip policy")
            high = _require(inputs.clip_high, "clip_high", "adaptive-clip policy") - 1.0
        per_token, token_metrics = objective(log_ratio, inputs.advantages, inputs.logp, mask, low, high,
                                             dual_clip_c)
        if adaptive:
            token_metrics = {**token_metrics, "clip_bound_low": inputs.clip_low, "clip_bound_high": inputs.clip_high}
        weights = jnp.ones_like(mask) if inputs.token_weights is None else inputs.token_weights
        loss = aggregate(per_token * weights, mask, aggregation, norm)
        ratio_value = clamped_ratio(log_ratio)
        counted, count = mask, None  # the tokens the loss counts, and their whole-batch number
        if inputs.token_weights is not None and norm.num_counted_tokens is not None:
            counted, count = mask * (weights != 0), norm.num_counted_tokens
        metrics = {name: token_mean(value, counted, norm, count) for name, value in token_metrics.items()}
        metrics.update(
            policy_loss=loss,
            ratio_mean=token_mean(ratio_value, counted, norm, count),
            ratio_max=masked_max(ratio_value, counted),
            ratio_min=masked_min(ratio_value, counted),
            approx_kl_old=token_mean(kl_k3(sg(inputs.old_logp), sg(inputs.logp)), counted, norm, count),
            masked_frac=token_mean((weights == 0).astype(jnp.float32), mask, norm),
        )
        if inputs.entropy is not None:
            metrics["entropy"] = token_mean(sg(inputs.entropy), mask, norm)
        return loss, metrics

    return term


def kl_term(coef: float, estimator: str = "k3", target: str = "ref", aggregation: str = "token-mean") -> Term:
    """`coef * KL(pi || target)` with a sampled estimator (k1/k2/k3) or the exact `full` KL; metric
    `kl_<target>` is the token mean of the estimate."""
    if target not in ("ref", "old"):
        raise ValueError(f"unknown KL target {target!r}; valid choices: ref, old")
    if estimator == "full" and target != "ref":
        raise ValueError("the 'full' KL estimator is computed to the reference policy only (target='ref')")
    if estimator == "k1" and coef:
        raise ValueError(K1_AS_LOSS)

    def term(inputs: LossInputs, norm: Normalizers, controls: Controls):
        if estimator == "full":
            per_token = _require(inputs.kl_full, "kl_full", "full-KL")
        else:
            target_logp = inputs.ref_logp if target == "ref" else inputs.old_logp
            target_logp = _require(target_logp, f"{target}_logp", f"KL-to-{target}")
            per_token = kl_estimate(inputs.logp, sg(target_logp), estimator)
        kl = aggregate(per_token, inputs.mask, aggregation, norm)
        return coef * kl, {f"kl_{target}": token_mean(sg(per_token), inputs.mask, norm)}

    return term


def entropy_term(coef: float | None = None, aggregation: str = "token-mean") -> Term:
    """Entropy bonus `-coef * H`; `coef=None` reads the adaptive `Controls.entropy_bonus`."""

    def term(inputs: LossInputs, norm: Normalizers, controls: Controls):
        entropy = _require(inputs.entropy, "entropy", "entropy")
        c = controls.entropy_bonus if coef is None else coef
        return -c * aggregate(entropy, inputs.mask, aggregation, norm), {}

    return term


def kl_cov_term(coef: float, aggregation: str = "token-mean") -> Term:
    """KL-Cov's penalty `coef * |logp - old_logp|` on the tokens of `LossInputs.kl_cov_mask`."""

    def term(inputs: LossInputs, norm: Normalizers, controls: Controls):
        selected = _require(inputs.kl_cov_mask, "kl_cov_mask", "KL-Cov")
        per_token = coef * jnp.abs(inputs.logp - sg(inputs.old_logp)) * selected
        return aggregate(per_token, inputs.mask, aggregation, norm), {}

    return term


def drift_term(coef: float, aggregation: str = "token-mean") -> Term:
    """CPGD's policy drift `coef * KL(pi_old || pi)`, per token `updates.policy_drift` (`r - 1 - ln r`); metric
    `policy_drift` is its token mean (Liu et al. 2025, arXiv 2505.12504)."""

    def term(inputs: LossInputs, norm: Normalizers, controls: Controls):
        per_token = policy_drift(inputs.logp, inputs.old_logp)
        drift = aggregate(per_token, inputs.mask, aggregation, norm)
        return coef * drift, {"policy_drift": token_mean(sg(per_token), inputs.mask, norm)}

    return term


def value_term(coef: float = 0.5, clip_eps: float | None = 0.2, aggregation: str = "token-mean") -> Term:
    """`coef * clipped value loss`; metrics `value_loss`, `value_clip_frac`. `build_loss` uses token-mean
    whatever the policy's aggregation: value regression is per token (as in PPO implementations)."""

    def term(inputs: LossInputs, norm: Normalizers, controls: Controls):
        values = _require(inputs.values, "values", "value")
        per_token, metrics = value_loss(values, _require(inputs.old_values, "old_values", "value"),
                                        _require(inputs.returns, "returns", "value"), clip_eps)
        loss = aggregate(per_token, inputs.mask, aggregation, norm)
        return coef * loss, {"value_loss": loss,
                             "value_clip_frac": token_mean(metrics["value_clip_frac"], inputs.mask, norm)}

    return term


def combine(*terms: Term) -> Term:
    """The sum of `terms`; metrics are merged (a name two terms both report is an error) plus `loss`."""

    def loss_fn(inputs: LossInputs, norm: Normalizers, controls: Controls):
        total, metrics = jnp.float32(0.0), {}
        for term in terms:
            value, term_metrics = term(inputs, norm, controls)
            clash = set(term_metrics) & set(metrics)
            if clash:
                raise ValueError(f"two loss terms report the same metrics {sorted(clash)}")
            total = total + value
            metrics.update(term_metrics)
        metrics["loss"] = total
        return total, metrics

    return loss_fn


def build_loss(config: LossConfig, *, with_critic: bool = False) -> Term:
    """The loss a `LossConfig` describes (the value term only when a critic is trained; `config.terms`, the
    user's own registered terms, last)."""
    agg = config.aggregation
    entry = registry.resolve("objective", config.objective, "rl.loss.objective")
    objective = config.objective
    if entry.info.get("config"):  # the objective's own parameters, bound from their LossConfig fields (SAPO)
        bound = {kw: getattr(config, field) for kw, field in entry.info["config"].items()}
        objective = functools.partial(entry.fn, **bound)
    terms = [policy_term(objective, config.ratio, agg, config.clip_eps_low, config.clip_eps_high,
                         config.dual_clip_c)]
    if config.kl_coef and not config.kl_in_reward:
        terms.append(kl_term(config.kl_coef, config.kl_estimator, config.kl_target, agg))
    if config.entropy_coef or config.entropy_target is not None:
        terms.append(entropy_term(None if config.entropy_target is not None else config.entropy_coef, agg))
    if config.kl_cov_ratio:
        terms.append(kl_cov_term(config.kl_cov_coef, agg))
    if config.drift_coef:
        terms.append(drift_term(config.drift_coef, agg))
    if with_critic:
        terms.append(value_term(config.value_coef, config.value_clip_eps))
    terms += [registry.resolve("term", name, f"rl.loss.terms[{i}]").fn for i, name in enumerate(config.terms)]
    loss = combine(*terms)
    if registry.resolve("objective", config.objective, "rl.loss.objective").info.get("adaptive_clip"):
        loss.clip_bounds = functools.partial(adaptive_clip_fields, config)
    return loss


def adaptive_clip_fields(config: LossConfig, logp: jax.Array, old_logp: jax.Array, advantages: jax.Array,
                         mask: jax.Array) -> dict[str, jax.Array]:
    """BAPO's bounds for one optimizer step, from the current policy's log-probs of the *whole* optimized batch
    (all `[B, N]`; `mask`: the tokens the loss counts): `{"clip_low", "clip_high"}` as `[B, N]` arrays, which
    travel with the batch into its micro-batches (`LossInputs.clip_low/high`), so the bounds do not depend on
    the split. The trainer calls it as `loss.clip_bounds` (`jaxrl.train.make_rl_gradients`)."""
    c_low, c_high, _ = bapo_clip_bounds(token_log_ratio(sg(logp), old_logp, mask), advantages, mask,
                                        target=config.bapo_target, low_start=config.bapo_low_start,
                                        low_max=config.bapo_low_max, high_start=config.bapo_high_start,
                                        high_max=config.bapo_high_max, step_low=config.bapo_step_low,
                                        step_high=config.bapo_step_high)
    ones = jnp.ones(logp.shape, jnp.float32)
    return {"clip_low": c_low * ones, "clip_high": c_high * ones}
