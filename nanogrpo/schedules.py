"""What each optimizer step is: the batch `Schedule`, TRL's arithmetic.

Owns: `batch_schedule` (per_device_train_batch_size, gradient accumulation, steps_per_generation,
processes -> every derived count), and how TRL's Trainer cuts epochs into optimizer steps:
`micro_batches_per_epoch`, `steps_per_epoch`, `micro_batches_in_step` and `total_steps`
(num_train_epochs as transformers counts it).

Leaves out: the learning rate at each step (nanogrpo/extras/lr_schedules.py: transformers'
lr_scheduler_type values) and the rules that keep the counts whole (TrainConfig's validate, in
nanogrpo/run/rules.py).

Does not know about: optimizers, checkpoints, or processes (world_size is a number it is given);
it reads a TrainConfig's batch fields.
"""

import math
from collections import Counter
from dataclasses import dataclass

# -----------------------------------------------------------------------------
# The batch schedule


def micro_batches_per_round(cfg, world_size: int = 1) -> int:
    """TRL's steps_per_generation: micro-batches each process samples
    at once, from generation_batch_size when that is given."""
    if cfg.generation_batch_size is not None:
        per_round = cfg.per_device_train_batch_size * world_size
        return cfg.generation_batch_size // per_round
    return cfg.steps_per_generation or cfg.gradient_accumulation_steps


def batch_schedule(cfg, world_size: int = 1) -> "Schedule":
    """Every count derived from the batch settings on `world_size` processes, as TRL's GRPOConfig
    derives them (call validate first). A generation round is TRL's generation batch, whole
    groups of G over all processes, laid out as TRL's RepeatSampler lays them (a prompt's G copies
    consecutive, each process a consecutive slice: a group may span processes). Each process
    trains num_iterations times on its slice's steps_per_generation micro-batches; an optimizer
    step takes the next gradient_accumulation_steps of them, from one round or several."""
    micro = cfg.per_device_train_batch_size
    GA = cfg.gradient_accumulation_steps
    spg = micro_batches_per_round(cfg, world_size)
    mu = cfg.num_iterations
    per_round = micro * world_size * spg  # TRL's generation_batch_size
    fed = spg * mu  # micro-batches one round feeds, its replays included
    cycle = math.lcm(GA, fed)
    return Schedule(
        world_size=world_size,
        num_generations=cfg.num_generations,
        micro_batch_size=micro,
        gradient_accumulation_steps=GA,
        steps_per_generation=spg,
        num_iterations=mu,
        generation_batch_size=per_round,
        prompts_per_round=per_round // cfg.num_generations,
        completions_per_round_per_rank=micro * spg,
        completions_per_step=micro * GA * world_size,
        rounds_per_cycle=cycle // fed,
        steps_per_cycle=cycle // GA,
        # TRL's rule: unless every step ends where a round's replays end,
        # some update trains on samples of an older policy
        off_policy=GA % fed != 0,
    )


def micro_batches_per_epoch(cfg, num_prompts: int, world_size: int = 1) -> int:
    """TRL's len(train_dataloader) on each process: the whole rounds in `num_prompts`
    (RepeatSampler drops an incomplete last one), each feeding steps_per_generation x
    num_iterations micro-batches."""
    sched = batch_schedule(cfg, world_size)
    rounds = num_prompts // sched.prompts_per_round
    return rounds * sched.steps_per_generation * sched.num_iterations


