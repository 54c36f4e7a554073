"""TRL's `eval_loss`: the loss grpo_step gives the evaluation's completions.

Owns: `eval_loss`, the on-policy loss of one evaluation as one batch over all ranks.

Does not know about: sampling, reward functions or the model: train.py's `evaluate` hands it
the evaluation's rewards and log-probs.

Choices:
- Advantages within each prompt's eval group (num_generations_eval completions, None =
  num_generations): with one completion a prompt there is no advantage, and only the KL term
  (beta > 0) is left. TRL
  computes the loss per eval batch and averages the batches; here the batch is the whole
  evaluation, so the figure does not depend on per_device_eval_batch_size.
- On-policy (the ratio is exactly 1); the sampler's log-probs reach the loss as in training, so
  the sampler correction, when on, applies here too.
"""

from nanogrpo import distributed as dist
from nanogrpo.extras.loss_terms import grpo_step_with_terms
from nanogrpo.grpo import LossInputs, LossScale, group_advantages, grpo_step, sampler_correction


def eval_loss(t, ro, rewards, counted, *, logps, entropies, ref_logps) -> float:
    """t: trainer.py's Trainer; ro: the evaluation's Rollout; rewards [n, K] this rank's;
    counted [n] bool, the rows to count (equal_shard's wrap-around counts once); logps,
    entropies [n, C] of the policy; ref_logps [n, C] or None. -> the loss over all ranks."""
    info = t.info
    advantages = group_advantages(
        rewards.float(),
        ro.num_generations,
        reward_weights=t.reward_weights,
        scale_rewards=t.cfg.scale_rewards,
        multi_objective_aggregation=t.cfg.multi_objective_aggregation,
    )
    mask = ro.completion_mask * counted[:, None]  # [n, C]
    inputs = LossInputs(
        logps=logps.float(),
        advantages=advantages,
        completion_mask=mask,
        entropies=entropies.float(),
        ref_logps=ref_logps,
    )
    inputs.weights, _ = sampler_correction(inputs, ro.sampling_logps, t.loss_cfg)
    scale = LossScale(
        num_items=dist.all_reduce_sum(mask.sum(), info),
        world_size=info.world_size,
    )
    if t.loss_terms is None:
        loss, _ = grpo_step(inputs, t.loss_cfg, scale)
    else:
        terms = dict(sampling_logps=ro.sampling_logps)
        loss, _ = grpo_step_with_terms(
            inputs, t.loss_cfg, t.loss_terms, scale, **terms
        )  # the ranks' losses average to the batch's, as their gradients do
    total = dist.all_reduce_sum(loss.detach().double(), info)
    return total.item() / info.world_size
