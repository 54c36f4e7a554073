"""A round's metrics under TRL's names and definitions (reward, reward_std, rewards/<name>/mean,
completions/..., tools/..., sampling/...), the eval metrics, the loss metrics of the micro-batches
kept as tensors and read in one transfer a step (`read_floats`), and the completions shown.

Does not know about: the model, the optimizer, checkpoints, or how a run starts and resumes.

Of grpo.py it uses `total_reward` and `nanstd` (the one definition of a total reward and of a
group's spread).
"""

import json
import math

import torch

from nanogrpo import distributed as dist
from nanogrpo.grpo import nanstd, total_reward


def micro_batch_weights(mask: torch.Tensor, loss_cfg) -> dict:
    """How much a micro-batch's value of each sampling/* metric weighs in
    its step's: its tokens (the sampler's log-prob difference; the
    correction's weights per token) or its rows (weights per sequence).
    mask: [n, C]. The token count stays a 0-dim tensor (read_floats reads
    it with the step's metrics)."""
    tokens = mask.sum()
    per_row = loss_cfg.vllm_importance_sampling_mode.startswith("sequence")
    return {
        "sampling/sampling_logp_difference/mean": tokens,
        "sampling/importance_sampling_ratio/mean": len(mask) if per_row else tokens,
        "sampling/raw_importance_sampling_ratio/token/mean": tokens,
        "sampling/raw_importance_sampling_ratio/sequence/mean": mask.bool().any(-1).sum(),
    }


def read_floats(tree):
    """tree (nested dicts, lists, tuples) with each 0-dim tensor in it
    replaced by its Python float, all read from the device at once: one
    host sync where a float() each would wait for the device every time.
    The floats are float()'s (a float32 widens to float64 exactly)."""
    tensors = list(_tensors(tree))
    if not tensors:
        return tree
    stacked = torch.stack([x.detach().double().reshape(()) for x in tensors])
    return _with_floats(tree, iter(stacked.tolist()))


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def _with_floats(tree, floats):
    """tree with its tensors, in _tensors' order, replaced by floats."""
    if isinstance(tree, torch.Tensor):
        return next(floats)
    if isinstance(tree, dict):
        return {k: _with_floats(v, floats) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_with_floats(v, floats) for v in tree)
    return tree


def sampler_metrics(trainer_logps, sampling_logps, weights, mask) -> dict:
    """How far the sampler's log-probs are from the trainer's (grpo.sampler_correction's pair,
    [N,C], 0 off the mask [N,C] bool): the raw ratios, corrected or not, and with the correction
    on (its weights) TRL's sampling/* metrics, as 0-dim float64 tensors."""
    out = raw_sampler_ratios(trainer_logps, sampling_logps, mask)
    if weights is not None:
        out.update(importance_sampling_metrics(trainer_logps, sampling_logps, weights, mask))
    return out


@torch.no_grad()
def importance_sampling_metrics(trainer_logps, sampling_logps, weights, mask):
    """TRL's sampling/* metrics of one batch: |log pi_trainer - log pi_sampler| over its tokens
    (mean, max) and the correction weights (min, mean, max; per sequence or per token), as
    0-dim float64 tensors on the inputs' device."""
    delta = (trainer_logps - sampling_logps).abs()[mask].double()
    w = (weights.flatten() if weights.shape[1] == 1 else weights[mask]).double()
    delta = delta if delta.numel() else delta.new_zeros(1)
    w = w if w.numel() else w.new_zeros(1)
    return {
        "sampling/sampling_logp_difference/mean": delta.mean(),
        "sampling/sampling_logp_difference/max": delta.max(),
        "sampling/importance_sampling_ratio/min": w.min(),
        "sampling/importance_sampling_ratio/mean": w.mean(),
        "sampling/importance_sampling_ratio/max": w.max(),
    }


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


def step_metrics(record: dict, t) -> dict:
    """An optimizer step's loss metrics as TRL logs them, from train.optimizer_step's record
    (whose micro_batches and losses it takes out): read from the device at once (a float() each
    would wait each time), each metric over the micro-batches and ranks (across_micro_batches),
    `loss` the micro-batches' sum, added in order as a running total. t: trainer.py's Trainer."""
    values = {}  # metric -> [(value, weight)] of each micro-batch
    for metrics, mask, compared, correction in record.pop("micro_batches"):
        if compared is not None:  # the sampler's log-probs against the trainer's
            metrics = sampler_metrics(*compared, correction, mask.bool()) | metrics
        weights = micro_batch_weights(mask, t.loss_cfg)
        for key, value in metrics.items():
            values.setdefault(key, []).append((value, weights.get(key, 1.0)))
    values, losses = read_floats((values, record.pop("losses")))
    out = across_micro_batches(values, t.info)
    out["loss"] = sum(losses, 0.0)
    return out


