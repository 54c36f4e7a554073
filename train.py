"""GRPO training, top to bottom as the algorithm.

    python train.py                       # the embedded default: a tiny model, on CPU
    torchrun --nproc_per_node 8 train.py --config small.py

One round of GRPO (sample_round): prompts -> G completions each (rollout.py; a group may span
ranks, as in TRL) -> rewards (rewards.py) -> group advantages over all ranks (grpo.py) -> old
log-probs when the update is off-policy, reference log-probs when beta > 0 (logprobs.py).
Then (train_cycle) each optimizer step takes the next gradient_accumulation_steps micro-batches
of the rounds -> micro-batched grpo_step -> clip -> AdamW step, in TRL's batch arithmetic
(schedules.py). `train`, at the bottom, is the loop: cycles, evaluation, saves and stops.

Setup (model, tokenizer, optimizer, rewards, prompts) is nanogrpo/trainer.py's; the run's
bookkeeping (output folder, resume, signals, metrics, trackers) nanogrpo/run/'s, called by
`train` around each cycle. `python train.py --plain=true` runs the course alone
(tests/test_layout.py traces it). What that plain round leaves out, and where each option
enters (docs/internals.md has the table):
    faster kernels (plain=false, the default)  `kernels` -> t.kernels    fast/
    LoRA (use_peft)                            setup; `ref_logprobs`     extras/lora.py
    a reference model (beta > 0), its sync     `ref_logprobs`, `update`  logprobs.py
    entropy bonus, OPSM, top_entropy_quantile  `optimizer_step`          extras/loss_terms.py
    dynamic sampling                           `sample_round`            extras/dynamic_sampling.py
    tools, environments, rollout_func          `sample`                  extras/
    reward models                              setup's reward_funcs      extras/reward_model.py
    evaluation and its eval_loss               `evaluate`, from `train`  extras/eval_loss.py
    more processes (FSDP2)                     the dist.* calls          distributed/
"""

import sys
import time
from functools import partial

import torch

from nanogrpo import distributed as dist, fast, run
from nanogrpo.extras import lora
from nanogrpo.extras.custom_rollout import custom_rollout
from nanogrpo.extras.dynamic_sampling import groups_with_signal
from nanogrpo.extras.eval_loss import eval_loss
from nanogrpo.extras.loss_terms import (
    applied_entropy_coef,
    entropy_window,
    grpo_step_with_terms,
    update_entropy_coef,
)
from nanogrpo.grpo import LossInputs, LossScale, group_advantages, grpo_step, sampler_correction
from nanogrpo.logprobs import frozen_logprobs, sync_ref_model
from nanogrpo.rewards import RewardLogs, score_rollout
from nanogrpo.rollout import Rollout, rollout
from nanogrpo.run import report
from nanogrpo.run.config import TrainConfig
from nanogrpo.schedules import micro_batches_in_step
from nanogrpo.trainer import Given, Kernels, Trainer, setup

# -----------------------------------------------------------------------------
# The kernels a run computes with, the seed of each round (setup is nanogrpo/trainer.py's)


def kernels(cfg: TrainConfig) -> Kernels:
    """The one place speed is chosen (nanogrpo/fast/, each equal to the course's function)."""
    packed = fast.packing.packed_kernels(cfg.padding_free, cfg.token_budget)
    if cfg.plain and not cfg.batch_invariant:
        return Kernels(**packed)
    return Kernels(**fast.kernels(cfg.torch_compile, cfg.batch_invariant) | packed)


def round_seed(cfg: TrainConfig, rnd: int, rank: int, salt=0) -> int:
    """A seed per round and rank: sampling is reproducible, and resume needs no RNG state."""
    return (cfg.seed * 1_000_003 + rnd * 7919 + rank * 104_729 + salt) % 2**63


# -----------------------------------------------------------------------------
# One round: prompts -> completions -> rewards -> advantages


