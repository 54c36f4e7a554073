"""GRPO's two pieces of math: group-relative advantages, and the clipped policy loss with all of
TRL GRPOTrainer's loss variants, in plain tensor code (reference: TRL 1.16,
trl/trainer/grpo_trainer.py, `_compute_loss` and `_generate_and_score_completions`; the papers
are cited where each variant is).

Owns: `LossConfig` (TRL's GRPOConfig names and defaults of the loss, and the rules between
them), `total_reward` and `group_advantages` (rewards -> advantages), `grpo_step` (one
micro-batch's `LossInputs` -> its scalar loss + metrics; `LossScale` says how micro-batch losses
add up to the optimizer step's): one function for every loss_type, and `sampler_correction`
(the importance-sampling correction between the sampler and the trainer, on by default, whose
weights the caller hands to grpo_step).

Leaves out: the options TRL puts around its loss, each off by default: the off-policy sequence
mask, top_entropy_quantile's token mask, the entropy bonus and its adaptive coefficient. Their
settings, rules and code are extras/loss_terms.py's; what they change reaches grpo_step as plain
tensors (LossInputs.keep), and the bonus is added to its result. Computing log-probs is
logprobs.py's (of it, grpo_step uses `kl_divergence`). Out of scope: MoE auxiliary losses.

Does not know about: models, sampling, optimizers, or other processes (the caller gathers rewards
before `group_advantages`, sums `num_items` over ranks and averages gradients).

Reading order: LossConfig; group_advantages; the per-token losses, one small function per idea:
    importance_ratio (token or GSPO sequence level);
    clipped_surrogate (grpo, dr_grpo, dapo, bnpo, luspo); cispo_loss, sapo_loss, vespo_weight,
    and policy_loss, which picks the loss type's;
    aggregate: the normalizer, which is what really tells the loss types apart;
then LossInputs, LossScale and grpo_step, which puts them together; sampler_correction last.
Masked positions may hold anything (NaN, inf): inputs are cleaned with torch.where up front, so
neither the loss nor the gradient can see them (x * mask would turn 0 * NaN into NaN).
"""

import math
from dataclasses import dataclass

import torch

from nanogrpo.logprobs import kl_divergence

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
PPO_CLIP_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "luspo")
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
    # weight each token by pi_trainer / pi_sampler (TRL's name: "vllm" = the sampler)
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"  # one of IS_MODES
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0

    def __post_init__(self):
        mode = self.vllm_importance_sampling_mode
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        truncating = self.vllm_importance_sampling_correction and mode.endswith("truncate")
        rules = [  # (holds, the field it names, what the field allows)
            (self.loss_type in LOSS_TYPES, "loss_type", ", ".join(LOSS_TYPES)),
            (
                self.importance_sampling_level in IS_LEVELS,
                "importance_sampling_level",
                "'token', 'sequence'",
            ),
            (self.epsilon > 0, "epsilon", "a float > 0"),
            (
                self.epsilon_high is None or self.epsilon_high > 0,
                "epsilon_high",
                "None or a float > 0",
            ),
            (self.delta is None or self.delta > 1, "delta", "None or a float > 1"),
            (self.beta >= 0, "beta", "a float >= 0"),
            (self.max_completion_length >= 1, "max_completion_length", "an int >= 1"),
            (self.sapo_temperature_pos > 0, "sapo_temperature_pos", "a float > 0"),
            (self.sapo_temperature_neg > 0, "sapo_temperature_neg", "a float > 0"),
            (
                self.loss_type != "luspo" or self.importance_sampling_level == "sequence",
                "importance_sampling_level",
                "'sequence' with loss_type='luspo' (LUSPO is a sequence-level loss)",
            ),
            (
                self.loss_type != "vespo" or self.importance_sampling_level == "token",
                "importance_sampling_level",
                "'token' with loss_type='vespo' (VESPO builds its own sequence weight from "
                "token ratios)",
            ),
            # the sampler correction's (sampler_correction)
            (mode in IS_MODES, "vllm_importance_sampling_mode", ", ".join(IS_MODES)),
            (
                low is None or high is None or low < high,
                "vllm_importance_sampling_clip_min",
                f"None or a float < vllm_importance_sampling_clip_max={high}",
            ),
            (
                not truncating or low is not None or high is not None,
                "vllm_importance_sampling_clip_max",
                "a float (or set vllm_importance_sampling_clip_min) with a *_truncate mode",
            ),
        ]
        for holds, name, allowed in rules:
            if not holds:
                value = getattr(self, name)
                raise ValueError(f"LossConfig.{name}={value!r} is invalid; allowed: {allowed}")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon


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