def across_micro_batches(values: dict, info) -> dict:
    """One step's metrics from its micro-batches' values, {key: [(value,
    weight)]}: the smallest of a /min, the largest of a /max, else the
    weighted mean. The sampling/* metrics are then taken over all ranks
    as TRL takes them (the mean of the ranks' means, the min and max of
    theirs); the others are this rank's."""
    out = {}
    for key, pairs in values.items():
        if key.endswith("/min"):
            out[key] = min(float(v) for v, _ in pairs)
        elif key.endswith("/max"):
            out[key] = max(float(v) for v, _ in pairs)
        else:
            weight = sum(w for _, w in pairs)
            total = sum(float(v) * w for v, w in pairs)
            out[key] = total / weight if weight else 0.0
    sampling = sorted(k for k in out if k.startswith("sampling/"))
    if sampling and info.world_size > 1:
        local = torch.tensor(
            [float(out[k]) for k in sampling], dtype=torch.float64, device=info.device
        )
        ranks = dist.all_gather_rows(local[None], info)  # [ranks, keys]
        for j, key in enumerate(sampling):
            column = ranks[:, j]
            if key.endswith("/min"):
                out[key] = column.min().item()
            elif key.endswith("/max"):
                out[key] = column.max().item()
            else:
                out[key] = column.mean().item()
    return out


def generation_metrics(t, ro, rewards: torch.Tensor, checks: dict | None = None) -> dict:
    """TRL's reward, completion-length and tool metrics over the round's
    completions that train, on all ranks (with dynamic sampling, those of
    the groups kept; TRL has none, so its metrics are of the batch that
    trains). rewards: [N, K]. checks: a dict to fill with what
    check_rewards needs ("scored", "max_abs"). The values are read from
    the device at once; a reward column holding NaN (unscored rows) is
    read again, its scored rows alone."""
    info = t.info
    total = total_reward(rewards, t.reward_weights)  # [N], NaN = unscored
    groups = total.view(-1, t.cfg.num_generations)  # [N/G, G]
    group_std = nanstd(groups, dim=1)  # NaN where < 2 scored
    zero_std = torch.isclose(group_std, torch.zeros_like(group_std))
    lengths = dist.all_gather_rows(ro.completion_lengths.float(), info)
    truncated = dist.all_gather_rows(ro.truncated.float(), info)
    # TRL's: lengths of the completions that ended with a stop token (0 if
    # none). Lengths are whole numbers: their float32 sum is exact in any
    # order, so the masked sum is the sum of the ended rows alone.
    ended = truncated == 0  # [N]
    some = ended.any()
    count = ended.sum().clamp(min=1)
    columns = [total] + [rewards[:, k].contiguous() for k in range(len(t.reward_funcs))]
    read = read_floats(
        {
            "stats": [_nan_free_stats(column) for column in columns],
            "max_abs": torch.where(torch.isnan(total), 0, total).abs().max(),
            "frac_reward_zero_std": zero_std.float().mean(),
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/clipped_ratio": truncated.mean(),
            "completions/mean_terminated_length": torch.where(ended, lengths, 0).sum() / count,
            "completions/min_terminated_length": torch.where(
                some, torch.where(ended, lengths, math.inf).min(), 0
            ),
            "completions/max_terminated_length": torch.where(
                some, torch.where(ended, lengths, -math.inf).max(), 0
            ),
        }
    )
    stats = [
        _scored_stats(column, *values)
        for column, values in zip(columns, read.pop("stats"), strict=True)
    ]
    if checks is not None:
        checks["scored"] = len(total) - stats[0][2]
        checks["max_abs"] = read.pop("max_abs")
    read.pop("max_abs", None)
    m = {"reward": stats[0][0], "reward_std": stats[0][1]}
    m.update(read)
    if ro.tool_calls is not None:  # the config's tools or an environment's
        m.update(tool_metrics(ro, info))
    for (name, _), (mean, std, _) in zip(t.reward_funcs, stats[1:], strict=True):
        m[f"rewards/{name}/mean"] = mean
        m[f"rewards/{name}/std"] = std
    return m