def round_prompts(t: Trainer) -> tuple[list[dict], int]:
    """This rank's share of the next round, as TRL's RepeatSampler hands it out: the round's prompts
    each repeated G times, each rank a consecutive slice. -> (rows, copies of each): whole groups
    when the slice holds them, else each completion its own row (a group spans ranks; its advantages
    still come from all G rewards)."""
    rows = t.prompts.next_batch()
    share = t.sched.rank_share(t.info.rank)  # [(prompt, copies)]
    counts = {c for _, c in share}
    if len(counts) == 1:  # G copies of each prompt, or part of one group
        return [rows[i] for i, _ in share], counts.pop()
    return [rows[i] for i, c in share for _ in range(c)], 1


def sample(t: Trainer, rows: list[dict], copies: int, generator) -> Rollout:
    """`copies` completions of each row: rollout.py's sampler, each completion in its own
    environment (reset here) with environment_factory; or the config's rollout_func
    (nanogrpo/extras/custom_rollout.py)."""
    if t.rollout_func is not None:
        return custom_rollout(t, rows, copies, generator)
    episodes = None if t.environments is None else t.environments.start(rows, copies)
    how = dict(settings=t.sampling, generator=generator, turns=t.turns, episodes=episodes)
    cfg = t.cfg  # (TrainConfig.prompt_encoding's, written here: nothing of run/ runs in a round)
    how["encode"] = dict(max_length=cfg.max_prompt_length, **(cfg.chat_template_kwargs or {}))
    how["mask_truncated_completions"] = cfg.mask_truncated_completions
    with t.autocast:
        return rollout(t.model, t.tok, rows, num_generations=copies, **how)


def reward_rollout(ro: Rollout, reward_funcs, t=None, logs=None) -> torch.Tensor:
    """rewards.score_rollout, with t: TRL's trainer_state, log_metric and log_extra (logging into
    `logs`, or nowhere). -> [n, K] fp32, NaN = unscored."""
    extras = None if t is None else (logs or RewardLogs()).reward_kwargs(t.state)
    return score_rollout(ro, reward_funcs, extras)


def advantages_of(t: Trainer, rewards: torch.Tensor, G: int):
    """Group advantages over all ranks' rewards [N, K] (scale_rewards "batch" normalises over the
    whole batch) -> this rank's rows [n]."""
    scale, aggregation = t.cfg.scale_rewards, t.cfg.multi_objective_aggregation
    advantages = group_advantages(rewards, G, t.reward_weights, scale, aggregation)
    n = len(advantages) // t.info.world_size
    first = t.info.rank * n
    return advantages[first : first + n]


# -----------------------------------------------------------------------------
# Log-probs of the sampled tokens under a frozen model (old policy, ref)


def frozen(model, ro: Rollout, t: Trainer):
    """(log-probs, entropies) [n, C] of the rollout under `model`, frozen, with the kernels and
    micro-batch size of the update."""
    how = dict(autocast=t.autocast, temperature=t.cfg.temperature, vocab_size=t.tok.vocab_size)
    size = t.cfg.per_device_train_batch_size
    return frozen_logprobs(model, ro, size, score=t.kernels.token_logprobs, **how)


def ref_logprobs(t: Trainer, ro: Rollout) -> torch.Tensor | None:
    """The reference model's log-probs [n, C] when the loss has a KL term (beta > 0): its own copy,
    or with LoRA the policy with its adapters off; else None."""
    if t.ref is not None:
        return frozen(t.ref, ro, t)[0]
    if t.cfg.beta > 0:
        with lora.disable_adapters(t.model):
            return frozen(t.model, ro, t)[0]
    return None


# -----------------------------------------------------------------------------
# The update: micro-batched grpo_step with gradient accumulation


