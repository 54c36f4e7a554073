"""The algorithm options TRL GRPOTrainer puts around its loss (reference: TRL 1.16,
trl/trainer/grpo_trainer.py, `_compute_loss` and `_generate_and_score_completions`), each off by
default. grpo.py's `grpo_step` calls them where an option is on, from the module its caller
passes as `terms` (train.py passes this one); train.py runs the entropy control between optimizer
steps (`applied_entropy_coef`, `entropy_window`, `update_entropy_coef`). The rules of their
settings are LossConfig's.

Owns: `off_policy_mask` (DeepSeek-V3.2's OPSM, off_policy_mask_threshold),
`sampler_importance_weights` and `importance_sampling_metrics` (the correction between the
sampler and the trainer, TRL's vllm_importance_sampling_*: here the "vllm" engine is nanogrpo's
own sampler), `vespo_sampler_weights` and `VESPO_NEEDS_TOKENS` (which of those corrections
VESPO can take), `high_entropy_mask` (top_entropy_quantile), and the entropy bonus:
`entropy_bonus`, `entropy_window`, `applied_entropy_coef`, `next_entropy_coef` and
`update_entropy_coef`, which moves a Trainer's coefficient after a step (entropy_coef,
use_adaptive_entropy).

Does not know about: the loss variants and how micro-batch losses add up (grpo.py), TrainConfig
(`cfg` is any object with LossConfig's fields) or log-probs (logprobs.py). Its one collective is
update_entropy_coef's sum of a step's entropy_window over ranks.

Choices:
- Inputs are [N,C] with masked positions already cleaned (grpo_step does it), except
  entropy_window's, which the caller passes as they are: it looks only at the mask's tokens.
- The sampler correction and OPSM are detached: they weigh or drop a token's loss, they carry
  no gradient of their own.
- The entropy bonus is one mean over the micro-batch's bonus tokens divided by grad_accum,
  whatever the loss type, as TRL does; its adaptive coefficient (Skywork-OR1) moves once per
  optimizer step from the step's mean entropy, which entropy_window's [sum, count] give.
"""

import torch

from nanogrpo import distributed as dist

VESPO_NEEDS_TOKENS = (
    "loss_type='vespo' folds token-level weights into its own: use token_truncate or "
    "token_mask, or vllm_importance_sampling_correction=False (as TRL)"
)


# -----------------------------------------------------------------------------
# Which sequences count, how the sampler's tokens are reweighted


def off_policy_mask(A, logps, sampling_logps, mask, threshold):
    """DeepSeek-V3.2's off-policy sequence mask (OPSM, arXiv 2512.02556, eq. 9) [N,1] bool:
    drop a sequence whose advantage is negative and whose mean per-token KL from the policy
    that sampled it to the current one, mean_t (log pi_sampling - log pi_theta), exceeds
    threshold. A [N,1]; logps, sampling_logps, mask [N,C]."""
    kl = torch.where(mask, sampling_logps - logps.detach(), 0)  # [N,C]
    mean_kl = kl.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return (A >= 0) | (mean_kl <= threshold)


def sampler_importance_weights(old_logps, sampling_logps, mask, cfg):
    """TRL's vllm_importance_sampling_ratio: how much more likely the trainer finds each sampled
    token than the sampler did, w = pi_old / pi_sampler (pi_old: the trainer's log-probs with
    the weights that sampled). Ratios of 1 mean the two engines agree; bf16, another kernel or
    a compiled decode step move them. Modes (vllm_importance_sampling_mode):
      token_*     one w per token, [N,C];
      sequence_*  one w per sequence, exp(sum over its tokens of the log difference), [N,1];
      *_truncate  w clamped to [clip_min, clip_max] (TIS);
      *_mask      w set to 0 outside [clip_min, clip_max] (MIS); None = no bound.
    Detached: a constant weight on each token's loss. Masked positions weigh 1."""
    diff = torch.where(mask, old_logps.detach() - sampling_logps, 0)  # [N,C]
    mode = cfg.vllm_importance_sampling_mode
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)  # [N,1]
    w = torch.exp(diff)
    low = cfg.vllm_importance_sampling_clip_min
    high = cfg.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        return w.clamp(min=low, max=high)
    outside = torch.zeros_like(w, dtype=torch.bool)
    if low is not None:
        outside = outside | (w < low)
    if high is not None:
        outside = outside | (w > high)
    return w.masked_fill(outside, 0.0)


