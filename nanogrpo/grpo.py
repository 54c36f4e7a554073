"""GRPO's two pieces of math: group-relative advantages, and the clipped policy loss with all of
TRL GRPOTrainer's loss variants, in plain tensor code (reference: TRL 1.16,
trl/trainer/grpo_trainer.py, `_compute_loss` and `_generate_and_score_completions`; the papers
are cited where each variant is).

Owns: `LossConfig` (TRL's GRPOConfig names and defaults, and the rules between them),
`total_reward` and `group_advantages` (rewards -> advantages), and `grpo_step` (one
micro-batch's `LossInputs` -> its scalar loss + metrics; `LossScale` says how micro-batch
losses add up to the optimizer step's): one function for every loss_type.

Leaves out: the options TRL puts around its loss, each off by default: the off-policy sequence
mask, the importance-sampling correction between the sampler and the trainer,
top_entropy_quantile's token mask, the entropy bonus and its adaptive coefficient. Their
settings' rules are LossConfig's; their code is extras/loss_terms.py's, which grpo_step calls
where an option is on, as its caller passes it (`terms`). Computing log-probs is
logprobs.py's (of it, grpo_step uses `kl_divergence`). Out of scope: MoE auxiliary losses.

Does not know about: models, sampling, optimizers, or other processes (the caller gathers rewards
before `group_advantages`, sums `num_items` over ranks, averages gradients, and sums the adaptive
entropy window, loss_terms.entropy_window, over micro-batches and ranks).

Reading order: LossConfig; group_advantages; the per-token losses, one small function per idea:
    importance_ratio (token or GSPO sequence level);
    clipped_surrogate (grpo, dr_grpo, dapo, bnpo, luspo); cispo_loss, sapo_loss, vespo_weight;
    aggregate: the normalizer, which is what really tells the loss types apart;
then LossInputs, LossScale and grpo_step, which puts them together.
Masked positions may hold anything (NaN, inf): inputs are cleaned with torch.where up front, so
neither the loss nor the gradient can see them (x * mask would turn 0 * NaN into NaN).
"""

import math
from dataclasses import dataclass

import torch