def steps_per_epoch(cfg, num_prompts: int, world_size: int = 1) -> int:
    """transformers' num_update_steps_per_epoch: an epoch's micro-batches in steps of
    gradient_accumulation_steps, rounded up, at least 1."""
    micro = micro_batches_per_epoch(cfg, num_prompts, world_size)
    GA = cfg.gradient_accumulation_steps
    return max(-(-micro // GA), 1)


def micro_batches_in_step(cfg, step: int, num_prompts: int, world_size: int = 1) -> int:
    """Micro-batches optimizer step `step` (0-based) accumulates: gradient_accumulation_steps, but
    an epoch's last step only what the epoch has left (transformers': no step spans two epochs)."""
    micro = micro_batches_per_epoch(cfg, num_prompts, world_size)
    GA = cfg.gradient_accumulation_steps
    per_epoch = steps_per_epoch(cfg, num_prompts, world_size)
    if step % per_epoch < per_epoch - 1:
        return GA
    return micro - (per_epoch - 1) * GA


def total_steps(cfg, num_prompts: int, world_size: int = 1) -> int:
    """max_steps, or transformers' count for num_train_epochs passes over
    `num_prompts`: ceil(num_train_epochs x steps_per_epoch)."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    per_epoch = steps_per_epoch(cfg, num_prompts, world_size)
    return math.ceil(cfg.num_train_epochs * per_epoch)


@dataclass(frozen=True)
class Schedule:
    """What one optimizer step and one generation round are, on every
    rank: the counts the loop, grpo_step's scaling, the replay order and
    the logs all read. TRL's names where TRL has them."""

    world_size: int
    num_generations: int  # G completions per prompt
    micro_batch_size: int  # completions per forward/backward on a rank
    gradient_accumulation_steps: int  # micro-batches per optimizer step
    steps_per_generation: int  # micro-batches per round, on each rank
    num_iterations: int  # passes over each round's samples (TRL's mu)
    generation_batch_size: int  # completions per round, all ranks
    prompts_per_round: int  # generation_batch_size / G
    completions_per_round_per_rank: int
    completions_per_step: int  # trained by one optimizer step, all ranks
    # the smallest whole number of rounds that feeds a whole number of
    # optimizer steps: 1 round for most shapes; saves fall between cycles
    rounds_per_cycle: int
    steps_per_cycle: int
    # the policy changes between sampling and some update: old log-probs
    # are needed
    off_policy: bool

    @property
    def whole_groups_per_rank(self) -> bool:
        """Each process holds whole groups: no group spans processes."""
        return self.completions_per_round_per_rank % self.num_generations == 0

    def rank_share(self, rank: int) -> list[tuple[int, int]]:
        """This rank's completions of a round, as TRL hands them out:
        [(prompt index in the round, copies)] for the consecutive slice
        [rank x n, (rank + 1) x n) of the round's prompt-major list of
        generation_batch_size completions."""
        n = self.completions_per_round_per_rank
        copies = Counter(j // self.num_generations for j in range(rank * n, (rank + 1) * n))
        return list(copies.items())

    def replay_order(self) -> list[int]:
        """The micro-batches one round feeds, in order: its
        steps_per_generation micro-batches, num_iterations times."""
        return list(range(self.steps_per_generation)) * self.num_iterations

    def table(self) -> str:
        """A short table for the start of a run: what one step and one
        round are."""
        micro = f"of {self.micro_batch_size} completions"
        old_logps = "yes" if self.off_policy else "no: ratio is exactly 1"
        G = self.num_generations
        rows = [
            ("ranks", self.world_size),
            (
                "prompts x completions per generation round (all ranks)",
                f"{self.prompts_per_round} x {G} = {self.generation_batch_size}",
            ),
            ("completions per rank per round", self.completions_per_round_per_rank),
            (
                f"micro-batches per round per rank ({micro}; steps_per_generation)",
                self.steps_per_generation,
            ),
            ("passes over each round (num_iterations)", self.num_iterations),
            (
                "micro-batches per optimizer step (gradient_accumulation_steps)",
                self.gradient_accumulation_steps,
            ),
            ("completions per optimizer step (all ranks)", self.completions_per_step),
            (
                "rounds -> optimizer steps (a cycle; saves fall between)",
                f"{self.rounds_per_cycle} -> {self.steps_per_cycle}",
            ),
            ("old log-probs (off-policy)", old_logps),
        ]
        if not self.whole_groups_per_rank:
            rows.insert(1, ("groups span processes", "yes, as in TRL"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def one_forward_each(micro, loss_type, info) -> list[tuple]:
    """The update's forwards of a step's micro-batches [(Rollout, rows)]: one each, its whole loss
    -> [(Rollout, rows, 1.0)] (fast/packing.py's by_tokens cuts them by token_budget)."""
    return [(ro, idx, 1.0) for ro, idx in micro]