def vespo_sampler_weights(is_weights, cfg):
    """The sampler correction VESPO folds into its weight: token-level ones only
    (cfg.correction_fits_the_loss); a sequence-level one is refused, as TRL does."""
    if is_weights is not None and not cfg.correction_fits_the_loss():
        raise ValueError(
            f"vllm_importance_sampling_mode={cfg.vllm_importance_sampling_mode!r}: "
            + VESPO_NEEDS_TOKENS
        )
    return is_weights


@torch.no_grad()
def importance_sampling_metrics(old_logps, sampling_logps, is_weights, mask):
    """TRL's sampling/* metrics of one batch: |log pi_old - log pi_sampler| over its tokens
    (mean, max) and the correction weights (min, mean, max; per sequence or per token), as
    0-dim float64 tensors on the inputs' device."""
    delta = (old_logps - sampling_logps).abs()[mask].double()
    w = is_weights.flatten() if is_weights.shape[1] == 1 else is_weights[mask]
    w = w.double()
    if delta.numel() == 0:
        delta = torch.zeros(1, dtype=torch.float64, device=delta.device)
    if w.numel() == 0:
        w = torch.zeros(1, dtype=torch.float64, device=w.device)
    return {
        "sampling/sampling_logp_difference/mean": delta.mean(),
        "sampling/sampling_logp_difference/max": delta.max(),
        "sampling/importance_sampling_ratio/min": w.min(),
        "sampling/importance_sampling_ratio/mean": w.mean(),
        "sampling/importance_sampling_ratio/max": w.max(),
    }


# -----------------------------------------------------------------------------
# Which tokens train: top_entropy_quantile ("Beyond the 80/20 rule", arXiv 2506.01939)


def high_entropy_mask(entropies, mask, quantile):
    """Keep [N,C] the tokens whose entropy is in the top `quantile` fraction of this call's active
    tokens (ties at the threshold kept). The threshold is the (1 - quantile) quantile, linear
    interpolation, of the active entropies in float32."""
    active = entropies[mask].float()
    if active.numel() == 0:
        return torch.zeros_like(mask)
    return (entropies >= torch.quantile(active, 1 - quantile)) & mask


# -----------------------------------------------------------------------------
# The entropy bonus (TRL's entropy_coef; Skywork-OR1's adaptive control, arXiv 2505.22312)


def entropy_bonus(entropies, mask, grad_accum):
    """The mean entropy [scalar] over the tokens mask [N,C] keeps, divided by grad_accum only:
    the same meaning for every loss type. The loss subtracts coef times it."""
    total = torch.where(mask, entropies, 0).sum()
    return total / mask.sum().clamp(min=1) / grad_accum


@torch.no_grad()
def entropy_window(entropies, completion_mask, cfg):
    """[2] float64 = [sum of the entropies, number of tokens] over the tokens the bonus acts on
    (completion_mask's, or high_entropy_mask's with cfg.top_entropy_quantile < 1), detached:
    one micro-batch's share of the adaptive control's window. The sum is taken in the
    entropies' dtype. entropies, completion_mask [N,C]; masked positions may hold anything."""
    mask = completion_mask.bool()
    entropies = torch.where(mask, entropies, 0)
    if cfg.top_entropy_quantile < 1:
        mask = high_entropy_mask(entropies, mask, cfg.top_entropy_quantile)
    total = torch.where(mask, entropies, 0).sum()
    return torch.stack([total.double(), mask.sum().double()])


def applied_entropy_coef(cfg, coef, last_entropy):
    """The coefficient this step's micro-batches apply: `coef` as it stood after the last step;
    adaptive control applies it only while the last step's entropy was at or below
    entropy_target (last_entropy = inf before the first step: no bonus yet)."""
    if cfg.use_adaptive_entropy and last_entropy > cfg.entropy_target:
        return 0.0
    return coef


def next_entropy_coef(cfg, coef, entropy):
    """The adaptive coefficient after a step whose mean entropy (all ranks, all micro-batches,
    the bonus's tokens: entropy_window) was `entropy`: one delta up when at or below
    entropy_target (to push it back up), one down otherwise, kept in [entropy_coef_min,
    entropy_coef_max]."""
    if entropy <= cfg.entropy_target:
        return min(coef + cfg.entropy_coef_delta, cfg.entropy_coef_max)
    return max(coef - cfg.entropy_coef_delta, cfg.entropy_coef_min)


def update_entropy_coef(t, window: torch.Tensor):
    """Adaptive entropy control after a step of trainer.py's Trainer t:
    window = [entropy sum, token count] of the step's micro-batches
    (entropy_window), summed over ranks here."""
    window = dist.all_reduce_sum(window, t.info)
    t.last_entropy = (window[0] / window[1].clamp(min=1)).item()
    t.entropy_coef = next_entropy_coef(t.loss_cfg, t.entropy_coef, t.last_entropy)
