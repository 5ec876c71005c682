"""`LossConfig`: one objective as data, and the named presets that are nothing but configurations.

A preset is a dict of field values applied on top of the defaults; fields set explicitly (in the YAML
file or as `key=value` overrides) win over the preset, whatever their order:

    rl:
      loss:
        preset: gspo
        clip_eps_high: 5.0e-4     # GSPO with a wider upper clip
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, get_args

from jaxrl import registry
from jaxrl.advantages import AdvantageConfig
from jaxrl.losses.aggregation import Aggregation
from jaxrl.losses.correction import ISLevel, ISMode
from jaxrl.losses.regularizers import K1_AS_LOSS, KLEstimator

Preset = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo", "gmpo", "ppo", "rloo", "reinforce_pp", "clip_cov",
                 "kl_cov",
                 "gpg", "bapo", "dcpo", "aspo", "cpgd",  # issue 35, policy updates (jaxrl.losses.updates)
                 # issue 35, advantage and entropy methods (jaxrl.advantage_shaping)
                 "bnpo", "w_reinforce", "passk", "empg", "seed_grpo",
                 "m2po", "sapo", "aipo"]  # issue 33, objectives for stale data (jaxrl.losses.stale)

PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath (Shao et al. 2024, arXiv 2402.03300): group-normalised advantages, sequence-mean loss,
    # k3 KL to the reference in the loss.
    "grpo": dict(clip_eps_low=0.2, clip_eps_high=0.2, aggregation="seq-mean-token-mean", kl_coef=0.04,
                 kl_estimator="k3", kl_target="ref"),
    # Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): no std scaling, constant-length normaliser, no KL.
    "dr_grpo": dict(advantage={"std_scope": "none"}, clip_eps_low=0.2, clip_eps_high=0.2,
                    aggregation="seq-mean-token-sum-norm"),
    # DAPO (Yu et al. 2025, arXiv 2503.14476): clip-higher, token-mean, no KL. Dynamic sampling and the
    # overlong reward shaping live in the loop and in jaxrl.rewards.
    "dapo": dict(clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token-mean"),
    # GSPO (Zheng et al. 2025, arXiv 2507.18071): sequence-level ratio with a tight clip.
    "gspo": dict(ratio="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4, aggregation="seq-mean-token-mean"),
    # CISPO (MiniMax-M1, arXiv 2506.13585): clipped detached IS weight on REINFORCE, no lower bound.
    "cispo": dict(objective="cispo", clip_eps_low=1.0, clip_eps_high=0.28, aggregation="token-mean"),
    # GMPO (Zhao et al. 2025, arXiv 2507.20673): geometric mean of token ratios, log-space clip (e^-0.4, e^0.4).
    "gmpo": dict(objective="gmpo", clip_eps_low=0.4, clip_eps_high=0.4, aggregation="seq-mean-token-mean"),
    # PPO with a critic (Schulman et al. 2017, arXiv 1707.06347; Ouyang et al. 2022): GAE with lambda = gamma
    # = 1 and advantages whitened over the batch, as verl's and OpenRLHF's PPO default to (on the default recipe
    # this beat lambda 0.95 without whitening: benchmarks/RESULTS.md). VC-PPO's decoupled lambdas (Yuan et al.
    # 2025, arXiv 2503.01491): rl.loss.advantage.lam_actor=0.95. Needs rl.critic.
    "ppo": dict(advantage={"estimator": "gae", "lam_actor": 1.0, "lam_critic": 1.0, "whiten": True},
                clip_eps_low=0.2,
                clip_eps_high=0.2, aggregation="token-mean", value_coef=0.5, value_clip_eps=0.2),
    # RLOO (Ahmadian et al. 2024, arXiv 2402.14740): leave-one-out baseline, PPO clip.
    "rloo": dict(advantage={"estimator": "rloo"}, clip_eps_low=0.2, clip_eps_high=0.2, aggregation="token-mean"),
    # REINFORCE++ (Hu 2025, arXiv 2501.03262): batch-whitened returns, KL folded into the reward.
    "reinforce_pp": dict(advantage={"estimator": "reinforce_pp", "group_baseline": False}, clip_eps_low=0.2,
                         clip_eps_high=0.2, aggregation="token-mean", kl_coef=0.01, kl_estimator="k1",
                         kl_in_reward=True),
    # Clip-Cov (Cui et al. 2025, arXiv 2505.22617): detach a random share of high-covariance tokens.
    "clip_cov": dict(clip_eps_low=0.2, clip_eps_high=0.2, aggregation="token-mean", clip_cov_ratio=2e-4,
                     clip_cov_low=1.0, clip_cov_high=5.0),
    # KL-Cov (same paper): unclipped objective, KL penalty on the top-covariance tokens.
    "kl_cov": dict(objective="reinforce", aggregation="token-mean", kl_cov_ratio=2e-3, kl_cov_coef=1.0),
    # --- issue 35, policy updates (jaxrl.losses.updates) ---
    # GPG (Chu et al. 2025, arXiv 2504.02546): -A log pi, no ratio and no clip (eps_low >= 1 and eps_high = inf
    # say so), mean-centred advantages without std (F_norm = 1) scaled by alpha = B / (B - M), token-mean (the
    # paper's 1 / sum |o_i|).
    "gpg": dict(objective="gpg", advantage={"std_scope": "none"}, gpg_correction=True, clip_eps_low=1.0,
                clip_eps_high=math.inf, aggregation="token-mean"),
    # BAPO (Xi et al. 2025, arXiv 2510.18927): PPO clip with bounds adapted per mini-batch so positive tokens carry
    # half of the gradient's weight; rho_0 = 0.5, c_low in [0.6, 0.9], c_high in [1.2, 3.0] (the values the
    # official README gives as the paper's), steps 0.05 and dual clip c = 3 (its verl recipe), token-mean.
    "bapo": dict(objective="bapo", dual_clip_c=3.0, aggregation="token-mean"),
    # DCPO (Yang et al. 2025, arXiv 2509.02333): dynamic-adaptive clipping with eps_low 0.16, eps_high 0.2 (Sec. 4.1
    # and its bounds table), token-mean. Its smooth advantage standardisation needs each prompt's reward history
    # across steps and is not here.
    "dcpo": dict(objective="dcpo", clip_eps_low=0.16, clip_eps_high=0.2, aggregation="token-mean"),
    # ASPO (Wang et al. 2025, arXiv 2510.06062): flipped ratio for A > 0, soft dual clip c = 3, clip 0.2 / 0.2,
    # token-mean (the official Archer2.0 scripts' values; not checked against a table of the paper).
    "aspo": dict(objective="aspo", clip_eps_low=0.2, clip_eps_high=0.2, dual_clip_c=3.0, aggregation="token-mean"),
    # CPGD (Liu et al. 2025, arXiv 2505.12504): clipped log-ratio policy gradient, eps 0.2, plus the policy drift
    # KL(pi_old || pi) with coefficient 0.1 (our setting: the paper's value was not checked), token-mean.
    "cpgd": dict(objective="cpgd", clip_eps_low=0.2, clip_eps_high=0.2, drift_coef=0.1, aggregation="token-mean"),
    # Issue 35, advantage and entropy methods (estimators of jaxrl.advantage_shaping). Where a paper states no
    # clip or aggregation of its own, the PPO clip 0.2 / 0.2 and token-mean of verl, which the papers built on.
    # BNPO (Xiao et al. 2025, arXiv 2506.02864): Beta-density-normalised group advantages; binary rewards.
    "bnpo": dict(advantage={"estimator": "bnpo"}, clip_eps_low=0.2, clip_eps_high=0.2, aggregation="token-mean"),
    # W-REINFORCE (Zhu et al. 2025, arXiv 2506.01347): +lambda on correct, -1 on wrong samples, no baseline, no
    # KL (kl_coef 0 in the authors' run scripts); lambda = 0.1, the W-REINFORCE weight of those scripts
    # (github.com/TianHongZXY/RLVR-Decomposed). PSR / NSR alone: rl.loss.advantage.estimator=psr / nsr.
    "w_reinforce": dict(advantage={"estimator": "w_reinforce", "psr_weight": 0.1}, clip_eps_low=0.2,
                        clip_eps_high=0.2, aggregation="token-mean"),
    # Pass@k training with analytic advantages (Chen et al. 2025, arXiv 2508.10751); k = 4 of the default
    # recipe's 8 samples per prompt (our choice; k must be below rl.group_size).
    "passk": dict(advantage={"estimator": "passk", "passk_k": 4}, clip_eps_low=0.2, clip_eps_high=0.2,
                  aggregation="token-mean"),
    # EMPG (Wang et al. 2025, arXiv 2509.09265) on DAPO's clip-higher and token-mean (the paper applies it to
    # GRPO and DAPO); k = k' = 1, zeta = 0.1 as the project page's reference pseudocode. A single-turn
    # completion is one step; rl.loss.advantage.empg_steps=tokens makes each token a step (our extension).
    "empg": dict(advantage={"estimator": "empg", "empg_k": 1.0, "empg_k_future": 1.0, "empg_zeta": 0.1},
                 clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token-mean"),
    # SEED-GRPO (Chen et al. 2025, arXiv 2505.12346): GRPO advantages times 1 - alpha * SE / log G, SE the
    # semantic entropy of the group's extracted answers; alpha = 1 (our choice). Needs a reward registered
    # with answers=True (math, arithmetic).
    "seed_grpo": dict(advantage={"estimator": "seed_grpo", "seed_alpha": 1.0}, clip_eps_low=0.2,
                      clip_eps_high=0.2, aggregation="token-mean"),
    # --- issue 33, objectives for stale data (jaxrl.losses.stale) ---
    # M2PO (Zheng et al. 2025, arXiv 2510.01161): -(pi / pi_sampler) A without a clip (the objective's pi / pi_old
    # times the untruncated token weight pi_old / pi_sampler), the tokens of the largest squared log IS ratio
    # masked over the batch until its second moment is <= tau_M2 = 0.04 (the authors' scripts), token-mean.
    "m2po": dict(objective="m2po", m2po_tau=0.04, is_level="token", is_mode="truncate", is_cap=math.inf,
                 aggregation="token-mean"),
    # SAPO (Gao et al. 2025, arXiv 2511.20347): soft gate (4 / tau) sigmoid(tau (r - 1)), tau_pos 1.0 and
    # tau_neg 1.05 (as AReaL's and ms-swift's docs give the paper's; not checked against the paper itself), each
    # sequence's tokens averaged then the sequences.
    "sapo": dict(objective="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, aggregation="seq-mean-token-mean"),
    # AIPO (LlamaRL, arXiv 2505.24034): a policy gradient weighted by the importance ratio to the sampler,
    # truncated from above only at rho: CISPO's detached weight with no lower bound (clip_eps_low 1) times the
    # token-level truncated weight min(pi_old / pi_sampler, rho); on a batch's first update (pi = pi_old) the
    # weight is exactly min(pi / pi_sampler, rho). rho = 2 is our choice. The form is our reading of the method (an
    # asymmetric IS clip, which the issue accepts), not checked against the paper's text.
    "aipo": dict(objective="cispo", clip_eps_low=1.0, clip_eps_high=1.0, is_level="token", is_mode="truncate",
                 is_cap=2.0, aggregation="token-mean"),
}
assert set(PRESETS) == set(get_args(Preset))


def _field(default, **bounds):
    return dataclasses.field(default=default, metadata=bounds)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """A policy-optimisation objective: advantage estimator x ratio x objective x token masks x
    aggregation + KL term + entropy term + value loss. Defaults are the `dapo` preset."""

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = PRESETS

    preset: Preset | None = None  # a named configuration; explicitly set fields override it
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    # Importance ratio and objective.
    # Registered names (jaxrl.registry kinds `ratio`, `objective`; with those of modules under `imports:`) or
    # `module:function`. Ratios: token, sequence, sequence_token; objectives: ppo_clip, reinforce, cispo, gmpo, and
    # (jaxrl.losses.updates) gpg, bapo, dcpo, aspo, cpgd.
    ratio: str = "token"
    objective: str = "ppo_clip"
    clip_eps_low: float = _field(0.2, ge=0)  # gmpo: log-space bounds
    clip_eps_high: float = _field(0.28, ge=0, le=math.inf)  # .inf: no upper clip (gpg)
    dual_clip_c: float | None = _field(None, gt=1)  # ppo_clip only: caps the loss of A < 0 tokens at -c A
    # Aggregation over tokens (normalised by whole-batch counts).
    aggregation: Aggregation = "token-mean"
    norm_length: int | None = _field(None, gt=0)  # seq-mean-token-sum-norm constant (default: max_new_tokens)
    # Rollout correction against the sampler's log-probs (jaxrl.losses.correction): weights pi_old / pi_sampler
    # at a level, truncated into [is_floor, is_cap] or masked outside it, and the sequence veto.
    is_level: ISLevel = "none"  # none, token, sequence (product), geometric (exp of the mean log ratio)
    is_mode: ISMode = "truncate"  # truncate (TIS) or mask (MIS: the rejected tokens leave the loss)
    is_cap: float = _field(2.0, gt=1, le=math.inf)  # upper bound; .inf: none
    is_floor: float = _field(0.0, ge=0, lt=1)  # lower bound; 0: none
    is_veto: float | None = _field(None, gt=0, lt=1)  # reject a sequence with a token ratio < veto or > 1 / veto
    # Token masks.
    mask_truncated: bool = False  # overlong filtering: no loss on completions that hit max_new_tokens
    top_entropy_fraction: float | None = _field(None, gt=0, le=1)  # train only on the highest-entropy tokens
    clip_cov_ratio: float = _field(0.0, ge=0, le=1)  # share of tokens Clip-Cov detaches (0: off)
    clip_cov_low: float = 1.0
    clip_cov_high: float = 5.0
    kl_cov_ratio: float = _field(0.0, ge=0, le=1)  # share of tokens KL-Cov penalises (0: off)
    kl_cov_coef: float = _field(1.0, ge=0)
    # KL regularisation.
    kl_coef: float = _field(0.0, ge=0)
    kl_estimator: KLEstimator = "k3"
    kl_target: Literal["ref", "old"] = "ref"  # the frozen reference policy, or the policy that sampled
    kl_in_reward: bool = False  # subtract kl_coef x per-token KL from the reward instead of adding a loss
    # Entropy control.
    entropy_coef: float = _field(0.0, ge=0)  # bonus: loss -= coef x entropy (the start value when adaptive)
    entropy_target: float | None = _field(None, ge=0)  # adapt the coefficient towards this entropy (nats)
    entropy_coef_step: float = _field(1e-3, gt=0)
    entropy_coef_max: float = _field(0.1, ge=0)
    temperature_target_entropy: float | None = _field(None, ge=0)  # adapt the sampling temperature
    temperature_rate: float = _field(0.5, gt=0)
    temperature_min: float = _field(0.5, gt=0)
    temperature_max: float = _field(2.0, gt=0)
    # Loss terms of the user's own added to the loss (jaxrl.registry kind `term`, or module:function), each
    # `(LossInputs, Normalizers, Controls) -> (scalar, metrics)` like the built-in terms of jaxrl.losses.compose.
    terms: tuple[str, ...] = ()
    # Issue 35, policy updates (jaxrl.losses.updates); all off by default.
    gpg_correction: bool = False  # GPG: scale advantages by B / (B - M), M = rows whose advantage is all zero
    drift_coef: float = _field(0.0, ge=0)  # CPGD: coef x KL(pi_old || pi) policy-drift term (0: off)
    bapo_target: float = _field(0.5, gt=0, lt=1)  # BAPO: positive tokens' target share of the contributions
    bapo_low_start: float = _field(0.6, gt=0, lt=1)  # BAPO: c_low starts here and rises by bapo_step_low
    bapo_low_max: float = _field(0.9, gt=0, lt=1)
    bapo_high_start: float = _field(1.2, gt=1)  # BAPO: c_high starts here and rises by bapo_step_high
    bapo_high_max: float = _field(3.0, gt=1)
    bapo_step_low: float = _field(0.05, gt=0)
    bapo_step_high: float = _field(0.05, gt=0)
    # Issue 33, objectives for stale data (jaxrl.losses.stale).
    m2po_tau: float = _field(0.04, gt=0)  # M2PO: bound on the second moment of the kept tokens' log IS ratios
    sapo_tau_pos: float = _field(1.0, gt=0)  # SAPO: gate temperature for A > 0
    sapo_tau_neg: float = _field(1.05, gt=0)  # SAPO: gate temperature for A <= 0
    # Value loss (with a critic).
    value_coef: float = _field(0.5, ge=0)
    value_clip_eps: float | None = _field(0.2, gt=0)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "LossConfig":
        """`LossConfig.from_preset("gspo", clip_eps_high=5e-4)`: a preset with fields overridden (checked)."""
        from jaxrl import configlib

        return configlib.from_dict(cls, {"preset": name, **overrides}, source=f"LossConfig.from_preset({name!r})")

    def validate(self) -> None:
        self.check_pieces("rl.loss")
        if self.kl_estimator == "full" and (self.kl_in_reward or self.kl_target != "ref"):
            raise ValueError("kl_estimator 'full' is a loss term to the reference policy (kl_target: ref, "
                             "kl_in_reward: false); valid estimators otherwise: k1, k2, k3")
        if self.kl_estimator == "k1" and self.kl_coef and not self.kl_in_reward:
            raise ValueError(K1_AS_LOSS)
        if self.kl_in_reward and self.kl_target != "ref":
            raise ValueError("kl_in_reward folds KL(old policy || reference) into the reward; kl_target must be "
                             f"'ref', got {self.kl_target!r}")
        if self.clip_cov_ratio and not self.clip_cov_low < self.clip_cov_high:
            raise ValueError(f"clip_cov_low ({self.clip_cov_low}) must be < clip_cov_high ({self.clip_cov_high})")
        if not self.temperature_min <= self.temperature_max:
            raise ValueError(f"temperature_min ({self.temperature_min}) must be <= temperature_max "
                             f"({self.temperature_max})")

    def pieces(self, prefix: str = "rl.loss") -> dict[str, registry.Entry]:
        """Field -> the registry entry it names (importing `module:function` names)."""
        return {f"{prefix}.objective": registry.resolve("objective", self.objective, f"{prefix}.objective"),
                f"{prefix}.ratio": registry.resolve("ratio", self.ratio, f"{prefix}.ratio"),
                f"{prefix}.advantage.estimator": registry.resolve("advantage", self.advantage.estimator,
                                                                  f"{prefix}.advantage.estimator"),
                **{f"{prefix}.terms[{i}]": registry.resolve("term", name, f"{prefix}.terms[{i}]")
                   for i, name in enumerate(self.terms)}}

    def check_pieces(self, prefix: str = "rl.loss") -> None:
        """The checks that depend on what the named objective, ratio and estimator are (`imports:` are imported
        before the config's sections are built)."""
        pieces = self.pieces(prefix)
        objective, estimator = pieces[f"{prefix}.objective"], pieces[f"{prefix}.advantage.estimator"]
        if objective.info.get("own_ratio") and self.ratio != "token":
            raise registry.RegistryError(
                f"{prefix}.ratio: objective {self.objective!r} forms its own sequence ratio from token ratios; "
                f"ratio must be 'token', got {self.ratio!r}", field=f"{prefix}.ratio")
        if self.dual_clip_c is not None and not objective.info.get("dual_clip"):
            raise registry.RegistryError(f"{prefix}.dual_clip_c: dual_clip_c applies to objective 'ppo_clip' (and "
                                         f"those registered with dual_clip=True), not {self.objective!r}",
                                         field=f"{prefix}.dual_clip_c")
        self._check_update_pieces(objective, prefix)
        if self.advantage.per_component and not estimator.info.get("per_component"):
            raise registry.RegistryError(
                f"{prefix}.advantage.per_component: normalising each reward component is defined for estimator "
                f"'grpo', not {self.advantage.estimator!r}", field=f"{prefix}.advantage.per_component")
        credit = self.advantage.turn_credit
        if credit != "final" and not estimator.info.get("turn_credit"):
            defined = [name for name in registry.names("advantage")
                       if registry.resolve("advantage", name, f"{prefix}.advantage.estimator").info.get("turn_credit")]
            raise registry.RegistryError(
                f"{prefix}.advantage.turn_credit: {credit!r} per-turn credit is not defined for estimator "
                f"{self.advantage.estimator!r}; it is for: {', '.join(defined)} (or set turn_credit: final)",
                field=f"{prefix}.advantage.turn_credit")
        if credit == "discounted" and self.advantage.per_component:
            raise registry.RegistryError(
                f"{prefix}.advantage.turn_credit: discounted per-turn returns are not defined with "
                "per_component normalisation", field=f"{prefix}.advantage.turn_credit")
        if credit == "discounted" and estimator.name == "gae" and self.advantage.turn_gamma != 1.0:
            raise registry.RegistryError(
                f"{prefix}.advantage.turn_gamma: gae discounts per token with {prefix}.advantage.gamma; "
                f"turn_gamma must be 1.0, got {self.advantage.turn_gamma}", field=f"{prefix}.advantage.turn_gamma")
        if credit == "final" and self.advantage.turn_gamma != 1.0:
            raise registry.RegistryError(
                f"{prefix}.advantage.turn_gamma: applies to turn_credit 'discounted' only; with 'final' it must "
                f"be 1.0, got {self.advantage.turn_gamma}", field=f"{prefix}.advantage.turn_gamma")
        if self.kl_in_reward and self.kl_coef and "binary_rewards" in estimator.needs:
            raise registry.RegistryError(
                f"{prefix}.kl_in_reward: estimator {self.advantage.estimator!r} splits each group by "
                "binary outcome rewards and takes no KL penalty in the reward: set kl_in_reward: false",
                field=f"{prefix}.kl_in_reward")

    def _check_update_pieces(self, objective: registry.Entry, prefix: str) -> None:
        """Issue 35's objectives: GPG has no ratio to clip, BAPO's bounds move in (0, 1) and (1, inf), CPGD clips
        the log ratio (so eps_low < 1), and gpg_correction is GPG's."""
        def error(field: str, message: str):
            return registry.RegistryError(f"{prefix}.{field}: {message}", field=f"{prefix}.{field}")

        name = self.objective
        if objective.info.get("ratio_free"):
            if self.ratio != "token":
                raise error("ratio", f"objective {name!r} uses no importance ratio; ratio must be 'token', got "
                                     f"{self.ratio!r}")
            if self.clip_eps_low < 1.0:
                raise error("clip_eps_low", f"objective {name!r} has no ratio clip: clip_eps_low must be >= 1 (no "
                                            f"lower clip), got {self.clip_eps_low} (preset gpg sets it)")
            if self.clip_eps_high != math.inf:
                raise error("clip_eps_high", f"objective {name!r} has no ratio clip: clip_eps_high must be .inf (no "
                                             f"upper clip), got {self.clip_eps_high} (preset gpg sets it)")
        if self.gpg_correction and not objective.info.get("ratio_free"):
            raise error("gpg_correction", f"GPG's advantage correction B / (B - M) is defined for objective 'gpg', "
                                          f"not {name!r}")
        if objective.info.get("log_clip") and self.clip_eps_low >= 1.0:
            raise error("clip_eps_low", f"objective {name!r} clips the log ratio at ln(1 - clip_eps_low): "
                                        f"clip_eps_low must be < 1, got {self.clip_eps_low}")
        if objective.info.get("adaptive_clip"):
            if not self.bapo_low_start <= self.bapo_low_max:
                raise error("bapo_low_max", f"must be >= bapo_low_start ({self.bapo_low_start}), got "
                                            f"{self.bapo_low_max}")
            if not self.bapo_high_start <= self.bapo_high_max:
                raise error("bapo_high_max", f"must be >= bapo_high_start ({self.bapo_high_start}), got "
                                             f"{self.bapo_high_max}")

    # Which per-token inputs the objective needs from the rollout; the loop computes only these.
    @property
    def needs_ref_logp(self) -> bool:
        return self.kl_coef > 0 and self.kl_target == "ref"

    @property
    def needs_entropy(self) -> bool:
        a = self.advantage
        return (self.top_entropy_fraction is not None or a.entropy_bonus_alpha > 0
                or "entropy" in self.estimator_needs)

    @property
    def needs_answers(self) -> bool:
        """The advantage estimator needs each sample's extracted-answer cluster (registered with answers=True:
        seed_grpo)."""
        return bool(registry.resolve("advantage", self.advantage.estimator,
                                     "rl.loss.advantage.estimator").info.get("answers"))

    @property
    def estimator_needs(self) -> frozenset[str]:
        """What the advantage estimator needs (`jaxrl.registry.NEEDS`)."""
        return registry.resolve("advantage", self.advantage.estimator, "rl.loss.advantage.estimator").needs

    @property
    def needs_full_kl(self) -> bool:
        """The exact KL term, for which the trainer recomputes the reference's whole distribution."""
        return self.kl_estimator == "full" and self.kl_coef > 0 and not self.kl_in_reward

    @property
    def adaptive(self) -> bool:
        return self.entropy_target is not None or self.temperature_target_entropy is not None