def _nan_free_stats(x: torch.Tensor) -> list:
    """[mean, std, unscored rows] of x [N] as 0-dim tensors: x's mean and
    std are its scored rows' when no row is NaN (the common case)."""
    std = x.std() if len(x) > 1 else torch.zeros((), device=x.device)
    return [x.mean(), std, torch.isnan(x).sum()]


def _scored_stats(x: torch.Tensor, mean: float, std: float, unscored: float) -> tuple:
    """(mean, std, unscored rows) of x's scored rows: the whole-column
    values already read, or where a row is NaN, those of the scored rows
    alone (NaN mean and 0 std when fewer than 1 and 2)."""
    if unscored == 0:
        return mean, std, 0
    scored = x[~torch.isnan(x)]
    mean = scored.mean().item() if len(scored) else math.nan
    std = scored.std().item() if len(scored) > 1 else 0.0
    return mean, std, int(unscored)


def tool_metrics(ro, info) -> dict:
    """TRL's tool metrics over ro's completions on all ranks: tool calls
    per completion, the failed share of those calls, assistant turns per
    completion."""
    per_row = torch.stack([ro.tool_calls, ro.tool_failures, ro.turns], dim=1)  # [n, 3]
    calls, failures, turns = dist.all_gather_rows(per_row.float(), info).unbind(1)  # [N] each
    made = calls.sum().item()
    return {
        "tools/call_frequency": calls.mean().item(),
        "tools/failure_frequency": failures.sum().item() / made if made else 0.0,
        "tools/mean_turns": turns.mean().item(),
    }


def eval_metrics(rewards: torch.Tensor, reward_funcs, weights, logs=None) -> dict:
    """Mean reward per function and in total (unscored rows left out);
    pass@1 = the share whose first function gives >= 1; the mean of what
    the functions logged with log_metric (logs: extras/trainer_info.py's
    RewardLogs), as eval/<name>. rewards [E, K]."""
    m = {}
    for name, values in (logs.metrics if logs else {}).items():
        m[f"eval/{name}"] = sum(values) / len(values)
    for k, (name, _) in enumerate(reward_funcs):
        m[f"eval/rewards/{name}/mean"] = torch.nanmean(rewards[:, k]).item()
    total = total_reward(rewards, weights)
    m["eval/reward"] = torch.nanmean(total).item()
    m["eval/pass@1"] = (rewards[:, 0] >= 1.0).float().mean().item()
    return m


def shown_samples(ro, rewards: torch.Tensor, weights, k: int = 2, columns=None) -> list[dict]:
    """The completions table's rows: the first sample of each of the first
    k prompts, as {"prompt", "completion", "reward" (total), then a column
    for each of `columns`, what reward functions logged with log_extra
    (TRL's table puts them after its own)}. rewards: [n, K] this rank's;
    columns: {name: [n] values}."""
    G = ro.num_generations
    shown = range(0, min(k * G, len(ro.prompts)), G)
    # each shown row's total, read at once
    totals = read_floats([total_reward(rewards[i : i + 1], weights)[0] for i in shown])
    out = []
    for i, reward in zip(shown, totals, strict=True):
        prompt = ro.prompts[i]
        completion = ro.completions[i]
        if not isinstance(prompt, str):
            prompt = prompt[-1]["content"]
        if not isinstance(completion, str):
            completion = conversation_text(completion)
        row = {
            "prompt": prompt,
            "completion": completion,
            "reward": reward,
        }
        for name, values in (columns or {}).items():
            row.setdefault(name, values[i])  # the table's own columns keep their names
        out.append(row)
    return out


def conversation_text(messages: list[dict]) -> str:
    """A completion's messages on one line: assistant text, its tool
    calls as [call name {args}], tool results as [tool: result]."""
    parts = []
    for m in messages:
        if m["role"] != "assistant":
            parts.append(f"[{m['role']}: {m['content']}]")
            continue
        parts.append(m.get("content") or "")
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            parts.append(f"[call {fn['name']} {json.dumps(fn['arguments'])}]")
    return " ".join(p for p in parts if p)
