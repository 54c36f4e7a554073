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
# over seeds: python bench/bench_seeds.py --config vault.py --seeds 0,1,2,3,4 --before
#
# The reward (examples/vault_game.py's get_reward): 1 for an opened vault, 0.4 for reading the note
# and then trying a code, 0 for reading it and stopping. When reading alone earned 0.2, groups
# whose completions all read and stopped tied at 0.2, with no advantage left to leave it (seeds 0
# and 1 settled there). With reading worth nothing, a group moves only on completions that go on
# to try a code, so nothing else is reinforced meanwhile; but the first success has to come by
# chance, and at 2 rooms x 8 completions, temperature 1, seed 2 saw none in 12 steps (held-out
# 0.016, as before training). What gives every seed a first success early, and a signal after it:
# - temperature 0.7: at 1.0 the 135M model writes malformed calls and rambles; at 0.7 it opens
#   the vault in ~7% of its untrained tries instead of ~3% (held-out before training 0.078),
# - 4 rooms a step, not 2: the untrained model opens some rooms and never others, so 4 rooms a
#   step find a first success sooner,
# - AdamW without momentum (adam_beta1 = 0): when every group of a step ties (no success yet, or
#   all succeed) the gradient is 0, but at the default 0.9 AdamW goes on applying its past
#   updates. At 4 x 4, seed 3's one early success was the only gradient of its run and momentum
#   applied it through 10 steps: malformed calls 50% -> 82%, held-out 0.000. At 4 x 8, seed 0
#   solved its rooms by step 3 and the tied steps after kept moving it: train reward 1.0 at step
#   7, 0.0 at step 8, held-out 0.000. With 0, a tied step leaves the weights as they are,
# - 8 completions a room (32 a step), not 4: a step without a success is rarer (0.93^32 = 10%
#   of steps at the untrained success rate, against 31% at 16), and without momentum an update
#   is one step's gradient, so it averages twice the completions,
# - learning rate 2e-5 over 10 steps, not 3e-5 over 8: AdamW divides each weight's gradient by the
#   root of its running mean square, so a weight moves about lr a step whether the step saw one
#   success or twenty, and one step can rewrite the policy. At 3e-5 seed 1's step-3 update sent
#   every completion to open_vault before reading (train reward 0.53, then 0 at every step, every
#   group tied: held-out 0.000); at 2e-5 its step 4 fell to 0.03 too, but kept a success to learn
#   from, and recovered by step 5. 10 steps give the slower seeds room,
# - codes without a leading zero (the model writes a code as a JSON number; 0693 is not JSON), and
#   the worked room writes its code as a number too (examples/vault_game.py): with a string there,
#   trained seed 2 mixed the two forms, {"code": 2033"}}}, broken calls (held-out 0.656).
# Paying 0.1 for any call the room ran (a well-formed call above a malformed one) was tried on
# seed 3 (at 4 x 4): by step 4 every completion earned 0.1, and every group tied there.
# Held-out 0.078 before; 0.984 (63 of 64 rooms) on each of seeds 0-4, 14.5-17 min a run.
# Results, per seed: docs/results.md#environment-demo-configsvaultpy.

model = ".cache/real/smollm2-135m-instruct"  # tests/fetch_real.py builds it
device = "auto"
seed = 0

dataset = "out/vault/rooms.jsonl"
eval_dataset = "out/vault/rooms_test.jsonl"
eval_size = 64
num_generations_eval = 1  # held-out pass@1: one sample a problem (None: num_generations)
# held-out: python bench/eval_heldout.py --config vault.py [--model=out/vault/checkpoint]
environment_factory = "examples/vault_game.py:VaultRoom"
reward_funcs = []  # the environment owns the reward
max_tool_calling_iterations = 3

num_generations = 8  # 4 rooms x 8 completions a step (above)
gradient_accumulation_steps = 1
per_device_train_batch_size = 32
max_completion_length = 96  # two calls (~20 tokens each), their results (~15 each), an answer
temperature = 0.7  # eval samples at it too (train.py's evaluate)

loss_type = "dapo"
beta = 0.0
learning_rate = 2e-5  # (above)
max_grad_norm = 1.0
max_steps = 10  # (above)
save_steps = 0
logging_steps = 1
lr_scheduler_type = "constant"
adam_beta1 = 0.0  # no momentum: a step whose groups all tie changes nothing (above)
adam_beta2 = 0.99
gradient_checkpointing = False
log_completions = True
output_dir = "out/vault"
