"""Held-out evaluation of any checkpoint with a training config's eval settings: the "before" number.

    python bench/eval_heldout.py --config smollm.py --model=.cache/real/smollm2-135m-instruct
    python bench/eval_heldout.py --config smollm.py --model=out/smollm/checkpoint
    python bench/eval_heldout.py --config vault.py --model=... --completions=out/eval.jsonl

train.py evaluates every eval_steps steps and at the end, never before the first step; this script
runs the very same `train.evaluate` (same eval rows, sampling settings and sampling seed) on the
checkpoint given as --model, so before and after are measured alike. Prints one JSON line with
eval/pass@1, its standard error sqrt(p (1 - p) / n), eval/reward and per-function means.
--completions=FILE also writes every eval completion, one JSON line each: its eval row and that
row's columns (not the prompt), its rewards (one per function, null = unscored), the completion as
the reward functions received it, its text as sampled (tool results included, special tokens
kept: a malformed tool call shows as written) and its tool calls and failures.
"""

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    """Load the config and the checkpoint, evaluate on the eval split, print the metrics."""
    from types import SimpleNamespace

    import torch

    import nanogrpo.extras.lora  # noqa: F401 (registers LoRA with the loader: --model may be an adapter)
    import train
    from nanogrpo import distributed as dist
    from nanogrpo.checkpoint import load_model
    from nanogrpo.extras.custom_rollout import resolve_rollout_func
    from nanogrpo.extras.datasets import load_dataset
    from nanogrpo.extras.environments import Environments
    from nanogrpo.extras.generation_kwargs import sampling_of
    from nanogrpo.extras.loss_terms import loss_settings
    from nanogrpo.extras.reward_funcs import resolve_reward_funcs
    from nanogrpo.extras.tool_rounds import ToolTurns, tool_rules
    from nanogrpo.extras.tools import resolve_tools
    from nanogrpo.extras.trainer_info import trainer_state_of
    from nanogrpo.run.configurator import load_config
    from nanogrpo.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(add_help=False)  # the rest goes to the config
    parser.add_argument("--completions", default=None)
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(rest)
    if not cfg.eval_dataset:
        raise SystemExit("the config has no eval_dataset")
    info = dist.setup(cfg.device)
    t0 = time.time()
    tok = Tokenizer.from_pretrained(cfg.model)
    model = load_model(cfg.model, dtype=torch.float32, device=info.device).eval()
    funcs = resolve_reward_funcs(
        cfg.reward_funcs,
        max_completion_length=cfg.max_completion_length,
        soft_punish_cache=cfg.soft_punish_cache,
    )
    tools = (
        resolve_tools(cfg.tools) if cfg.tools else None
    )  # a tool-calling config evaluates with its tools
    weights = cfg.reward_weights or [1.0] * len(funcs)
    envs = None  # an environment config evaluates in its environments, with their rewards
    if cfg.environment_factory is not None:
        envs = Environments(cfg.environment_factory, tools, tool_rules(cfg))
        funcs += envs.reward_funcs()
        weights = weights + [1.0] * len(envs.reward_funcs())
    rows = load_dataset(
        cfg.eval_dataset, split=cfg.eval_split, seed=cfg.seed, needs_prompt=envs is None
    )[: cfg.eval_size]
    train_rows = rows  # an environment config's or a procedural task's training set may be large
    if cfg.dataset:
        train_rows = load_dataset(
            cfg.dataset, split=cfg.dataset_split, seed=cfg.seed, needs_prompt=envs is None
        )
    t = SimpleNamespace(
        cfg=cfg,
        info=info,
        tok=tok,
        model=model,
        eval_rows=rows,
        reward_funcs=funcs,
        reward_weights=torch.tensor(weights),
        turns=ToolTurns(tools, rules=tool_rules(cfg)) if tools else None,
        sampling=sampling_of(cfg, tok, train.kernels(cfg)),
        environments=envs,
        rollout_func=resolve_rollout_func(cfg.rollout_func),
        autocast=dist.autocast(info, cfg.use_bf16(info.device)),
        kernels=train.kernels(cfg),  # the draw and decode step training samples with
        # what the reward functions' trainer_state and eval/loss read: step 0, the training
        # prompts' count, the loss settings; no reference model (as before the first step)
        step=0,
        prompts=SimpleNamespace(rows=train_rows),
        loss_cfg=loss_settings(**cfg.loss_config())[0],
        loss_terms=None,
        ref=None,
    )
    t.state = trainer_state_of(t)
    if ours.completions:  # evaluate's rollout, written out as it is scored
        score = train.reward_rollout

        def reward_rollout(ro, funcs, t=None, logs=None):
            rewards = score(ro, funcs, t, logs)
            write_completions(ours.completions, ro, rewards, tok)
            return rewards

        train.reward_rollout = reward_rollout
    m = train.evaluate(t)  # reads these fields of nanogrpo.trainer.Trainer
    p, n = m["eval/pass@1"], len(rows)
    m.update(
        {
            "model": cfg.model,
            "eval_size": n,
            "eval/pass@1_se": math.sqrt(p * (1 - p) / n),
            "seconds": round(time.time() - t0, 1),
            "load_avg_1min": os.getloadavg()[0],
        }
    )
    print(json.dumps(m))
    dist.teardown()


def write_completions(path: str, ro, rewards, tok) -> None:
    """One JSON line per completion of the rollout ro, rewards [n, K] (see the docstring above)."""
    G = ro.num_generations
    scores = [[None if r != r else r for r in row] for row in rewards.tolist()]  # NaN -> null
    counts = {
        k: getattr(ro, k) for k in ("tool_calls", "tool_failures") if getattr(ro, k) is not None
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for i, completion in enumerate(ro.completions):
            row = ro.rows[i // G]
            line = {
                "row": i // G,
                "columns": {k: v for k, v in row.items() if k != "prompt"},
                "rewards": scores[i],
                "completion": completion,
                "text": tok.decode(ro.completion_token_ids[i], skip_special_tokens=False),
                **{k: int(v[i]) for k, v in counts.items()},
            }
            f.write(json.dumps(line, default=str) + "\n")


if __name__ == "__main__":
    main()
