"""DAPO's dynamic sampling (arXiv 2503.14476; verl's `filter_groups`,
which TRL does not have): a group whose G rewards are all equal has
advantage 0 everywhere and teaches nothing, so it is dropped and more
prompts are sampled until the round has its number of groups.

Owns: `groups_with_spread` (which groups carry a learning signal) and
`dynamic_sampling` (draw until every rank has its groups, within a bound).

Does not know about: how prompts are drawn, sampled or scored (the
caller's `draw`), advantages (computed afterwards, over the kept groups
of all ranks, so scale_rewards="batch" sees the batch that trains).

Choices:
- A group's G rows live on one rank, so each rank filters its own; the
  ranks keep drawing together (the same collectives) while any of them
  lacks groups.
- Groups beyond the round's number are dropped, as verl does.
- At max_num_gen_batches, equal-reward groups of the last batch fill what
  is missing (report.check_dynamic_sampling says so once); verl stops the
  run there instead.
- What is logged per completion follows the kept rows: the columns reward
  functions logged (log_extra) and, in the Rollout, the tool counts. The
  round's metrics are then TRL's definitions over the batch that trains
  (TRL has no dynamic sampling).
"""

import torch

from nanogrpo import dist
from nanogrpo.grpo import nanstd, total_reward
from nanogrpo.rollout import concat_rollouts, select_groups


def groups_with_spread(rewards, weights, G):
    """[groups] bool: the groups whose total rewards differ. rewards:
    [n, K] (NaN = unscored); a group with < 2 scored rows has none."""
    total = total_reward(rewards, weights).view(-1, G)  # [groups, G]
    std = nanstd(total, dim=1)  # [groups], NaN where < 2 scored
    return std > 1e-8


def dynamic_sampling(ro, rewards, columns, draw, weights, max_batches, pad_id, info):
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
        keep = spread.nonzero()[:, 0][:need - have].tolist()
        pieces.append(_groups(ro, rewards, columns, keep))
        have += len(keep)
        missing = torch.tensor(float(need - have), device=info.device)
        if dist.all_reduce_sum(missing, info).item() == 0:
            break
    counts = torch.tensor([float(have), float(drawn)], device=info.device)
    kept, drawn = dist.all_reduce_sum(counts, info).tolist()
    if have < need:  # the bound: equal-reward groups fill the round
        fill = (~spread).nonzero()[:, 0][:need - have].tolist()
        pieces[-1] = _groups(ro, rewards, columns, keep + fill)
    kept_rollouts = [p[0] for p in pieces if p[0].rows]
    ro = concat_rollouts(kept_rollouts, pad_id)
    rewards = torch.cat([p[1] for p in pieces])
    names = dict.fromkeys(name for _, _, logged in pieces for name in logged)  # as first logged
    columns = {name: [v for piece, _, logged in pieces
                      for v in logged.get(name, [None] * len(piece.prompts))]
               for name in names}
    metrics = {
        "dynamic_sampling/groups_drawn": drawn,
        "dynamic_sampling/groups_kept": kept,
        "dynamic_sampling/gen_batches": batch + 1,
    }
    return ro, rewards, columns, metrics


def _groups(ro, rewards, columns, groups):
    """(Rollout, rewards [m, K], columns) of the listed groups only."""
    G = ro.num_generations
    rows = [g * G + j for g in groups for j in range(G)]
    columns = {name: [values[r] for r in rows] for name, values in columns.items()}
    return select_groups(ro, groups), rewards[rows], columns
