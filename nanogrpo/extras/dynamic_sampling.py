"""DAPO's dynamic sampling (arXiv 2503.14476; verl's `filter_groups`,
which TRL does not have): a group whose G rewards are all equal has
advantage 0 everywhere and teaches nothing, so it is dropped and more
prompts are sampled until the round has its number of groups.

Owns: `groups_with_spread` (which groups carry a learning signal),
`dynamic_sampling` (draw until every rank has its groups, within a bound;
`groups_with_signal`, the same with a Trainer's settings),
and the two Rollout operations it needs: `select_groups` (keep some
groups of a round) and `concat_rollouts` (join rounds into one).

Does not know about: tokenization, the model or reward functions: the
caller's `draw` draws, samples and scores more prompts.

Of grpo.py it uses `total_reward` and `nanstd` (a group's spread); the
advantages are computed afterwards, over the kept groups of all ranks, so
scale_rewards="batch" sees the batch that trains.

Choices:
- A group's G rows live on one rank, so each rank filters its own; the
  ranks keep drawing together (the same collectives) while any of them
  lacks groups.
- Groups beyond the round's number are dropped, as verl does.
- At max_num_gen_batches, equal-reward groups of the last batch fill what
  is missing (run/report.py's check_dynamic_sampling says so once); verl stops the
  run there instead.
- What is logged per completion follows the kept rows: the columns reward
  functions logged (log_extra) and, in the Rollout, the tool counts. The
  round's metrics are then TRL's definitions over the batch that trains
  (TRL has no dynamic sampling).
- A rollout's rows are picked by group and rollouts joined before the
  trainer fills in its fields: the joined rows are re-padded to the
  longest prompt and completion, which changes no scored log-prob.
"""

from typing import NamedTuple

import torch

from nanogrpo import distributed as dist
from nanogrpo.grpo import nanstd, total_reward
from nanogrpo.rollout import Rollout


def groups_with_spread(rewards, weights, G):
    """[groups] bool: the groups whose total rewards differ. rewards:
    [n, K] (NaN = unscored); a group with < 2 scored rows has none."""
    total = total_reward(rewards, weights).view(-1, G)  # [groups, G]
    std = nanstd(total, dim=1)  # [groups], NaN where < 2 scored
    return std > 1e-8


def groups_with_signal(t, ro, rewards, logs, *, draw):
    """The round's groups whose rewards differ, more drawn until there are
    enough (dynamic_sampling with trainer.py's Trainer t's settings).
    rewards: [n, K]; logs: the round's RewardLogs, whose columns (log_extra)
    then hold the kept completions' values. -> (Rollout, rewards, metrics)."""
    kept = dynamic_sampling(
        ro,
        rewards,
        logs.columns,
        draw,
        weights=t.reward_weights,
        max_batches=t.cfg.max_num_gen_batches,
        pad_id=t.tok.pad_token_id,
        info=t.info,
    )
    logs.columns = kept.columns
    return kept.ro, kept.rewards, kept.metrics


class Kept(NamedTuple):
    """What dynamic_sampling keeps of a round: its Rollout, rewards [n, K], columns (what
    reward functions logged per row) and metrics."""

    ro: Rollout
    rewards: torch.Tensor
    columns: dict
    metrics: dict


