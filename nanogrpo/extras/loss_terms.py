"""The algorithm options TRL GRPOTrainer puts around its loss (reference: TRL 1.16,
trl/trainer/grpo_trainer.py, `_compute_loss`), each off by default, and their settings
(`LossTerms`, TRL GRPOConfig's names, and their rules). train.py's optimizer_step calls
`grpo_step_with_terms` in place of grpo.py's grpo_step when one is on: OPSM's and
top_entropy_quantile's masks reach grpo_step as its `keep` tensor, and the entropy bonus is
subtracted from its loss. Between optimizer steps train.py runs the entropy control
(`applied_entropy_coef`, `entropy_window`, `update_entropy_coef`).

Owns: `LossTerms` and `loss_settings` (a dict of both records' fields -> LossConfig, LossTerms),
`grpo_step_with_terms`, `off_policy_mask` (DeepSeek-V3.2's OPSM, off_policy_mask_threshold),
`high_entropy_mask` (top_entropy_quantile), and the entropy bonus: `entropy_bonus`,
`entropy_window`, `applied_entropy_coef`, `next_entropy_coef` and `update_entropy_coef`, which
moves a Trainer's coefficient after a step (entropy_coef, use_adaptive_entropy).

Does not know about: how each loss type is computed (grpo.py), TrainConfig or log-probs
(logprobs.py). Its one collective is update_entropy_coef's sum of a step's entropy_window over
ranks.

Choices:
- Inputs are [N,C]; masked positions may hold anything (each is cleaned as grpo_step cleans
  them), entropy_window's too: it looks only at the mask's tokens.
- OPSM is detached: it drops a sequence's loss, it carries no gradient of its own.
- The entropy bonus is one mean over the micro-batch's bonus tokens divided by grad_accum,
  whatever the loss type, as TRL does; its adaptive coefficient (Skywork-OR1) moves once per
  optimizer step from the step's mean entropy, which entropy_window's [sum, count] give.
"""

import dataclasses
from dataclasses import dataclass

import torch

from nanogrpo import distributed as dist
from nanogrpo.grpo import LossConfig, LossScale, grpo_step

# the loss types whose loss is a token mean over the whole step (aggregate divides the others
# by grad_accum)
STEP_TOKEN_MEAN = ("dapo", "cispo", "vespo")