def micro_batches(t: Trainer, ro: Rollout, rnd: int) -> list[tuple]:
    """What round `rnd` feeds the optimizer steps, in order: its rows shuffled (seeded by the
    round), cut into steps_per_generation micro-batches, replayed num_iterations times. -> [(ro,
    row indices)]."""
    n = t.sched.completions_per_round_per_rank
    size = t.cfg.per_device_train_batch_size
    seed = round_seed(t.cfg, rnd, t.info.rank, salt=1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    perm = dist.to_device(perm, t.info.device)
    micro = [perm[i : i + size] for i in range(0, n, size)]
    return [(ro, micro[k]) for k in t.sched.replay_order()]


def optimizer_step(t: Trainer, micro) -> dict:
    """One optimizer step over `micro`, GA (Rollout, row indices) pairs (from one round or several).
    -> the step's record: grad_norm, and each forward's (micro-batch's) loss, loss metrics (0-dim
    tensors), completion mask and the sampler correction's inputs, of which report.step_metrics
    makes the step's metrics after the cycle."""
    terms = t.loss_terms  # the options around the loss (extras/loss_terms.py), or None
    bonus = terms is not None and terms.bonus_on()
    # every micro-batch of the step applies the coefficient of the last one
    coef = applied_entropy_coef(terms, t.entropy_coef, t.last_entropy) if bonus else None
    window = torch.zeros(2, dtype=torch.float64, device=t.info.device) if bonus else None
    micro_batches, losses = [], []  # each one's (metrics, completion mask) and loss, detached
    forwards = t.kernels.forwards(micro, t.loss_cfg.loss_type, t.info)
    for k, (ro, idx, share) in enumerate(forwards):
        dist.gradient_sync(t.model, enabled=(k == len(forwards) - 1))
        with t.autocast:
            logps, entropies = t.kernels.policy_logprobs(
                t.model,
                ro.input_ids[idx],
                ro.attention_mask[idx],
                ro.completion_mask[idx],
                ro.advantages[idx],
                beta=t.loss_cfg.beta,
                entropy_bonus=bonus,
                world_size=t.info.world_size,
                temperature=t.cfg.temperature,
                vocab_size=t.tok.vocab_size,
            )
        inputs = LossInputs(
            logps=logps.float(),
            advantages=ro.advantages[idx],
            completion_mask=ro.completion_mask[idx],
            old_logps=rows(ro.old_logps, idx),
            ref_logps=rows(ro.ref_logps, idx),
            entropies=entropies.float(),
        )
        sampling_logps = rows(ro.sampling_logps, idx)
        correction = (inputs, sampling_logps, t.loss_cfg, rows(ro.trainer_logps, idx))
        inputs.weights, compared = sampler_correction(*correction)
        scale = LossScale(
            num_items=ro.num_items,
            grad_accum=len(micro) / share,  # (token_budget: a forward's part of its micro-batch)
            world_size=t.info.world_size,
            steps_per_generation=t.sched.steps_per_generation,
        )
        if terms is None:
            loss, metrics = grpo_step(inputs, t.loss_cfg, scale, read_metrics=False)
        else:
            how = dict(sampling_logps=sampling_logps, entropy_coef=coef, read_metrics=False)
            loss, metrics = grpo_step_with_terms(inputs, t.loss_cfg, terms, scale, **how)
        loss.backward()
        losses.append(loss.detach())
        if bonus:  # the adaptive control's [entropy sum, token count]
            window += entropy_window(inputs.entropies, inputs.completion_mask, terms)
        micro_batches.append((metrics, ro.completion_mask[idx], compared, inputs.weights))
    grad_norm = dist.clip_grad_norm(t.model, t.cfg.max_grad_norm or 0.0)
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    out = dict(micro_batches=micro_batches, losses=losses, grad_norm=grad_norm)
    if bonus and terms.use_adaptive_entropy:
        update_entropy_coef(t, window)
    if bonus:
        out["entropy_coef"] = t.entropy_coef
    return out


def rows(x: torch.Tensor | None, idx: torch.Tensor):
    """x's rows idx (a micro-batch), or None."""
    return None if x is None else x[idx]


def update(t: Trainer, micro) -> dict:
    """One optimizer step, the scheduler's step and TR-DPO's reference sync. -> the step's
    record."""
    cfg = t.cfg
    t0 = time.time()
    lr_used = t.scheduler.get_last_lr()[0]
    m = optimizer_step(t, micro)
    t.scheduler.step()
    t.step += 1
    if t.ref is not None and cfg.sync_ref_model and t.step % cfg.ref_model_sync_steps == 0:
        dist.reshard(t.ref)  # mixed shard by shard with the policy's (FSDP2)
        sync_ref_model(t.ref, t.model, cfg.ref_model_mixup_alpha)
    m["step"] = t.step
    m["learning_rate"] = lr_used  # the rate this step used (the scheduler has moved on)
    m["time/update"] = time.time() - t0
    return m


# -----------------------------------------------------------------------------
# Rounds and steps in TRL's order


def sample_round(t: Trainer, rnd: int) -> tuple[Rollout, dict]:
    """Generation round `rnd`: sample, reward, advantages over all ranks, old/ref log-probs. -> (the
    Rollout, what the report needs of it)."""
    cfg, info = t.cfg, t.info
    t0 = time.time()
    generator = torch.Generator(info.device)
    generator.manual_seed(round_seed(cfg, rnd, info.rank))
    # LoRA dropout's masks: seeded per round, so resume is exact
    torch.manual_seed(round_seed(cfg, rnd, info.rank, salt=2))
    rows, copies = round_prompts(t)
    logs = RewardLogs()  # what the reward functions log
    # a stop inside drops the round at once (nanogrpo/run/); the parameters
    # are gathered first, so that nothing inside waits on another rank
    with dist.gathered(t.model), dist.local_work(info):
        ro = sample(t, rows, copies, generator)
        t1 = time.time()
        local = reward_rollout(ro, t.reward_funcs, t, logs)  # [n, K]
    stats = {}
    extra = 0.0  # seconds spent sampling and scoring more groups
    if cfg.dynamic_sampling:  # DAPO: only groups whose rewards differ
        start = time.time()
        draw = partial(draw_more, t, generator, logs)
        ro, local, stats = groups_with_signal(t, ro, local, logs, draw=draw)
        extra = time.time() - start
    rewards = dist.all_gather_rows(dist.to_device(local, info.device), info).float()
    ro.advantages = advantages_of(t, rewards, cfg.num_generations)
    ro.num_items = dist.all_reduce_sum(ro.completion_mask.sum(), info)
    t2 = time.time()
    if t.sched.off_policy:  # the policy moves before some update
        ro.old_logps, _ = frozen(t.model, ro, t)
    elif cfg.vllm_importance_sampling_correction and t.drops_adapter_inputs:
        # the update's forward drops adapter inputs, the sampler's did not:
        # the correction compares the sampler with the policy it ran
        ro.trainer_logps, _ = frozen(t.model, ro, t)
    ro.ref_logps = ref_logprobs(t, ro)
    t3 = time.time()
    timing = {"time/sample": t1 - t0, "time/score": t2 - t1 - extra, "time/logprobs": t3 - t2}
    if cfg.dynamic_sampling:  # sampling and scoring the extra batches
        timing["time/dynamic_sampling"] = extra
    return ro, dict(ro=ro, local=local, rewards=rewards, timing=timing, stats=stats, logs=logs)


def train_cycle(t: Trainer) -> tuple[list[dict], list[dict]]:
    """Rounds and optimizer steps in TRL's order until they end together (Schedule's cycle; for most
    shapes one round and its steps): a step takes the next gradient_accumulation_steps micro-batches
    (an epoch's last step what the epoch has left, as transformers cuts it; the cycle ends there),
    sampling a new round whenever none is left. -> (a record per step, what the report needs of each
    round)."""
    # (Rollout, row indices) not trained on yet; what the report needs of each round; the steps'
    queue, rounds, records = [], [], []
    for _ in range(min(t.sched.steps_per_cycle, t.cfg.max_steps - t.step)):
        n = micro_batches_in_step(t.cfg, t.step, len(t.prompts.rows), t.info.world_size)
        while len(queue) < n:
            rnd = t.round + len(rounds)
            ro, sampled = t.rollouts.take(t, rnd) if t.rollouts else sample_round(t, rnd)
            rounds.append(sampled)
            queue += micro_batches(t, ro, rnd)
        records.append(update(t, queue[:n]))
        del queue[:n]
        if n < t.sched.gradient_accumulation_steps:
            break  # an epoch's short last step: its rounds are all used
    t.round += len(rounds)
    return records, rounds


def draw_more(t: Trainer, generator, logs):
    """Dynamic sampling's next batch: a round's prompts sampled and scored.
    -> (Rollout, rewards [n, K], what this call logged with log_extra)."""
    rows, copies = round_prompts(t)
    more = sample(t, rows, copies, generator)
    return more, reward_rollout(more, t.reward_funcs, t, logs), logs.columns


# -----------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(t: Trainer) -> dict:
    """num_generations_eval samples (None = num_generations) per eval prompt, scored as in training:
    report.eval_metrics' rewards and pass@1, and TRL's eval_loss. Each eval row counts once, on any
    world size."""
    info = t.info
    num_rows = len(t.eval_rows)
    indices = dist.equal_shard(num_rows, info.rank, info.world_size)
    rows = [t.eval_rows[i] for i in indices]
    generator = torch.Generator(info.device)
    generator.manual_seed(round_seed(t.cfg, 0, info.rank, salt=17))
    G = t.cfg.num_generations_eval or t.cfg.num_generations
    logs = RewardLogs()  # what the reward functions log
    with dist.gathered(t.model), dist.local_work(info):  # as in sample_round
        ro = sample(t, rows, G, generator)
        local = reward_rollout(ro, t.reward_funcs, t, logs).to(info.device)  # [n, K]
    rewards = dist.all_gather_rows(local, info)[: num_rows * G]  # [E*G, K]
    m = report.eval_metrics(rewards, t.reward_funcs, t.reward_weights, logs)
    # rows past the end (equal_shard's wrap-around) count once: not here
    first = info.rank * len(indices)
    counted = torch.arange(first, first + len(indices), device=info.device) < num_rows
    counted = counted.repeat_interleave(G)  # [n]
    logps, ents = frozen(t.model, ro, t)
    ref = ref_logprobs(t, ro)
    m["eval/loss"] = eval_loss(t, ro, local, counted, logps=logps, entropies=ents, ref_logps=ref)
    return m


# -----------------------------------------------------------------------------
# The run


def train(cfg: TrainConfig, command=None, given=Given()) -> list[dict]:
    """Run GRPO as configured: cycles until max_steps, evaluation and saves where they are due, a
    save on Ctrl-C, SIGTERM or an error. -> per-step metrics (also metrics.jsonl). given: what a
    Python caller (nanogrpo/api/) passes in place of the config's names, a trainer.Given."""
    if cfg.dry_run:  # nothing loaded, nothing started: the plan of the run
        return run.dry_run(cfg)
    info = dist.setup(cfg.device, cfg.ddp_timeout, cfg.async_rollouts * cfg.rollout_processes)
    cfg.validate(info.launched)
    r, cfg = run.start(cfg, info, command)  # on resume, the checkpoint's optimizer settings
    t = setup(cfg, info, r.resume_from, kernels=kernels(cfg), given=given)
    cfg = t.cfg  # max_steps counted (num_train_epochs)
    if not run.begin(r, t, sample_round, kernels):  # restored; a rollout process: it sampled
        return r.history
    with run.saving_on_stop(r, t):
        if cfg.eval_on_start:  # transformers' check before any step, on resume too
            report.log_eval(r, {"step": t.step, **evaluate(t)})
        if r.pending:  # saved on a stop that dropped their evaluation
            if t.eval_rows:
                r.pending[-1].update(evaluate(t))
            report.log(r)
        while t.step < cfg.max_steps:
            run.stop_if_signalled(r, t)  # Ctrl-C, SIGTERM: save, then end
            first_step = t.step
            with run.cycle(r, t):  # where a stop inside it goes back to
                records, rounds = train_cycle(t)
            report.add_round_metrics(r, t, rounds, records)
            r.pending = records
            last = t.step == cfg.max_steps
            eval_due = run.crossed(cfg.eval_every(), first_step, t.step) or last
            if t.eval_rows and cfg.eval_every() and eval_due:
                records[-1].update(evaluate(t))
            report.log(r)
            if run.crossed(cfg.save_steps, first_step, t.step) or last:
                run.save(r, t)
    return run.finish(r, t)


if __name__ == "__main__":
    run.exit_process(run.main(sys.argv[1:], train))
