# A real pretrained model learns on a CPU: SmolLM2-135M-Instruct on two-number addition.
#
#     python train.py --config smollm.py                      # from the hub
#     python train.py --config smollm.py --model=.cache/real/smollm2-135m-instruct  # fetched
#
# The task (addition, nanogrpo/extras/tasks.py): "What is 12 + 7?" with the system prompt "Answer
# with just the number.", a, b in 1..25; the held-out split is a disjoint quarter of the problems.
# SmolLM2-135M starts weak at it: it answers "10 + 18 = 22" or rambles. Rewards: accuracy (the
# last number equals a + b) and brevity (soft_overlong: 0 up to 12 tokens, down to -1 at 16): a
# ramble that runs out of tokens is penalized (and its last number is rarely the sum), a short
# answer never is.
#
# README gives held-out pass@1 before and after the 30 steps (bench/eval_heldout.py).
#
# Sizes are set by the CPU: every step is 4 prompts x 8 completions of at most 16 tokens;
# prompts are ~25 tokens (the short system prompt replaces SmolLM2's default one, which would
# double them).

model = "HuggingFaceTB/SmolLM2-135M-Instruct"
device = "cpu"
bf16 = False
seed = 0

dataset = "addition"
eval_dataset = "addition"
eval_split = "test"
eval_size = 128  # held-out problems, all distinct; standard error of pass@1 <= 0.045
num_generations_eval = 1  # held-out pass@1: one sample a problem (None: num_generations)
eval_strategy = "steps"
eval_steps = 10
reward_funcs = ["accuracy", "soft_overlong"]
reward_weights = [1.0, 0.5]
soft_punish_cache = 4  # free up to 12 tokens ("12 + 7 = 19" is ~10), -1 at 16

num_generations = 8  # enough spread per group for a signal when the model is right ~1 time in 4
gradient_accumulation_steps = 1  # 32 completions: 4 prompts x 8
per_device_train_batch_size = 32
max_completion_length = 16
# Sampling for a 135M model: at temperature 1.0 its long tail of unlikely tokens derails short
# answers into noise (wrong digits, stray words); 0.7 keeps completions on-topic while the 8
# samples of a prompt still differ, so groups have reward variance to learn from. top_k = 50 cuts
# the remaining tail for the same reason. Eval samples with the same settings (train.py's evaluate).
temperature = 0.7
top_k = 50
# The sampler's log-probs are those of the top-k distribution it drew from, so the
# importance-sampling correction (on by default, as in TRL) would weigh each completion by the
# probability mass top-k kept. Off here: TRL's side of bench/bench_smollm_trl.py generates with
# transformers, which applies no correction, and both trainers must run the same algorithm.
vllm_importance_sampling_correction = False

loss_type = "dapo"
beta = 0.0  # no reference model: half the memory and no extra forward per step
learning_rate = 3e-5  # a few dozen steps, so a bolder rate than long runs use (1e-6 .. 1e-5)
lr_scheduler_type = "constant"
adam_beta2 = 0.99
logging_steps = 1
gradient_checkpointing = False
max_grad_norm = 1.0
max_steps = 30
save_steps = 0
log_completions = True
output_dir = "out/smollm"