def dynamic_sampling(ro, rewards, columns, draw, *, weights, max_batches, pad_id, info) -> Kept:
    """Keep the groups of `ro` (rewards [n, K]; columns {name: [n] values},
    what reward functions logged per row) whose rewards differ, and call
    draw() -> (Rollout, rewards, columns) for more until each rank has as
    many as `ro` has, at most max_batches batches in all.
    -> (the round's Rollout, its rewards [n, K], its columns, metrics):
    the kept rows of each; a column a batch did not log is None on its
    rows."""
    G = ro.num_generations
    need = len(ro.rows)  # groups per rank
    pieces = []  # (Rollout, rewards, columns) of the kept groups, batch by batch
    have = 0
    drawn = 0
    for batch in range(max_batches):
        if batch > 0:
            ro, rewards, columns = draw()
        spread = groups_with_spread(rewards, weights, G)  # [need]
        drawn += need
        keep = spread.nonzero()[:, 0][: need - have].tolist()
        pieces.append(_groups(ro, rewards, columns, keep))
        have += len(keep)
        missing = torch.tensor(float(need - have), device=info.device)
        if dist.all_reduce_sum(missing, info).item() == 0:
            break
    counts = torch.tensor([float(have), float(drawn)], device=info.device)
    kept, drawn = dist.all_reduce_sum(counts, info).tolist()
    if have < need:  # the bound: equal-reward groups fill the round
        fill = (~spread).nonzero()[:, 0][: need - have].tolist()
        pieces[-1] = _groups(ro, rewards, columns, keep + fill)
    kept_rollouts = [p[0] for p in pieces if p[0].rows]
    ro = concat_rollouts(kept_rollouts, pad_id)
    rewards = torch.cat([p[1] for p in pieces])
    names = dict.fromkeys(name for _, _, logged in pieces for name in logged)  # as first logged
    columns = {
        name: [
            v for piece, _, logged in pieces for v in logged.get(name, [None] * len(piece.prompts))
        ]
        for name in names
    }
    metrics = {
        "dynamic_sampling/groups_drawn": drawn,
        "dynamic_sampling/groups_kept": kept,
        "dynamic_sampling/gen_batches": batch + 1,
    }
    return Kept(ro, rewards, columns, metrics)


def _groups(ro, rewards, columns, groups):
    """(Rollout, rewards [m, K], columns) of the listed groups only."""
    G = ro.num_generations
    rows = [g * G + j for g in groups for j in range(G)]
    columns = {name: [values[r] for r in rows] for name, values in columns.items()}
    return select_groups(ro, groups), rewards[rows], columns


# -----------------------------------------------------------------------------
# Picking groups and joining rounds (DAPO's dynamic sampling)

# filled in by the trainer: a rollout is picked from or joined before them
TRAINER_FIELDS = ("advantages", "old_logps", "ref_logps", "trainer_logps", "num_items")


def _check_unfilled(ro, caller):
    """ValueError if the trainer has filled in any of ro's TRAINER_FIELDS."""
    for name in TRAINER_FIELDS:
        if getattr(ro, name) is not None:
            raise ValueError(
                f"{caller} takes a rollout before the trainer fills it in; its {name} is set"
            )


def select_groups(ro: Rollout, groups: list[int]) -> Rollout:
    """The rollout of the prompts `groups` (indices into ro.rows, in the order given): group i is
    rows i*G .. i*G+G-1, and every per-row field is cut to those rows (the tool counts and extra
    fields too: those of the completions kept). Widths stay as they are. ValueError if the
    trainer's fields are filled or an index is out of range.
    """
    _check_unfilled(ro, "select_groups")
    G = ro.num_generations
    for i in groups:
        if not 0 <= i < len(ro.rows):
            raise ValueError(f"group {i} is not in [0, {len(ro.rows)})")
    picked = [i * G + j for i in groups for j in range(G)]  # the rows kept
    index = torch.tensor(picked, dtype=torch.long, device=ro.input_ids.device)  # [m]

    def rows_of(x):  # [n, ...] -> [m, ...]
        return None if x is None else x[index]

    if len(ro.prompt_ids) == len(ro.rows):  # one entry per prompt
        prompt_ids = [ro.prompt_ids[i] for i in groups]
    else:  # one per completion
        prompt_ids = [ro.prompt_ids[r] for r in picked]
    extra_fields = None
    if ro.extra_fields is not None:
        extra_fields = {k: [values[r] for r in picked] for k, values in ro.extra_fields.items()}
    return Rollout(
        rows=[ro.rows[i] for i in groups],
        num_generations=G,
        prompt_ids=prompt_ids,
        input_ids=rows_of(ro.input_ids),
        attention_mask=rows_of(ro.attention_mask),
        completion_mask=rows_of(ro.completion_mask),
        completion_lengths=rows_of(ro.completion_lengths),
        truncated=rows_of(ro.truncated),
        prompts=[ro.prompts[r] for r in picked],
        completions=[ro.completions[r] for r in picked],
        completion_token_ids=[ro.completion_token_ids[r] for r in picked],
        tool_calls=rows_of(ro.tool_calls),
        tool_failures=rows_of(ro.tool_failures),
        turns=rows_of(ro.turns),
        sampling_logps=rows_of(ro.sampling_logps),
        extra_fields=extra_fields,
    )