from nanogrpo.logprobs import kl_divergence

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
PPO_CLIP_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "luspo")
# the loss types whose micro-batch losses `aggregate` divides by grad_accum (the others divide
# the step's sum by its token count)
PER_MICRO_BATCH = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")
IS_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class LossConfig:
    """Loss settings, named and defaulted as TRL's GRPOConfig (epsilon_high=None means epsilon)."""

    loss_type: str = "dapo"
    beta: float = 0.0  # weight of the k3 KL penalty to the reference model; 0 = no reference model
    epsilon: float = 0.2  # lower clip: ratio >= 1 - epsilon
    # upper clip 1 + epsilon_high (DAPO clip-higher); cispo: absolute cap
    epsilon_high: float | None = None
    delta: float | None = None  # INTELLECT-2 two-sided clip: ratio <= delta also when A < 0
    importance_sampling_level: str = "token"  # "sequence" = GSPO
    max_completion_length: int = 512  # Dr. GRPO's constant normalizer
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_bias_correction_kl: bool = True  # multiply the KL term by the (differentiable) ratio
    top_entropy_quantile: float = 1.0  # 1.0 = off; rho < 1 keeps the top-rho entropy tokens
    # entropy bonus: loss - coef * (masked mean entropy); 0 = off
    entropy_coef: float = 0.0
    # Skywork-OR1's control: coef moves by delta each step toward entropy_target
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2  # nats; the bonus applies only at or below it
    # DeepSeek-V3.2's off-policy sequence mask: None = off
    off_policy_mask_threshold: float | None = None
    # weight each token by pi_trainer / pi_sampler (TRL's name: "vllm" = the sampler)
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"  # one of IS_MODES
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0

    def __post_init__(self):
        def check(ok, name, allowed):
            if not ok:
                raise ValueError(
                    f"LossConfig.{name}={getattr(self, name)!r} is invalid; allowed: {allowed}"
                )

        check(self.loss_type in LOSS_TYPES, "loss_type", ", ".join(LOSS_TYPES))
        check(
            self.importance_sampling_level in IS_LEVELS,
            "importance_sampling_level",
            "'token', 'sequence'",
        )
        check(self.epsilon > 0, "epsilon", "a float > 0")
        check(
            self.epsilon_high is None or self.epsilon_high > 0,
            "epsilon_high",
            "None or a float > 0",
        )
        check(self.delta is None or self.delta > 1, "delta", "None or a float > 1")
        check(self.beta >= 0, "beta", "a float >= 0")
        check(self.max_completion_length >= 1, "max_completion_length", "an int >= 1")
        check(self.sapo_temperature_pos > 0, "sapo_temperature_pos", "a float > 0")
        check(self.sapo_temperature_neg > 0, "sapo_temperature_neg", "a float > 0")
        check(0.0 <= self.top_entropy_quantile <= 1.0, "top_entropy_quantile", "a float in [0, 1]")
        check(
            self.loss_type != "luspo" or self.importance_sampling_level == "sequence",
            "importance_sampling_level",
            "'sequence' with loss_type='luspo' (LUSPO is a sequence-level loss)",
        )
        check(
            self.loss_type != "vespo" or self.importance_sampling_level == "token",
            "importance_sampling_level",
            "'token' with loss_type='vespo' (VESPO builds its own sequence weight "
            "from token ratios)",
        )
        # the options' settings (extras/loss_terms.py): the entropy bonus, OPSM, the correction
        check(
            self.entropy_coef_min <= self.entropy_coef_max,
            "entropy_coef_min",
            f"a float <= entropy_coef_max={self.entropy_coef_max}",
        )
        check(self.entropy_coef_delta >= 0, "entropy_coef_delta", "a float >= 0")
        threshold = self.off_policy_mask_threshold
        check(
            threshold is None or threshold >= 0,
            "off_policy_mask_threshold",
            "None or a float >= 0 (e.g. 0.5)",
        )
        mode = self.vllm_importance_sampling_mode
        check(mode in IS_MODES, "vllm_importance_sampling_mode", ", ".join(IS_MODES))
        low = self.vllm_importance_sampling_clip_min
        high = self.vllm_importance_sampling_clip_max
        check(
            low is None or high is None or low < high,
            "vllm_importance_sampling_clip_min",
            f"None or a float < vllm_importance_sampling_clip_max={high}",
        )
        truncating = self.vllm_importance_sampling_correction and mode.endswith("truncate")
        check(
            not truncating or low is not None or high is not None,
            "vllm_importance_sampling_clip_max",
            "a float (or set vllm_importance_sampling_clip_min) with a *_truncate mode",
        )
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon

    def correction_fits_the_loss(self) -> bool:
        """VESPO folds the sampler correction into its own weight, token by token: with
        loss_type='vespo' TRL refuses a sequence-level vllm_importance_sampling_mode."""
        token_level = self.vllm_importance_sampling_mode.startswith("token")
        correcting = self.vllm_importance_sampling_correction
        return self.loss_type != "vespo" or not correcting or token_level

    def entropy_bonus_on(self) -> bool:
        """Whether the loss carries the entropy bonus (TRL: fixed for the run; the adaptive
        control keeps it on even while its coefficient sits at entropy_coef_min)."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy


# -----------------------------------------------------------------------------
# Advantages (TRL: _generate_and_score_completions; DeepSeekMath arXiv 2402.03300, GDPO)


def nanstd(x, dim=None, keepdim=False):
    """Unbiased (Bessel) std ignoring NaN; NaN where fewer than 2 values are present."""
    dim = tuple(range(x.dim())) if dim is None else dim
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    std = torch.where(count > 1, var, torch.nan).sqrt()
    return std if keepdim else std.squeeze(dim)


def total_reward(rewards, weights=None):
    """The weighted total [N] of a reward matrix [N,K]: sum_k w_k R_k over the scored (non-NaN)
    entries, NaN for a row no function scored. The one definition that the advantages, training
    metrics, evaluation, printed samples, dynamic sampling and sample.py use."""
    K = rewards.shape[1]
    w = rewards.new_ones(K) if weights is None else torch.as_tensor(weights)  # ones: no copy
    w = w.to(dtype=rewards.dtype, device=rewards.device)
    if w.shape != (K,):
        raise ValueError(f"reward_weights has {w.numel()} entries but rewards has K={K} columns")
    total = torch.nansum(rewards * w, dim=1)  # [N]
    unscored = torch.isnan(rewards).all(dim=1)  # [N]
    return torch.where(unscored, torch.nan, total)


def group_advantages(
    rewards,
    num_generations,
    reward_weights=None,
    scale_rewards="group",
    multi_objective_aggregation="sum_then_normalize",
):
    """Advantages [N] from rewards [N] or [N,K] (K reward functions; NaN = not scored).

    Rows i*G .. i*G+G-1 are the G = num_generations completions of prompt i. Pass the
    rewards of the whole generation batch (all ranks), then keep your rank's slice.
    "sum_then_normalize" (GRPO): r = sum_k w_k R_k; A = (r - mean_group r) / (std + 1e-4),
        where std is the group's ("group"), the batch's ("batch"), or no division at all
        ("none"); the mean is always the group's. std is the unbiased std; 1e-4 is added to
        the std, not the variance.
    "normalize_then_sum" (GDPO): z_k = (R_k - mean_group R_k) / (std_group R_k + 1e-4) per
        function, r = sum_k w_k z_k, A = (r - mean_batch r) / (std_batch r + 1e-4)
        (scale_rewards is ignored).
    NaN entries are skipped; a row with no score at all, or a group with < 2 scored rows,
    gets A = 0. scale_rewards also accepts True ("group") and False ("none"), as TRL does.
    """
    rewards = torch.as_tensor(rewards)
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    rewards = rewards[:, None] if rewards.dim() == 1 else rewards  # [N,K]
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N] or [N,K]; got shape {tuple(rewards.shape)}")
    N, K = rewards.shape
    G = num_generations
    if not isinstance(G, int) or G < 1:
        raise ValueError(f"num_generations={G!r} must be an int >= 1")
    if N % G:
        raise ValueError(f"the number of rewards N={N} is not a multiple of num_generations={G}")
    if scale_rewards is True or scale_rewards is False:
        scale_rewards = "group" if scale_rewards else "none"
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(
            f"scale_rewards={scale_rewards!r} is invalid; "
            "allowed: 'group', 'batch', 'none', True, False"
        )
    if multi_objective_aggregation not in AGGREGATIONS:
        raise ValueError(
            f"multi_objective_aggregation={multi_objective_aggregation!r} is invalid; "
            f"allowed: {', '.join(AGGREGATIONS)}"
        )

    unscorable = torch.isnan(rewards).all(dim=1)  # [N]
    # (With G = 1 every std below is NaN and every advantage ends as 0, as TRL's std := 0 gives.)
    if multi_objective_aggregation == "sum_then_normalize":
        r = total_reward(rewards, reward_weights).view(-1, G)  # [N/G,G]
        adv = r - torch.nanmean(r, dim=1, keepdim=True)
        if scale_rewards == "group":
            adv = adv / (nanstd(r, dim=1, keepdim=True) + 1e-4)
        elif scale_rewards == "batch":
            adv = adv / (nanstd(r) + 1e-4)
    else:
        grouped = rewards.view(-1, G, K)  # [N/G,G,K]
        z = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (
            nanstd(grouped, dim=1, keepdim=True) + 1e-4
        )
        # a scored row counts an unnormalisable z as 0; an unscored row stays NaN
        z = torch.where(torch.isnan(z), 0.0, z).view(N, K)  # [N,K]
        z = torch.where(unscorable[:, None], torch.nan, z)
        r = total_reward(z, reward_weights)  # [N]
        adv = (r - torch.nanmean(r)) / (nanstd(r) + 1e-4)
    return torch.nan_to_num(adv.reshape(N), nan=0.0)


# -----------------------------------------------------------------------------
# Per-token losses. Shapes: logps/mask [N,C]; A [N,1]; a ratio is [N,C] (token) or [N,1] (sequence).


def importance_ratio(log_ratio, mask, level):
    """rho = pi_theta / pi_old. token: exp(logp - old) [N,C].
    sequence (GSPO, arXiv 2507.18071): exp(mean over the sequence's tokens of logp - old) [N,1]."""
    if level == "token":
        return torch.exp(log_ratio)
    mean = torch.where(mask, log_ratio, 0).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(
        min=1
    )
    return torch.exp(mean)


def clipped_surrogate(ratio, A, eps_low, eps_high, delta=None):
    """PPO's clipped objective as a loss, L = -min(rho1 * A, clip(rho, 1-eps_low, 1+eps_high) * A).

    GRPO (DeepSeekMath, arXiv 2402.03300) uses eps_low = eps_high; DAPO's clip-higher (arXiv
    2503.14476) raises eps_high; INTELLECT-2's two-sided clip (arXiv 2505.07291) sets rho1 =
    min(rho, delta), bounding the ratio also when A < 0 (plain PPO leaves it unbounded there).
    The clip bounds use the un-delta'd ratio. Returns (L, rho1); rho1 is what the clip metrics
    look at.
    """
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    return -torch.min(ratio * A, clipped * A), ratio


def cispo_loss(ratio, A, logps, eps_high):
    """CISPO (MiniMax-M1, arXiv 2506.13585): L = -sg(min(rho, eps_high)) * A * logp. The IS weight
    is capped (above only, absolute: the default 0.2 caps every on-policy weight at 0.2; TRL
    suggests epsilon_high=5) and detached, so every token keeps a gradient."""
    return -ratio.clamp(max=eps_high).detach() * A * logps


def sapo_loss(ratio, A, tau_pos, tau_neg):
    """SAPO (arXiv 2511.20347): L = -(4/tau) * sigmoid(tau * (rho - 1)) * A, tau = tau_pos if A > 0
    else tau_neg. A smooth gate instead of a hard clip; its slope at rho = 1 is 1, like the ratio's.
    """
    # [N,1]; tau is first made in the default dtype (float32), as TRL does, so fp64 runs match
    # it to 1e-15
    tau = torch.where(A > 0, tau_pos, tau_neg).to(ratio.dtype)
    return -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * A


@torch.no_grad()
def vespo_weight(log_ratio, mask, A, k_pos, lam_pos, k_neg, lam_neg, is_weights=None):
    """VESPO's gamma weight phi [N,1] (as TRL's vespo; VESPO paper, HF papers 2602.10693).

    w = prod_t rho_t (from the clamped SUM of token log-ratios), phi(w) = e^lam * w^k *
    e^(-lam*w), so phi(1) = 1; (k, lam) = (k_pos, lam_pos) if A >= 0 else (k_neg, lam_neg).
    Computed in log space, detached: the loss is L = -phi * A * logp, and phi only rescales each
    sequence's gradient. is_weights [N,C]: token-level sampler corrections, folded into w as
    TRL does (each log clamped to [log 1e-8, 20], summed over all C positions).
    """
    lo = math.log(1e-8)
    s = torch.where(mask, log_ratio.clamp(-20, 20), 0).sum(-1, keepdim=True)  # [N,1]
    if is_weights is not None:
        s = s + is_weights.log().clamp(lo, 20).sum(-1, keepdim=True)
    log_w = s.clamp(lo, 20)
    k = torch.where(A >= 0, k_pos, k_neg)
    lam = torch.where(A >= 0, lam_pos, lam_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def aggregate(per_token_loss, mask, cfg, num_items, grad_accum, world_size, steps_per_generation):
    """One micro-batch's loss from L [N,C] (TRL: the loss_type branches of _compute_loss),
    scaled so that summing over the grad_accum micro-batches and averaging over the
    world_size ranks gives the loss type's definition:
      grpo, sapo   mean over sequences of (sum_t L / |o|)  (GRPO; per-sequence token mean)
      bnpo         sum L / local active tokens               (TRL's batch-normalized variant)
      dr_grpo      sum L / (N * max_completion_length)       (Dr. GRPO, arXiv 2503.20783)
      luspo        mean over sequences of sum_t L            (LUSPO, HF papers 2602.05261:
                                                              each sequence weighted by |o|)
      dapo, cispo, vespo   sum L / (num_items / world_size * grad_accum / steps_per_generation)
                           = a token mean over the whole step (DAPO's token-level loss)
    """
    L = torch.where(mask, per_token_loss, 0)  # [N,C]
    tokens = mask.sum(-1).clamp(min=1)  # [N]
    if cfg.loss_type in ("grpo", "sapo"):
        return (L.sum(-1) / tokens).mean() / grad_accum
    if cfg.loss_type == "bnpo":
        return L.sum() / mask.sum().clamp(min=1) / grad_accum
    if cfg.loss_type == "dr_grpo":
        return L.sum() / (L.shape[0] * cfg.max_completion_length) / grad_accum
    if cfg.loss_type == "luspo":
        return L.sum(-1).mean() / grad_accum
    n = torch.as_tensor(num_items, dtype=L.dtype, device=L.device).clamp(min=1)
    return L.sum() / (n / world_size * grad_accum / steps_per_generation)


# -----------------------------------------------------------------------------
# The step


@dataclass
class LossInputs:
    """One micro-batch's tensors, [N,C] unless said; masked positions may hold anything."""

    logps: torch.Tensor  # current policy, with grad
    advantages: torch.Tensor  # [N]
    completion_mask: torch.Tensor  # 1 = a completion token that counts
    old_logps: torch.Tensor | None = None  # None: on-policy (ratio exactly 1)
    ref_logps: torch.Tensor | None = None  # None with beta == 0
    # needed by top_entropy_quantile < 1 and the entropy bonus (then with their gradient:
    # fast/logprobs.py gives one only with entropy_grad), else only logged
    entropies: torch.Tensor | None = None
    # the sampler's log-prob of each token it drew, for the sampler correction and OPSM;
    # None: the sampler is the old policy
    sampling_logps: torch.Tensor | None = None
    # the trainer's side of that correction, its log-probs with the weights that sampled,
    # where neither old_logps nor logps (with dropout) can stand for them; None = old
    trainer_logps: torch.Tensor | None = None


@dataclass
class LossScale:
    """How micro-batch losses add up to the optimizer step's (TRL's normalizers: see aggregate)."""

    # active tokens over the whole generation batch, all ranks (with steps_per_generation ==
    # grad_accum, the optimizer step's); only dapo, cispo and vespo use it. None: "this
    # micro-batch is the whole step", right only when grad_accum == world_size == 1
    num_items: int | torch.Tensor | None = None
    grad_accum: int = 1  # micro-batches summed per optimizer step
    world_size: int = 1  # ranks whose gradients are averaged
    steps_per_generation: int | None = None  # None = grad_accum


def grpo_step(
    inputs: LossInputs,
    cfg: LossConfig,
    scale: LossScale | None = None,
    *,
    terms=None,
    entropy_coef: float | None = None,
    read_metrics: bool = True,
) -> tuple[torch.Tensor, dict]:
    """One micro-batch's GRPO loss (a scalar to .backward()) and its metrics (plain floats).
    scale None: LossScale(), this micro-batch is the whole step. terms: the options' code
    (the module nanogrpo.extras.loss_terms), needed when cfg turns one on. entropy_coef: the
    coefficient this step applies (applied_entropy_coef); None = cfg.entropy_coef. The adaptive
    control's window is the caller's to sum (entropy_window). read_metrics=False: 0-dim tensor
    metrics."""
    scale = LossScale() if scale is None else scale
    _check_inputs(inputs, cfg, scale, terms)
    m = inputs.completion_mask.bool()
    logps = torch.where(m, inputs.logps, 0)  # the gradient into masked slots is now exactly 0
    old = logps.detach() if inputs.old_logps is None else torch.where(m, inputs.old_logps, 0)
    A = inputs.advantages[:, None]  # [N,1]

    log_ratio = logps - old  # [N,C]
    ratio = importance_ratio(log_ratio, m, cfg.importance_sampling_level)  # [N,C] or [N,1]
    sampling = behavior = is_weights = None  # is_weights: the sampler correction, [N,C] or [N,1]
    if inputs.sampling_logps is not None:
        sampling = torch.where(m, inputs.sampling_logps, 0)
        # the trainer's log-probs with the weights that sampled
        trainer = inputs.trainer_logps
        behavior = old if trainer is None else torch.where(m, trainer, 0)
        if cfg.vllm_importance_sampling_correction:
            is_weights = terms.sampler_importance_weights(behavior, sampling, m, cfg)
    ratio_1, phi = ratio, None  # ratio_1: the ratio the clip metrics look at
    if cfg.loss_type in PPO_CLIP_TYPES:
        loss, ratio_1 = clipped_surrogate(ratio, A, cfg.epsilon, cfg.epsilon_high, cfg.delta)
    elif cfg.loss_type == "cispo":
        loss = cispo_loss(ratio, A, logps, cfg.epsilon_high)
    elif cfg.loss_type == "sapo":
        loss = sapo_loss(ratio, A, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
    else:  # vespo
        k_lam = (cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg)
        weights = None if is_weights is None else terms.vespo_sampler_weights(is_weights, cfg)
        phi = vespo_weight(log_ratio, m, A, *k_lam, weights)
        loss = -phi * A * logps
    loss = loss.expand_as(logps)  # [N,C] (sequence-level losses are [N,1])

    if cfg.off_policy_mask_threshold is not None:
        sampled_by = old if sampling is None else sampling
        keep = terms.off_policy_mask(A, logps, sampled_by, m, cfg.off_policy_mask_threshold)
        loss = torch.where(keep, loss, 0)
    bonus_mask = m  # the tokens the entropy bonus acts on
    entropies = None if inputs.entropies is None else torch.where(m, inputs.entropies, 0)
    if cfg.top_entropy_quantile < 1:
        bonus_mask = terms.high_entropy_mask(entropies.detach(), m, cfg.top_entropy_quantile)
        loss = torch.where(bonus_mask, loss, 0)
    if is_weights is not None and cfg.loss_type != "vespo":
        loss = loss * is_weights
    kl = None
    if cfg.beta != 0:
        kl = kl_divergence(logps, torch.where(m, inputs.ref_logps, 0), kind="k3")  # [N,C], >= 0
        if cfg.use_bias_correction_kl:
            # k3's gradient is biased off-policy; the ratio corrects it (DeepSeek-V3.2)
            kl = kl * ratio
        loss = loss + cfg.beta * kl

    num_items = m.sum() if scale.num_items is None else scale.num_items
    spg = scale.grad_accum if scale.steps_per_generation is None else scale.steps_per_generation
    total = aggregate(loss, m, cfg, num_items, scale.grad_accum, scale.world_size, spg)

    metrics = {}
    if cfg.entropy_bonus_on():
        # TRL's policy_loss: the loss before the bonus and the grad_accum division
        unscaled = scale.grad_accum if cfg.loss_type in PER_MICRO_BATCH else 1
        metrics["policy_loss"] = total.detach() * unscaled
        coef = cfg.entropy_coef if entropy_coef is None else entropy_coef
        total = total - coef * terms.entropy_bonus(entropies, bonus_mask, scale.grad_accum)
    if sampling is not None:  # the mismatch itself, whether or not a correction is on
        metrics.update(raw_sampler_ratios(behavior, sampling, m))
    if is_weights is not None:
        metrics.update(terms.importance_sampling_metrics(behavior, sampling, is_weights, m))
    metrics.update(_loss_metrics(cfg, m, A, ratio_1, kl, entropies, phi))
    if read_metrics:
        metrics = {k: float(v) for k, v in metrics.items()}
    return total, metrics


def _check_inputs(inputs, cfg, scale, terms):
    """Shapes, the inputs cfg needs, scale's counts, and the options' code if one is on."""
    correcting = inputs.sampling_logps is not None and cfg.vllm_importance_sampling_correction
    options = cfg.off_policy_mask_threshold is not None or cfg.top_entropy_quantile < 1
    if terms is None and (correcting or options or cfg.entropy_bonus_on()):
        raise ValueError(
            "an option around the loss is on (the sampler correction with sampling_logps, "
            "off_policy_mask_threshold, top_entropy_quantile < 1 or the entropy bonus): pass its "
            "code, grpo_step(..., terms=nanogrpo.extras.loss_terms)"
        )
    logps = inputs.logps
    if logps.dim() != 2:
        raise ValueError(f"logps must be [N,C]; got shape {tuple(logps.shape)}")
    N = logps.shape[0]
    for name in (
        "completion_mask",
        "old_logps",
        "ref_logps",
        "entropies",
        "sampling_logps",
        "trainer_logps",
    ):
        x = getattr(inputs, name)
        if x is not None and x.shape != logps.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but logps has {tuple(logps.shape)}; "
                "both must be [N,C]"
            )
    if inputs.advantages.shape != (N,):
        raise ValueError(
            f"advantages must be [N] = [{N}] (one per sequence); "
            f"got {tuple(inputs.advantages.shape)}"
        )
    if cfg.beta != 0 and inputs.ref_logps is None:
        raise ValueError(
            f"ref_logps is None but cfg.beta={cfg.beta}; pass reference log-probs or set beta=0"
        )
    if cfg.top_entropy_quantile < 1 and inputs.entropies is None:
        raise ValueError(f"cfg.top_entropy_quantile={cfg.top_entropy_quantile} needs entropies")
    if cfg.entropy_bonus_on() and inputs.entropies is None:
        raise ValueError("the entropy bonus (entropy_coef, use_adaptive_entropy) needs entropies")
    for name in ("grad_accum", "world_size", "steps_per_generation"):
        v = getattr(scale, name)
        if v is not None and v < 1:  # (steps_per_generation None = grad_accum)
            raise ValueError(f"{name}={v} must be >= 1")


@torch.no_grad()
def raw_sampler_ratios(trainer_logps, sampling_logps, m) -> dict:
    """How far the sampler's probabilities are from the trainer's, before any correction clips or
    masks them: min, mean and max of pi_trainer / pi_sampler per token (over m's tokens) and per
    sequence (exp of its summed log difference, over rows with tokens), as 0-dim float64 tensors
    (1 where there is nothing to measure). Inputs [N,C], 0 on masked slots. No host sync."""
    diff = (trainer_logps - sampling_logps).double()  # [N,C]
    out = {}
    for level, log_r, keep in (("token", diff, m), ("sequence", diff.sum(-1), m.any(-1))):
        r, n = log_r.exp(), keep.sum()
        values = {
            "min": torch.where(keep, r, math.inf).min(),
            "mean": torch.where(keep, r, 0).sum() / n.clamp(min=1),
            "max": torch.where(keep, r, -math.inf).max(),
        }
        for stat, v in values.items():
            key = f"sampling/raw_importance_sampling_ratio/{level}/{stat}"
            out[key] = torch.where(n > 0, v, torch.ones_like(v))
    return out


def _loss_metrics(cfg, m, A, ratio_1, kl, entropies, phi):
    """TRL's metrics of the loss, as 0-dim tensors: the KL, the entropy, and how often the loss
    type's clip or weight acted (ratio_1: the ratio the clip looked at)."""
    metrics = {}
    if kl is not None:
        metrics["kl"] = _masked_mean(kl, m)
    if entropies is not None:
        metrics["entropy"] = _masked_mean(entropies, m)
    if cfg.loss_type in PPO_CLIP_TYPES:
        low = (ratio_1 < 1 - cfg.epsilon) & (A < 0)
        high = (ratio_1 > 1 + cfg.epsilon_high) & (A > 0)
        metrics["clip_ratio/low_mean"] = _masked_mean(low, m)
        metrics["clip_ratio/high_mean"] = _masked_mean(high, m)
        metrics["clip_ratio/region_mean"] = _masked_mean(low | high, m)
        metrics["clip_ratio/low_min"] = _nan_reduce(_seq_mean(low, m), torch.min)
        metrics["clip_ratio/high_max"] = _nan_reduce(_seq_mean(high, m), torch.max)
    elif cfg.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = _masked_mean((ratio_1 > cfg.epsilon_high) & (A > 0), m)
    elif cfg.loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = phi.mean()
    return metrics


def _masked_mean(x, m):
    """Mean over active tokens of x [N,C]; for a per-sequence x [N,1], the mean over sequences."""
    x = x.double()
    if x.shape[1] == 1:
        return x.mean()
    return torch.where(m, x, 0).sum() / m.sum().clamp(min=1)


def _seq_mean(x, m):
    """Per-sequence mean [N] of x over active tokens (NaN for an empty row)."""
    x = x.double()
    return x[:, 0] if x.shape[1] == 1 else torch.where(m, x, 0).sum(-1) / m.sum(-1)


def _nan_reduce(x, op):
    """torch.min or max of x [N]'s non-NaN values (NaN if none), a 0-dim tensor, no host read."""
    if x.numel() == 0:
        return torch.tensor(torch.nan, dtype=x.dtype, device=x.device)
    unpicked = math.inf if op is torch.min else -math.inf
    picked = op(torch.where(torch.isnan(x), unpicked, x))
    return torch.where(torch.isnan(x).all(), torch.nan, picked)
