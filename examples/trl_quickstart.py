"""TRL's GRPO quickstart (its docs' train_grpo.py) with its import changed: `from nanogrpo import
GRPOConfig, GRPOTrainer`. The model and the data are local: the embedded default's tiny model
(out/tiny-init, which `python train.py` builds) and its copy task, so it runs offline on a CPU
in under a minute:

    python train.py --max_steps=1 && python examples/trl_quickstart.py

TRL's quickstart trains Qwen/Qwen2-0.5B-Instruct on trl-lib/tldr with reward_len and
GRPOConfig(output_dir="Qwen2-0.5B-GRPO"); here a random 0.12M-parameter model learns to copy,
so it takes the embedded default's settings (configs/tiny.py) under TRL's names.
torchrun --nproc_per_node 2 runs it too.
"""

from nanogrpo import GRPOConfig, GRPOTrainer
from nanogrpo.extras.builtin_rewards import default_task_score
from nanogrpo.extras.datasets import load_dataset

dataset = load_dataset("default", split="train")  # rows {"prompt": "bhad=", "target": "bhad"}


# Define the reward function, which rewards completions that copy the row's target
def reward_copy(completions, target, completion_ids, **kwargs):
    return [
        default_task_score(completion, want, len(ids))
        for completion, want, ids in zip(completions, target, completion_ids)
    ]


training_args = GRPOConfig(
    output_dir="out/tiny-GRPO",
    learning_rate=1e-3,
    adam_beta2=0.99,
    lr_scheduler_type="constant",
    per_device_train_batch_size=64,
    gradient_accumulation_steps=2,
    max_completion_length=8,
    max_steps=400,
    logging_steps=10,
    gradient_checkpointing=False,
    bf16=False,
    use_cpu=True,
    seed=1337,
)
trainer = GRPOTrainer(
    model="out/tiny-init",
    reward_funcs=reward_copy,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
