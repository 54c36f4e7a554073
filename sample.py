"""Sample completions from any HF checkpoint (hub id or directory), a PEFT LoRA adapter directory
(base + adapter), or a train.py output_dir (its newest checkpoint).

    python sample.py --model out/tiny --prompt "bhad=" --num_samples 4
    python sample.py --model Qwen/Qwen2.5-0.5B-Instruct --chat "What is 12*7?" --temperature 0.7 \\
        --reward accuracy --column answer=84

`--prompt` is sent as plain text; `--chat` as one user message through the chat template. With
`--reward`, each completion is scored by that reward function (built-in name or module:function);
`--column key=value` supplies the dataset columns the function reads (e.g. answer, target).
Errors are one line, as train.py's (the traceback with --debug or NANOGRPO_DEBUG=1).
"""

import argparse
import os
import re
import sys

import torch

import nanogrpo.extras.lora  # noqa: F401 (registers LoRA with the loader: an adapter dir loads)
from nanogrpo import sampler
from nanogrpo.checkpoint import load_model
from nanogrpo.extras.reward_funcs import resolve_reward_funcs
from nanogrpo.fast.sampling import sample_next_token_fast
from nanogrpo.grpo import total_reward
from nanogrpo.rewards import RewardError, score_completions
from nanogrpo.run.report import open_sampling_progress
from nanogrpo.sampler import Sampling, generate
from nanogrpo.tokenizer import Tokenizer


def newest_checkpoint(path: str) -> str:
    """A train.py output_dir -> the checkpoint it holds: the `checkpoint` link (train.py moves it
    to each checkpoint once complete), else the highest checkpoint-<step>. Any other path (a
    checkpoint dir, an adapter dir, a hub id) as given."""
    model_files = ("config.json", "adapter_config.json")
    if not os.path.isdir(path) or any(os.path.exists(os.path.join(path, f)) for f in model_files):
        return path
    latest = os.path.join(path, "checkpoint")
    if os.path.isdir(latest):
        return latest
    steps = [re.fullmatch(r"checkpoint-(\d+)", name) for name in os.listdir(path)]
    steps = [int(m.group(1)) for m in steps if m]
    if not steps:
        raise FileNotFoundError(
            f"{path} is neither a checkpoint (no config.json or adapter_config.json) nor a "
            "train.py output_dir (no checkpoint or checkpoint-<step> in it)"
        )
    return os.path.join(path, f"checkpoint-{max(steps)}")


def column(text: str) -> tuple[str, str]:
    """--column's 'key=value' -> (key, value)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected key=value, e.g. target=bhad")
    return key, value


def main(argv=None):
    """Parse the command line, sample, print the completions (and their rewards)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", required=True, help="hub id, checkpoint dir, or a train.py output_dir"
    )
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="plain-text prompt")
    text.add_argument("--chat", help="a user message, rendered with the chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--num_samples", type=int, default=4)
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--min_p", type=float, default=0.0)
    p.add_argument("--repetition_penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument(
        "--reward", action="append", default=[], help="reward function to score with (repeatable)"
    )
    p.add_argument(
        "--column",
        action="append",
        default=[],
        type=column,
        help="key=value dataset column for the reward",
    )
    args = p.parse_args(argv)

    funcs = resolve_reward_funcs(args.reward) if args.reward else []  # a bad name fails fast
    path = newest_checkpoint(args.model)
    if path != args.model:
        print(f"model: {path}")
    model = load_model(path, dtype=args.dtype, device=args.device).eval()  # an adapter: base + it
    tok = Tokenizer.from_pretrained(path)  # an adapter without a tokenizer: its base model's
    if args.chat is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt = messages + [{"role": "user", "content": args.chat}]
    else:
        prompt = args.prompt
    prompt_ids = tok.encode_prompt(prompt)
    room = model.config.max_position_embeddings - len(prompt_ids)  # the context caps generation
    if room < 1:
        raise ValueError(
            f"the prompt ({len(prompt_ids)} tokens) fills the model's whole context "
            f"({model.config.max_position_embeddings} positions)"
        )
    max_new_tokens = min(args.max_new_tokens, room)
    generator = torch.Generator(args.device).manual_seed(args.seed)
    settings = Sampling(
        max_new_tokens=max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop_ids=tok.eos_token_ids,
        pad_id=tok.pad_token_id,
        vocab_size=tok.vocab_size,
        sample_token=sample_next_token_fast,
    )
    progress = open_sampling_progress()  # a status line on a terminal, else None
    sampler.on_decode_step = progress  # called after each decode step
    try:
        with torch.no_grad():
            out = generate(
                model, [prompt_ids], settings, num_samples=args.num_samples, generator=generator
            )
    finally:
        sampler.on_decode_step = None
    if progress is not None:
        progress.clear()
    ids, texts = tok.decode_completions(out.completion_ids, out.completion_mask)
    rewards = None
    if funcs:
        columns = dict(args.column)
        completions = (
            texts
            if isinstance(prompt, str)
            else [[{"role": "assistant", "content": t}] for t in texts]
        )
        rewards = score_completions(
            funcs,
            [prompt] * len(texts),
            completions,
            ids,
            {k: [v] * len(texts) for k, v in columns.items()},
        )
    print(
        f"prompt ({len(prompt_ids)} tokens): {tok.decode(prompt_ids, skip_special_tokens=False)!r}"
    )
    for i, t in enumerate(texts):
        tail = " (truncated)" if out.truncated[i] else ""
        score = ""
        if rewards is not None:
            score = " | " + ", ".join(
                f"{name}={rewards[i, k].item():.3f}" for k, (name, _) in enumerate(funcs)
            )
            if len(funcs) > 1:
                score += f", total={total_reward(rewards[i : i + 1]).item():.3f}"
        print(f"--- sample {i} ({len(ids[i])} tokens{tail}{score})\n{t}")


def cli(argv: list[str]) -> int:
    """`python sample.py ...`: user errors are one line (the traceback with --debug or
    NANOGRPO_DEBUG=1), a failing reward function included; Ctrl-C exits with 130."""
    debug = "--debug" in argv or os.environ.get("NANOGRPO_DEBUG") == "1"
    try:
        main([a for a in argv if a != "--debug"])
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, RewardError) as e:
        if debug:
            raise
        print(f"sample.py: error: {e}\n(the traceback: add --debug)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
