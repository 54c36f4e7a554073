"""Run TRL's GRPOTrainer on a nanogrpo checkpoint with nanogrpo's settings; benchmark helper.

    python bench/trl_runner.py --model out/tiny-init --output_dir out/bench/trl --max_steps 20 --seed 1337

Loads the checkpoint directory with transformers' Auto classes, builds a `datasets.Dataset` from
`nanogrpo.extras.datasets.load_dataset(dataset, seed=seed)`, uses nanogrpo's reward functions by
name (`--reward_funcs`, default `default_task`; `--reward_weights` as TRL's reward_weights), and
trains with a GRPOConfig set to what `python train.py --config tiny.py` does (every TRL default that
differs from ours overridden: no gradient checkpointing, fp32 on CPU, constant lr, beta2 0.99,
logging every step, no checkpoints). One optimizer step = per_device_train_batch_size x gradient_accumulation_steps
completions (num_generations per prompt), as in train.py, with gradient
accumulation, exactly like nanogrpo's batch arithmetic.

Writes <output_dir>/metrics.jsonl, one line per optimizer step, with nanogrpo's key names so the same
tools read both: step, reward, reward_std, step_time, time/sample, time/score, time/update,
completions/mean_length, loss, grad_norm, plus loop_time (previous step end -> this step end,
which adds data loading and logging). And <output_dir>/run_info.json (versions, threads, peak RSS).

Time split (TRL exposes none of it with report_to="none", so a subclass times its own methods):
    sample = GRPOTrainer._generate_single_turn (left-pad prompts, model.generate, cut at eos)
    score  = _generate_and_score_completions minus sample (tokenize prompts, decode, reward
             functions, advantages, metrics)
    update = step_time minus both (forward/backward of every micro-batch, clip, optimizer step)
    step_time = on_step_begin -> on_step_end of a TrainerCallback.
trl, transformers and datasets are benchmark-only imports, never nanogrpo runtime dependencies.
"""

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        required=True,
        help="checkpoint dir (config.json, model.safetensors, tokenizer.json)",
    )
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--dataset", default="default")
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--per_device_train_batch_size", type=int, default=64)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--max_completion_length", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0, help="0 = off")
    p.add_argument(
        "--reward_funcs", default="default_task", help="comma-separated nanogrpo reward names"
    )
    p.add_argument(
        "--reward_weights", default=None, help="comma-separated floats, one per reward function"
    )
    p.add_argument("--soft_punish_cache", type=int, default=None)
    p.add_argument("--loss_type", default="dapo")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--adam_beta2", type=float, default=0.99)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument(
        "--threads", type=int, default=0, help="torch.set_num_threads (0 = leave torch's default)"
    )
    p.add_argument(
        "--save_final",
        default=None,
        help="also save the trained model + tokenizer here (HF format), "
        "e.g. for bench/eval_heldout.py",
    )
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nanogrpo.extras.datasets import load_dataset
    from nanogrpo.extras.reward_funcs import resolve_reward_funcs

    if args.threads:
        torch.set_num_threads(args.threads)
    grad_accum = args.gradient_accumulation_steps

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that adds up the seconds spent generating, and generating + scoring."""

        timers = {"sample": 0.0, "sample_and_score": 0.0}

        def _generate_single_turn(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                self.timers["sample"] += time.perf_counter() - t0

        def _generate_and_score_completions(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **k)
            finally:
                self.timers["sample_and_score"] += time.perf_counter() - t0

    records: dict[int, dict] = {}

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t_begin = None
            self.t_last_end = None

        def on_train_begin(self, args_, state, control, **kw):
            self.t_last_end = time.perf_counter()

        def on_step_begin(self, args_, state, control, **kw):
            for k in TimedGRPOTrainer.timers:
                TimedGRPOTrainer.timers[k] = 0.0
            self.t_begin = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            now = time.perf_counter()
            step_time = now - self.t_begin
            t = TimedGRPOTrainer.timers
            records[state.global_step] = {
                "step": state.global_step,
                "step_time": step_time,
                "loop_time": now - self.t_last_end,
                "time/sample": t["sample"],
                "time/score": t["sample_and_score"] - t["sample"],
                "time/update": step_time - t["sample_and_score"],
            }
            self.t_last_end = now

        def on_log(self, args_, state, control, logs=None, **kw):
            rec = records.get(state.global_step)
            if rec is not None and logs and "reward" in logs:
                for key in (
                    "reward",
                    "reward_std",
                    "loss",
                    "grad_norm",
                    "completions/mean_length",
                    "frac_reward_zero_std",
                    "entropy",
                    "learning_rate",
                ):
                    if key in logs:
                        rec[key] = float(logs[key])

    reward_funcs = [
        fn
        for _, fn in resolve_reward_funcs(
            args.reward_funcs.split(","),
            max_completion_length=args.max_completion_length,
            soft_punish_cache=args.soft_punish_cache,
        )
    ]
    weights = [float(w) for w in args.reward_weights.split(",")] if args.reward_weights else None
    rows = load_dataset(args.dataset, seed=args.seed)
    dataset = Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=args.output_dir,
        num_generations=args.num_generations,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=grad_accum,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_k=args.top_k,
        reward_weights=weights,
        loss_type=args.loss_type,
        beta=args.beta,
        learning_rate=args.learning_rate,
        adam_beta1=0.9,
        adam_beta2=args.adam_beta2,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=args.max_grad_norm,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        max_steps=args.max_steps,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    t_setup = time.perf_counter() - t_start
    trainer.train()
    t_total = time.perf_counter() - t_start
    if args.save_final:
        trainer.save_model(
            args.save_final
        )  # model, tokenizer (processing_class) and generation_config
        tokenizer.save_pretrained(args.save_final)

    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "metrics.jsonl"), "w") as f:
        for step in sorted(records):
            f.write(json.dumps(records[step]) + "\n")
    info = {
        "trainer": "trl",
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "setup_s": t_setup,
        "total_s": t_total,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "grad_accum": grad_accum,
        "args": vars(args),
    }
    with open(os.path.join(args.output_dir, "run_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    last = records[max(records)] if records else {}
    print(
        f"trl: {len(records)} steps, last reward {last.get('reward', float('nan')):.3f}, "
        f"setup {t_setup:.1f}s, total {t_total:.1f}s, peak RSS {info['peak_rss_mb']:.0f} MB",
        flush=True,
    )


if __name__ == "__main__":
    main()
