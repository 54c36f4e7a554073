# Qwen2.5-0.5B-Instruct on GSM8K with accuracy + format rewards, for 8 GPUs:
#
#     torchrun --nproc_per_node 8 train.py --config small.py
#
# Each optimizer step: 64 prompts x 8 completions = 512 completions, 64 per GPU in micro-batches of
# 16 (gradient accumulation 4). FSDP2 shards the model; bf16 compute with fp32 master weights.
# On any other number of GPUs it runs as is, with 64 completions (8 prompts) a step per GPU; a
# group may span GPUs, as in TRL. For the same 512 completions a step on fewer GPUs, raise
# gradient_accumulation_steps to 32 / GPUs (8 on 4 GPUs, 32 on one).

model = "Qwen/Qwen2.5-0.5B-Instruct"
device = "cuda"
bf16 = True
gradient_checkpointing = True
# the compiled decode step (CUDA graphs; ~20 s to compile once). One GRPO step of this config's
# per-GPU shape on an H200 (bench/gpu_check.py, the 0.5B shape): 3.4 s with it, 16.9 s without
# (sampling 2.3 s against 15.9 s): an eager decode step is ~300 kernel launches
torch_compile = True

dataset = "gsm8k"
dataset_split = "train"
eval_dataset = "gsm8k"
eval_split = "test"
eval_size = 256
eval_strategy = "steps"
eval_steps = 50
reward_funcs = ["accuracy", "format"]
reward_weights = [1.0, 0.2]

num_generations = 8
gradient_accumulation_steps = 4  # x 16 x 8 GPUs = 512 completions: 64 prompts x 8
per_device_train_batch_size = 16
max_completion_length = 512
temperature = 1.0

loss_type = "dapo"
epsilon = 0.2
epsilon_high = 0.28  # DAPO's clip-higher
beta = 0.0
learning_rate = 1e-6
lr_scheduler_type = "constant"
adam_beta2 = 0.99
logging_steps = 1
seed = 1337
warmup_steps = 10
max_grad_norm = 1.0
max_steps = 500
save_steps = 100
log_completions = True
output_dir = "out/small"
