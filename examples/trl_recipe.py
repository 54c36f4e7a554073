"""A TRL user's GRPO recipe in TRL's names only: the seeds' expert-guide GRPOConfig and
LoraConfig, their reward functions defined inline, on SmolLM2-135M-Instruct with chat prompts
(a system prompt and an `answer` column), at a batch a CPU runs in ~4 minutes:

    python tests/fetch_real.py && python train.py --config examples/trl_recipe.py

The recipe's optim="adamw_8bit" is refused (it needs bitsandbytes): adamw_torch here. Its 1 x 4
completions a step are not whole groups of 8 (TRL refuses them too): 8 x 1 here. output_dir/merged
loads in transformers' pipeline("text-generation").
"""

import re

model = ".cache/real/smollm2-135m-instruct"
dataset = "addition"  # chat prompts with a system prompt, and an `answer` column


def correctness_reward(prompts, completions, answer, **kwargs):
    texts = [c[-1]["content"] for c in completions]
    return [1.0 if re.findall(r"-?\d+", t)[-1:] == [a] else 0.0 for t, a in zip(texts, answer)]


def reward_len(completions, **kwargs):
    return [-abs(20 - len(c[-1]["content"])) / 20 for c in completions]


reward_funcs = [correctness_reward, reward_len]
output_dir = "outputs/grpo-model"
learning_rate = 5e-6
adam_beta1 = 0.9
adam_beta2 = 0.99
weight_decay = 0.1
warmup_ratio = 0.1
lr_scheduler_type = "cosine"
per_device_train_batch_size = 8
gradient_accumulation_steps = 1
num_generations = 8
max_prompt_length = 256
max_completion_length = 32
num_train_epochs = 1
max_steps = 3
bf16 = False
optim = "adamw_torch"
max_grad_norm = 0.1
logging_steps = 1
save_steps = 100
report_to = "none"
# LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear")
use_peft = True
lora_r = 16
lora_alpha = 32
lora_dropout = 0.05
lora_target_modules = "all-linear"
merge_adapter = True
