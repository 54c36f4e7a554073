# Tool calling (TRL's `tools=`): SmolLM2-135M-Instruct learns to use a calculator for 3-digit x
# 2-digit products, which it cannot compute itself. First write the prompts, then train:
#
#     python examples/tool_calculator.py && python train.py --config tools.py
#
# The tool, the prompts and the reward live in examples/tool_calculator.py: a short system prompt
# with the <tool_call> format and one worked example conversation before each question (~170
# prompt tokens). README gives held-out pass@1 before and after the 12 steps, and the curves.
# Completions are multi-turn: the model's <tool_call>, the tool's result (context only, never
# trained on), the model's answer; the whole completion stays within max_completion_length.
# Logged: tools/call_frequency (calls per completion), tools/failure_frequency (failed share of
# calls), tools/mean_turns, and the weight-0 `tool_called`.

model = ".cache/real/smollm2-135m-instruct"  # tests/fetch_real.py builds it
device = "auto"
seed = 0

dataset = "out/tools/products.jsonl"
eval_dataset = "out/tools/products_test.jsonl"
eval_size = 64
num_generations_eval = 1  # held-out pass@1: one sample a problem (None: num_generations)
# held-out: python bench/eval_heldout.py --config tools.py [--model=out/tools/checkpoint]
reward_funcs = [
    "examples/tool_calculator.py:product_reward",
    "examples/tool_calculator.py:tool_called",
]
reward_weights = [1.0, 0.0]
tools = ["examples/tool_calculator.py:multiply"]
max_tool_calling_iterations = 2
tool_timeout = 10.0

num_generations = 8
# 16 completions a step: the ~170-token prompts make each update ~8x a 16-token one
gradient_accumulation_steps = 1
per_device_train_batch_size = 16
max_completion_length = 64  # a call is ~30 tokens, the tool's turn ~12, the answer ~5
temperature = 1.0

loss_type = "dapo"
beta = 0.0
learning_rate = 3e-5  # as configs/smollm.py: a few dozen steps on CPU
max_grad_norm = 1.0
max_steps = 12  # every group is solved by step ~6: later steps have zero advantages
save_steps = 0
logging_steps = 1
lr_scheduler_type = "constant"
adam_beta2 = 0.99
gradient_checkpointing = False
log_completions = True
output_dir = "out/tools"
