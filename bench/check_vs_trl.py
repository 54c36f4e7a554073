"""One GRPO micro-batch through TRL and through nanogrpo: same loss, same gradient?

    python bench/check_vs_trl.py out/bench/tiny-init-1337     # any checkpoint dir both can load

TRL's GRPOTrainer samples and scores a generation batch (its own generate, rewards, advantages,
num_items_in_batch); we take its first micro-batch, compute TRL's `compute_loss` and backward on the
HF model, then nanogrpo's `token_logprobs` + `grpo_step` and backward on our Transformer loaded from
the same files, and print the largest gradient difference per parameter. trl/transformers/datasets
are benchmark-only imports.
"""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])


def main(path):
    """Run the comparison on the checkpoint at `path` (dapo, default task, 16 prompts x 8)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from nanogrpo.checkpoint import load_model
    from nanogrpo.extras.builtin_rewards import default_task_reward
    from nanogrpo.extras.datasets import load_dataset
    from nanogrpo.fast.logprobs import token_logprobs
    from nanogrpo.grpo import LossConfig, LossInputs, LossScale, grpo_step

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    args = GRPOConfig(
        output_dir="/tmp/check_vs_trl",
        num_generations=8,
        per_device_train_batch_size=64,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        loss_type="dapo",
        beta=0.0,
        use_cpu=True,
        bf16=False,
        report_to="none",
        gradient_checkpointing=False,
        max_steps=1,
    )
    trainer = GRPOTrainer(
        model=hf,
        reward_funcs=[default_task_reward],
        args=args,
        processing_class=AutoTokenizer.from_pretrained(path),
        train_dataset=Dataset.from_list(load_dataset("default", seed=0)[:64]),
    )
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    mb = {
        k: v[:64] if torch.is_tensor(v) and v.dim() else v for k, v in batch.items()
    }  # first micro-batch
    hf.zero_grad()
    trl_loss = trainer.compute_loss(hf, mb)
    trl_loss.backward()
    trl_grads = dict(hf.named_parameters())

    ours = load_model(path)
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    attention = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    logps, _ = token_logprobs(ours, ids, attention, mb["completion_mask"])
    inputs = LossInputs(
        logps=logps, advantages=mb["advantages"], completion_mask=mb["completion_mask"]
    )
    scale = LossScale(num_items=mb["num_items_in_batch"], grad_accum=2, steps_per_generation=2)
    loss, _ = grpo_step(inputs, LossConfig(loss_type="dapo"), scale)
    loss.backward()
    print(f"loss: TRL {trl_loss.item():+.10f}  nanogrpo {loss.item():+.10f}")
    worst = 0.0
    for name, p in ours.named_parameters():
        hf_name = name if name == "lm_head.weight" else "model." + name
        diff = (p.grad - trl_grads[hf_name].grad).abs().max().item()
        worst = max(worst, diff / max(trl_grads[hf_name].grad.abs().max().item(), 1e-12))
        print(f"  {name:45s} max |grad diff| {diff:.2e}")
    print(f"largest relative gradient difference: {worst:.2e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/bench/tiny-init-1337")