@dataclass
class LossTerms:
    """The options' settings, named and defaulted as TRL's GRPOConfig; every one off."""

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

    def __post_init__(self):
        threshold, q = self.off_policy_mask_threshold, self.top_entropy_quantile
        rules = [  # (holds, the field it names, what the field allows)
            (0.0 <= q <= 1.0, "top_entropy_quantile", "a float in [0, 1]"),
            (
                self.entropy_coef_min <= self.entropy_coef_max,
                "entropy_coef_min",
                f"a float <= entropy_coef_max={self.entropy_coef_max}",
            ),
            (self.entropy_coef_delta >= 0, "entropy_coef_delta", "a float >= 0"),
            (
                threshold is None or threshold >= 0,
                "off_policy_mask_threshold",
                "None or a float >= 0 (e.g. 0.5)",
            ),
        ]
        for holds, name, allowed in rules:
            if not holds:
                value = getattr(self, name)
                raise ValueError(f"LossTerms.{name}={value!r} is invalid; allowed: {allowed}")

    def bonus_on(self) -> bool:
        """Whether the loss carries the entropy bonus (TRL: fixed for the run; the adaptive
        control keeps it on even while its coefficient sits at entropy_coef_min)."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy

    def on(self) -> bool:
        """Whether any option is on (else grpo_step alone computes the loss)."""
        masks = self.off_policy_mask_threshold is not None or self.top_entropy_quantile < 1
        return masks or self.bonus_on()


TERM_FIELDS = tuple(f.name for f in dataclasses.fields(LossTerms))


def loss_settings(**settings) -> tuple[LossConfig, LossTerms]:
    """Split TRL-named settings into the loss's (LossConfig) and the options' (LossTerms)."""
    terms = {k: settings.pop(k) for k in TERM_FIELDS if k in settings}
    return LossConfig(**settings), LossTerms(**terms)


def grpo_step_with_terms(
    inputs, cfg, terms, scale=None, *, sampling_logps=None, entropy_coef=None, read_metrics=True
):
    """grpo_step (same arguments and result) with the options `terms` turns on: OPSM and
    top_entropy_quantile keep some tokens' loss (LossInputs.keep), the entropy bonus is
    subtracted after (coefficient entropy_coef, the step's applied_entropy_coef; None =
    terms.entropy_coef) and policy_loss logged, as TRL's. sampling_logps [N,C]: the sampler's,
    the policy OPSM measures from (None: the old policy)."""
    scale = LossScale() if scale is None else scale
    needs = terms.top_entropy_quantile < 1 or terms.bonus_on()
    if needs and inputs.entropies is None:
        raise ValueError("top_entropy_quantile < 1 and the entropy bonus need entropies")
    m = inputs.completion_mask.bool()
    keep = bonus_mask = m  # the tokens that train, the tokens the entropy bonus acts on
    entropies = None if inputs.entropies is None else torch.where(m, inputs.entropies, 0)
    if terms.off_policy_mask_threshold is not None:
        logps = torch.where(m, inputs.logps, 0)
        sampled_by = inputs.old_logps if sampling_logps is None else sampling_logps
        sampled_by = logps.detach() if sampled_by is None else torch.where(m, sampled_by, 0)
        A = inputs.advantages[:, None]  # [N,1]
        keep = off_policy_mask(A, logps, sampled_by, m, terms.off_policy_mask_threshold)
    if terms.top_entropy_quantile < 1:
        bonus_mask = high_entropy_mask(entropies.detach(), m, terms.top_entropy_quantile)
        keep = keep & bonus_mask
    inputs = dataclasses.replace(inputs, keep=None if keep is m else keep)
    total, metrics = grpo_step(inputs, cfg, scale, read_metrics=False)
    if terms.bonus_on():
        # TRL's policy_loss: the loss before the bonus and the grad_accum division
        unscaled = 1 if cfg.loss_type in STEP_TOKEN_MEAN else scale.grad_accum
        metrics = {"policy_loss": total.detach() * unscaled, **metrics}
        coef = terms.entropy_coef if entropy_coef is None else entropy_coef
        total = total - coef * entropy_bonus(entropies, bonus_mask, scale.grad_accum)
    return total, {k: float(v) for k, v in metrics.items()} if read_metrics else metrics


# -----------------------------------------------------------------------------
# Which sequences count: DeepSeek-V3.2's off-policy sequence mask


def off_policy_mask(A, logps, sampling_logps, mask, threshold):
    """DeepSeek-V3.2's off-policy sequence mask (OPSM, arXiv 2512.02556, eq. 9) [N,1] bool:
    drop a sequence whose advantage is negative and whose mean per-token KL from the policy
    that sampled it to the current one, mean_t (log pi_sampling - log pi_theta), exceeds
    threshold. A [N,1]; logps, sampling_logps, mask [N,C]."""
    kl = torch.where(mask, sampling_logps - logps.detach(), 0)  # [N,C]
    mean_kl = kl.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return (A >= 0) | (mean_kl <= threshold)


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
def entropy_window(entropies, completion_mask, terms):
    """[2] float64 = [sum of the entropies, number of tokens] over the tokens the bonus acts on
    (completion_mask's, or high_entropy_mask's with terms.top_entropy_quantile < 1), detached:
    one micro-batch's share of the adaptive control's window. The sum is taken in the
    entropies' dtype. entropies, completion_mask [N,C]; masked positions may hold anything."""
    mask = completion_mask.bool()
    entropies = torch.where(mask, entropies, 0)
    if terms.top_entropy_quantile < 1:
        mask = high_entropy_mask(entropies, mask, terms.top_entropy_quantile)
    total = torch.where(mask, entropies, 0).sum()
    return torch.stack([total.double(), mask.sum().double()])


def applied_entropy_coef(terms, coef, last_entropy):
    """The coefficient this step's micro-batches apply: `coef` as it stood after the last step;
    adaptive control applies it only while the last step's entropy was at or below
    entropy_target (last_entropy = inf before the first step: no bonus yet)."""
    if terms.use_adaptive_entropy and last_entropy > terms.entropy_target:
        return 0.0
    return coef


def next_entropy_coef(terms, coef, entropy):
    """The adaptive coefficient after a step whose mean entropy (all ranks, all micro-batches,
    the bonus's tokens: entropy_window) was `entropy`: one delta up when at or below
    entropy_target (to push it back up), one down otherwise, kept in [entropy_coef_min,
    entropy_coef_max]."""
    if entropy <= terms.entropy_target:
        return min(coef + terms.entropy_coef_delta, terms.entropy_coef_max)
    return max(coef - terms.entropy_coef_delta, terms.entropy_coef_min)


def update_entropy_coef(t, window: torch.Tensor):
    """Adaptive entropy control after a step of trainer.py's Trainer t:
    window = [entropy sum, token count] of the step's micro-batches
    (entropy_window), summed over ranks here."""
    window = dist.all_reduce_sum(window, t.info)
    t.last_entropy = (window[0] / window[1].clamp(min=1)).item()
    t.entropy_coef = next_entropy_coef(t.loss_terms, t.entropy_coef, t.last_entropy)