def policy_loss(cfg, ratio, log_ratio, A, logps, mask, weights=None):
    """The loss type's per-token loss -> (L [N,C], the ratio its clip metrics look at, VESPO's
    phi or None). weights: the sampler correction, which VESPO folds into phi."""
    ratio_1, phi = ratio, None
    if cfg.loss_type in PPO_CLIP_TYPES:
        loss, ratio_1 = clipped_surrogate(ratio, A, cfg.epsilon, cfg.epsilon_high, cfg.delta)
    elif cfg.loss_type == "cispo":
        loss = cispo_loss(ratio, A, logps, cfg.epsilon_high)
    elif cfg.loss_type == "sapo":
        loss = sapo_loss(ratio, A, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
    else:  # vespo
        k_lam = (cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg)
        phi = vespo_weight(log_ratio, mask, A, *k_lam, weights)
        loss = -phi * A * logps
    return loss.expand_as(logps), ratio_1, phi  # sequence-level losses are [N,1]


def aggregate(per_token_loss, mask, cfg, scale):
    """One micro-batch's loss from L [N,C] (TRL: the loss_type branches of _compute_loss),
    scaled (LossScale) so that summing over the grad_accum micro-batches and averaging over the
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
    grad_accum = scale.grad_accum
    if cfg.loss_type in ("grpo", "sapo"):
        return (L.sum(-1) / tokens).mean() / grad_accum
    if cfg.loss_type == "bnpo":
        return L.sum() / mask.sum().clamp(min=1) / grad_accum
    if cfg.loss_type == "dr_grpo":
        return L.sum() / (L.shape[0] * cfg.max_completion_length) / grad_accum
    if cfg.loss_type == "luspo":
        return L.sum(-1).mean() / grad_accum
    spg = grad_accum if scale.steps_per_generation is None else scale.steps_per_generation
    n = mask.sum() if scale.num_items is None else scale.num_items
    n = torch.as_tensor(n, dtype=L.dtype, device=L.device).clamp(min=1)
    return L.sum() / (n / scale.world_size * grad_accum / spg)


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
    entropies: torch.Tensor | None = None  # logged when given
    # the sampler correction's weights (sampler_correction), [N,C] or [N,1]; None = off
    weights: torch.Tensor | None = None
    # bool [N,C] or [N,1]: the tokens the options let train (extras/loss_terms.py); None = all
    keep: torch.Tensor | None = None


@dataclass
class LossScale:
    """How micro-batch losses add up to the optimizer step's (TRL's normalizers: see aggregate)."""

    # active tokens over the whole generation batch, all ranks (with steps_per_generation ==
    # grad_accum, the optimizer step's); only dapo, cispo and vespo use it. None: "this
    # micro-batch is the whole step", right only when grad_accum == world_size == 1
    num_items: int | torch.Tensor | None = None
    grad_accum: float = 1  # micro-batches summed per step (token_budget: over a forward's share)
    world_size: int = 1  # ranks whose gradients are averaged
    steps_per_generation: int | None = None  # None = grad_accum


def grpo_step(
    inputs: LossInputs,
    cfg: LossConfig,
    scale: LossScale | None = None,
    *,
    read_metrics: bool = True,
) -> tuple[torch.Tensor, dict]:
    """One micro-batch's GRPO loss (a scalar to .backward()) and its metrics (plain floats;
    read_metrics=False: 0-dim tensors). scale None: LossScale(), this micro-batch is the step.
    The options hand in what they change as tensors: `weights` and `keep` (extras/loss_terms.py
    adds its entropy bonus to the result)."""
    scale = LossScale() if scale is None else scale
    _check_inputs(inputs, cfg, scale)
    m = inputs.completion_mask.bool()
    logps = torch.where(m, inputs.logps, 0)  # the gradient into masked slots is now exactly 0
    old = logps.detach() if inputs.old_logps is None else torch.where(m, inputs.old_logps, 0)
    A = inputs.advantages[:, None]  # [N,1]
    log_ratio = logps - old  # [N,C]
    ratio = importance_ratio(log_ratio, m, cfg.importance_sampling_level)  # [N,C] or [N,1]
    loss, ratio_1, phi = policy_loss(cfg, ratio, log_ratio, A, logps, m, inputs.weights)
    if inputs.keep is not None:
        loss = torch.where(inputs.keep, loss, 0)
    if inputs.weights is not None and cfg.loss_type != "vespo":
        loss = loss * inputs.weights
    kl = None
    if cfg.beta != 0:
        kl = kl_divergence(logps, torch.where(m, inputs.ref_logps, 0), kind="k3")  # [N,C], >= 0
        if cfg.use_bias_correction_kl:  # k3's gradient is biased off-policy (DeepSeek-V3.2)
            kl = kl * ratio
        loss = loss + cfg.beta * kl
    total = aggregate(loss, m, cfg, scale)
    entropies = None if inputs.entropies is None else torch.where(m, inputs.entropies, 0)
    metrics = _loss_metrics(cfg, m, A, ratio_1, kl, entropies, phi)
    return total, {k: float(v) for k, v in metrics.items()} if read_metrics else metrics


def _check_inputs(inputs, cfg, scale):
    """Shapes, the inputs cfg needs, scale's counts."""
    logps = inputs.logps
    if logps.dim() != 2:
        raise ValueError(f"logps must be [N,C]; got shape {tuple(logps.shape)}")
    N = logps.shape[0]
    for name in ("completion_mask", "old_logps", "ref_logps", "entropies"):
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
    for name in ("grad_accum", "world_size", "steps_per_generation"):
        v = getattr(scale, name)
        if v is not None and v < 1:  # (steps_per_generation None = grad_accum)
            raise ValueError(f"{name}={v} must be >= 1")