def _fit(x, width, fill, left=False):
    """x [n,W] -> [n,width]: padded with `fill` on the right (on the left if `left`), or cut
    there, keeping the columns on the other side."""
    n, W = x.shape
    k = min(W, width)  # columns kept
    out = x.new_full((n, width), fill)
    if left:
        out[:, width - k :] = x[:, W - k :]
    else:
        out[:, :k] = x[:, :k]
    return out


def concat_rollouts(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """All the rows of `rollouts`, in order, as one Rollout. The rows are re-padded, as
    join_prompt_completion pads them, to P = the longest prompt and C = the longest completion
    of all (a wider rollout's extra columns are padding only, so they are cut): the prompt part
    is left-padded (pad_id, attention 0), the completion part right-padded (pad_id, attention 1,
    completion_mask and sampling_logps 0). A rollout without tools counts 0 tool calls and
    failures and 1 turn per row (None if no rollout has them); sampling_logps is None unless
    every rollout has it; an extra field a rollout lacks is None on its rows. prompt_ids holds
    one entry per prompt when every rollout's does, else one per completion.
    ValueError if the list is empty, the rollouts differ in num_generations, or the trainer's
    fields are filled.
    """
    if not rollouts:
        raise ValueError("concat_rollouts needs at least one rollout")
    G = rollouts[0].num_generations
    for ro in rollouts:
        _check_unfilled(ro, "concat_rollouts")
        if ro.num_generations != G:
            raise ValueError(
                f"rollouts of num_generations {G} and {ro.num_generations} cannot be joined"
            )
    P = max(len(p) for ro in rollouts for p in ro.prompt_ids)
    C = max(1, max(len(x) for ro in rollouts for x in ro.completion_token_ids))
    input_ids = []
    attention_mask = []
    for ro in rollouts:
        W = ro.completion_mask.shape[1]  # this rollout's completion width
        ids = ro.input_ids
        prompt = _fit(ids[:, :-W], P, pad_id, left=True)  # [n,P]
        input_ids.append(torch.cat([prompt, _fit(ids[:, -W:], C, pad_id)], dim=1))  # [n,P+C]
        mask = ro.attention_mask
        prompt = _fit(mask[:, :-W], P, 0, left=True)  # [n,P]
        attention_mask.append(torch.cat([prompt, _fit(mask[:, -W:], C, 1)], dim=1))  # [n,P+C]
    with_logps = all(ro.sampling_logps is not None for ro in rollouts)

    per_prompt = all(len(ro.prompt_ids) == len(ro.rows) for ro in rollouts)
    names = dict.fromkeys(name for ro in rollouts for name in ro.extra_fields or {})
    extra_fields = {
        name: [
            v
            for ro in rollouts
            for v in (ro.extra_fields or {}).get(name, [None] * len(ro.completions))
        ]
        for name in names
    }

    def per_row(name, fill):  # [n] long of each rollout, `fill` where it has none
        values = [getattr(ro, name) for ro in rollouts]
        if all(x is None for x in values):
            return None
        return torch.cat(
            [
                torch.full_like(ro.completion_lengths, fill) if x is None else x
                for ro, x in zip(rollouts, values)
            ]
        )

    return Rollout(
        rows=[r for ro in rollouts for r in ro.rows],
        num_generations=G,
        prompt_ids=[
            p for ro in rollouts for p in (ro.prompt_ids if per_prompt else ro.row_prompt_ids())
        ],
        input_ids=torch.cat(input_ids),
        attention_mask=torch.cat(attention_mask),
        completion_mask=torch.cat([_fit(ro.completion_mask, C, 0) for ro in rollouts]),
        completion_lengths=torch.cat([ro.completion_lengths for ro in rollouts]),
        truncated=torch.cat([ro.truncated for ro in rollouts]),
        prompts=[p for ro in rollouts for p in ro.prompts],
        completions=[c for ro in rollouts for c in ro.completions],
        completion_token_ids=[x for ro in rollouts for x in ro.completion_token_ids],
        tool_calls=per_row("tool_calls", 0),
        tool_failures=per_row("tool_failures", 0),
        turns=per_row("turns", 1),
        sampling_logps=(
            torch.cat([_fit(ro.sampling_logps, C, 0.0) for ro in rollouts]) if with_logps else None
        ),
        extra_fields=extra_fields or None,
    )
