"""The loss library: policy-optimisation objectives composed from small pure pieces.

| module | pieces |
|---|---|
| `aggregation` | `Normalizers` (whole-batch counts), `aggregate` (token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm), `reduce_metrics`, `mean_over_updates` |
| `policy` | importance ratios (token, GSPO sequence, GSPO-token), objectives (`ppo_clip` with clip-higher and dual clip, `reinforce`, `cispo`, `gmpo`) |
| `updates` | issue 35's objectives: `gpg` (no ratio, no clip; `preset: gpg`), `bapo` (clip bounds adapted per mini-batch by `bapo_clip_bounds`; `preset: bapo`), `dcpo` (bounds from each token's old probability; `preset: dcpo`), `aspo` (flipped ratio for positive tokens, soft dual clip; `preset: aspo`), `cpgd` (clipped log-ratio gradient, with `policy_drift` via `drift_coef`; `preset: cpgd`) |
| `correction` | issue 33's rollout correction: `rollout_correction` (token / sequence / geometric weights, truncated or masked on both sides, the veto), `mismatch_metrics` (sampler/trainer log-prob gap, KL, perplexity ratio), `m2po_mask` |
| `stale` | issue 33's objectives for stale data: `m2po` (`preset: m2po`), `sapo` (`preset: sapo`); AIPO is `preset: aipo` (CISPO's one-sided clip with token TIS) |
| `masks` | batch-level token selections: overlong filtering, top-entropy ("forking") tokens, Clip-Cov, KL-Cov, log-prob/advantage covariance |
| `regularizers` | KL estimators (k1, k2, k3, full, abs: `kl_estimator: abs`), clipped value loss, adaptive entropy coefficient, temperature controller |
| `config` | `LossConfig` and the named presets (configurations only) |
| `compose` | `LossInputs`, `Controls`, terms (`policy_term`, `kl_term`, `entropy_term`, `kl_cov_term`, `drift_term`, `value_term`), `combine`, `build_loss` |
| `batch` | `prepare_batch`: advantages, masks and weights of a whole rollout batch, before it is split (with GPG's `gpg_alpha`) |

Advantage estimators live in `jaxrl.advantages`; the second wave's (issue 35) in `jaxrl.advantage_shaping`,
each selected by `rl.loss.advantage.estimator` or its preset: `bnpo` (preset `bnpo`), `psr` / `nsr` /
`w_reinforce` (preset `w_reinforce`, `advantage.psr_weight`), `passk` (preset `passk`, `advantage.passk_k`),
`empg` (preset `empg`, `advantage.empg_k` / `empg_k_future` / `empg_zeta` / `empg_steps`) and `seed_grpo`
(preset `seed_grpo`, `advantage.seed_alpha`). The entropy-advantage term of "Reasoning with Exploration"
(arXiv 2506.14758) is `advantage.entropy_bonus_alpha` / `entropy_bonus_kappa` on any estimator.
"""

from jaxrl.losses.aggregation import (AGGREGATIONS, Normalizers, aggregate, mean_over_updates, normalizers,
                                     reduce_metrics, token_mean)
from jaxrl.losses.batch import gpg_alpha, prepare_batch
from jaxrl.losses.compose import (Controls, LossInputs, Term, build_loss, combine, drift_term, entropy_term,
                                  kl_cov_term, kl_term, policy_term, value_term)
from jaxrl.losses.config import PRESETS, LossConfig
from jaxrl.losses.correction import log_is_weights, m2po_mask, mismatch_metrics, rollout_correction
from jaxrl.losses.masks import (clip_cov_mask, kl_cov_mask, logp_advantage_covariance, top_entropy_mask,
                                truncation_mask)
from jaxrl.losses.policy import (cispo, gmpo, ppo_clip, reinforce, sequence_log_ratio,
                                 sequence_token_log_ratio, token_log_ratio)
from jaxrl.losses.regularizers import (KL_ESTIMATORS, adapt_entropy_coef, adapt_temperature, kl_abs, kl_estimate,
                                       kl_full, kl_k1, kl_k2, kl_k3, value_loss)
from jaxrl.losses.stale import m2po, sapo
from jaxrl.losses.updates import aspo, bapo, bapo_clip_bounds, cpgd, dcpo, gpg, policy_drift

__all__ = [
    "AGGREGATIONS", "KL_ESTIMATORS", "PRESETS", "Controls", "LossConfig", "LossInputs",
    "Normalizers", "Term", "adapt_entropy_coef", "adapt_temperature", "aggregate", "build_loss", "cispo",
    "clip_cov_mask", "combine", "entropy_term", "gmpo", "kl_cov_mask", "kl_cov_term", "kl_estimate", "kl_full",
    "kl_k1", "kl_k2", "kl_k3", "kl_term", "logp_advantage_covariance", "mean_over_updates", "normalizers",
    "policy_term", "ppo_clip", "prepare_batch", "reduce_metrics", "reinforce", "sequence_log_ratio",
    "sequence_token_log_ratio",
    "token_log_ratio", "token_mean", "top_entropy_mask", "truncation_mask", "value_loss",
    "value_term",
    # issue 35, policy updates
    "aspo", "bapo", "bapo_clip_bounds", "cpgd", "dcpo", "drift_term", "gpg", "gpg_alpha", "kl_abs", "policy_drift",
    # issue 33, rollout correction and objectives for stale data
    "log_is_weights", "m2po", "m2po_mask", "mismatch_metrics", "rollout_correction", "sapo",
]
