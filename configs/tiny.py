# The embedded default: what `python train.py` runs. Offline, CPU, about 40 seconds on 2 cores.
#
# A 0.12M-parameter (124,224) Qwen2-shaped model is created from scratch (random weights, a
# char-level tokenizer), saved in Hugging Face format at out/tiny-init, and loaded back through
# the same load_model path as any hub checkpoint. It then learns the default task by RL alone:
# copy a 4-letter string, "bhad=" -> "bhad" + eos, with a dense per-character reward
# (nanogrpo/extras/tasks.py and builtin_rewards.default_task_score explain the task and why it
# is learnable).
#
# The learning rate is what makes it reliable: higher rates learn faster but some seeds stall,
# copying some letters as another. 400 steps leave a margin; bench/bench_seeds.py measures
# how reliably it learns over many seeds (README's table).

model = "out/tiny-init"
init_model = dict(
    model_type="qwen2",
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)
init_tokenizer_chars = "abcdefgh="
device = "cpu"
bf16 = False
seed = 1337

dataset = "default"
eval_dataset = "default"
eval_split = "test"
eval_size = 64
num_generations_eval = 1  # held-out pass@1: one sample a problem (None: num_generations)
eval_strategy = "steps"
eval_steps = 100
reward_funcs = ["default_task"]

num_generations = 8
gradient_accumulation_steps = 2  # x 64 = 16 prompts x 8 completions a step
per_device_train_batch_size = 64
max_completion_length = 8
temperature = 1.0

loss_type = "dapo"
learning_rate = 1e-3
adam_beta2 = 0.99
max_grad_norm = 1.0
max_steps = 400
logging_steps = 1
lr_scheduler_type = "constant"
gradient_checkpointing = False
save_steps = 100
output_dir = "out/tiny"
