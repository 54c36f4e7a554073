# Environments (TRL's `environment_factory`): SmolLM2-135M-Instruct is to learn to open a vault in
# an escape room, in turns: read the note (a tool), then try the code it read (another tool).
# First write the rooms, then train:
#
#     python examples/vault_game.py && python train.py --config vault.py
#
# The environment class, the rooms and the prompt live in examples/vault_game.py. Each completion
# plays its own room (one VaultRoom instance a completion, reset with the row's `code`); the room's
# methods are the tools and its get_reward is the reward (logged as rewards/VaultRoom/mean). The
# tools' results are context, never trained on. README gives held-out success before and after,
# over seeds: python bench/bench_seeds.py --config vault.py --seeds 0,1,2,3 --before
#
# The reward (examples/vault_game.py's get_reward): 1 for an opened vault, 0.4 for reading the note
# and then trying a code, 0 for reading it and stopping. When reading alone earned 0.2, the first
# rounds, where some completions read the note and almost none opens the vault, rewarded the whole
# read-and-stop completion, the end of the turn after the note included; on seeds 0 and 1 every
# completion soon read and stopped, every group tied at 0.2 and no advantage was left to leave it
# (docs/results.md). Now a group moves only on completions that go on to try a code: the first
# steps may have none (reward 0, nothing learned), but nothing else is reinforced meanwhile, and the
# first try or success gets its group's whole advantage. Seeds 0, 1 and 3 then learn the room
# (held-out 0.812, 0.953, 0.906); seed 2 does not: none of its completions reads and then tries a
# code in 12 steps, so no group ever has an advantage (0.016, as before training). The rest is as
# before: 2 rooms x 8 completions a step, temperature 1, lr 3e-5.

model = ".cache/real/smollm2-135m-instruct"  # tests/fetch_real.py builds it
device = "auto"
seed = 0

dataset = "out/vault/rooms.jsonl"
eval_dataset = "out/vault/rooms_test.jsonl"
eval_size = 64
# held-out: python bench/eval_heldout.py --config vault.py [--model=out/vault/checkpoint]
environment_factory = "examples/vault_game.py:VaultRoom"
reward_funcs = []  # the environment owns the reward
max_tool_calling_iterations = 3

num_generations = 8
gradient_accumulation_steps = 1
per_device_train_batch_size = 16
max_completion_length = 96  # two calls (~20 tokens each), their results (~15 each), an answer
temperature = 1.0

loss_type = "dapo"
beta = 0.0
learning_rate = 3e-5  # as configs/tools.py
max_grad_norm = 1.0
max_steps = 12  # seed 0: every completion opens the vault at step 9 (no advantage left)
save_steps = 0
logging_steps = 1
lr_scheduler_type = "constant"
adam_beta2 = 0.99
gradient_checkpointing = False
log_completions = True
output_dir = "out/vault"
