"""Algorithm options and product features beyond the course: each module is one thing a run turns
on by a setting, for the reader who needs it once the course (the top-level modules and train.py)
is read. Most are TRL GRPOTrainer's options, under its names.

- extras/loss_terms.py: the options around the loss (the off-policy sequence mask,
  top_entropy_quantile, the entropy bonus and its adaptive coefficient) and their settings
- extras/dynamic_sampling.py: DAPO's dynamic sampling (groups without reward spread redrawn)
- extras/tools.py, extras/tool_rounds.py: tool calling (schemas, parsing, the tool rounds)
- extras/environments.py: environment_factory; extras/custom_rollout.py: rollout_func
- extras/generation_kwargs.py: generation_kwargs (suppress_tokens, min_new_tokens, stop strings)
- extras/lora.py: LoRA adapters, as PEFT defines them
- extras/reward_funcs.py, extras/reward_model.py, extras/builtin_rewards.py,
  extras/math_answers.py: reward entries resolved, reward models, the built-in reward functions
- extras/tasks.py, extras/datasets.py: built-in prompt tasks, loading datasets by name
- extras/lr_schedules.py: the learning-rate schedules
- extras/trainer_info.py: the run's TrainerState, which reward functions receive as
  trainer_state

Does not know about: the run, checkpoints or processes: this file imports nothing; each module's
own docstring says what it knows.
"""