# -----------------------------------------------------------------------------
# The sampler correction (TRL's vllm_importance_sampling_*: the "vllm" engine is nanogrpo's own
# sampler), on by default: the caller hands its weights to grpo_step as LossInputs.weights


def sampler_correction(inputs, sampling_logps, cfg, trainer_logps=None):
    """-> (the correction's weights [N,C] or [N,1], None when it is off; the log-probs it
    compares, (the trainer's, the sampler's) [N,C] with 0 off the mask, from which
    run/metrics.py measures the mismatch). sampling_logps [N,C]: the sampler's log-prob of each
    token it drew (None: the sampler is the old policy, nothing to compare); trainer_logps: the
    trainer's with the weights that sampled, where neither old_logps nor logps (with dropout) can
    stand for them."""
    if sampling_logps is None:
        return None, None
    m = inputs.completion_mask.bool()
    sampling = torch.where(m, sampling_logps, 0)
    trainer = inputs.old_logps if trainer_logps is None else trainer_logps
    trainer = torch.where(m, inputs.logps.detach() if trainer is None else trainer, 0)
    if not cfg.vllm_importance_sampling_correction:
        return None, (trainer, sampling)
    if cfg.loss_type == "vespo" and not cfg.vllm_importance_sampling_mode.startswith("token"):
        raise ValueError(
            f"vllm_importance_sampling_mode={cfg.vllm_importance_sampling_mode!r}: "
            "loss_type='vespo' folds token-level weights into its own: use token_truncate or "
            "token_mask, or vllm_importance_sampling_correction=False (as TRL)"
        )
    return importance_weights(trainer, sampling, m, cfg), (trainer, sampling)


def importance_weights(trainer_logps, sampling_logps, mask, cfg):
    """TRL's vllm_importance_sampling_ratio: how much more likely the trainer finds each sampled
    token than the sampler did, w = pi_trainer / pi_sampler. Ratios of 1 mean the two agree;
    bf16, another kernel or a compiled decode step move them. Modes:
      token_*     one w per token, [N,C];
      sequence_*  one w per sequence, exp(sum over its tokens of the log difference), [N,1];
      *_truncate  w clamped to [clip_min, clip_max] (TIS);
      *_mask      w set to 0 outside [clip_min, clip_max] (MIS); None = no bound.
    Detached: a constant weight on each token's loss. Masked positions weigh 1."""
    diff = torch.where(mask, trainer_logps.detach() - sampling_logps, 0)  # [N,C]
    mode = cfg.vllm_importance_sampling_mode
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)  # [N,1]
    w = torch.exp(diff)
    low, high = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        return w.clamp(min=low, max=high)
    outside = torch.zeros_like(w, dtype=torch.bool)
    if low is not None:
        outside = outside | (w < low)
    if high is not None:
        outside = outside | (w > high)
    return w.masked_fill(outside, 0.0)


@torch.no_grad()
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
