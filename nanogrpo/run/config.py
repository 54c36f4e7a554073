"""Every training setting: one dataclass.

Owns: `TrainConfig`'s fields and defaults. Names, meanings and defaults are TRL's GRPOConfig's
(with transformers' TrainingArguments) wherever TRL has the setting; the rules between fields
(`validate`, `check_lora`, `warnings`) are run/rules.py's, which TrainConfig inherits.
run/configurator.py reads a config file and the command line into it; schedules.py derives the
batch Schedule from it, trainer.py the optimizer and its learning-rate schedule.

Does not know about: the model, tokenization, files, or processes: what a setting does is for
train.py and the modules it calls. trainer.py and run/__init__.py check only what needs the
model, the disk or the environment.
"""

import dataclasses
import math
import typing
from dataclasses import dataclass, field

from nanogrpo.extras.loss_terms import TERM_FIELDS
from nanogrpo.grpo import LossConfig
from nanogrpo.run.rules import (  # noqa: F401 (ConfigError: its home for callers)
    RATIO_STEPS,
    ConfigError,
    Rules,
)
from nanogrpo.schedules import Schedule, batch_schedule, total_steps

# TrainConfig has each loss field, with the same name and default
LOSS_FIELDS = tuple(f.name for f in dataclasses.fields(LossConfig)) + TERM_FIELDS
TRUE_WORDS = ("true", "1", "yes")  # how a bool is spelled in text
FALSE_WORDS = ("false", "0", "no")
DEFAULT_OUTPUT_DIR = "trainer_output"  # transformers' output_dir=None


def setting(default=None, help: str = "", *, factory=None, group: str | None = None):
    """A TrainConfig field with its help text in metadata["help"], where
    transformers' HfArgumentParser (and so TRL) keeps it too. `group`
    titles the group this field opens; `factory` makes a mutable default."""
    metadata = {"help": help}
    if group:
        metadata["group"] = group
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig(Rules):
    """All settings of a run. Each field's help says what it means, and
    the first field of a group names the group (train.py --help prints
    them). Names, meanings and defaults are TRL's GRPOConfig's (with
    transformers' TrainingArguments) wherever TRL has the setting."""

    model: str | None = setting(
        None,
        "checkpoint dir or hub id (TRL's model_name_or_path); none by default: "
        "a config file or --model names it",
        group="model",
    )
    init_model: dict | None = setting(
        None, "ModelConfig fields: create a random model at `model` if it does not exist"
    )
    init_tokenizer_chars: str = setting(
        "abcdefgh=", "with init_model: the characters of its char-level tokenizer"
    )
    model_init_kwargs: dict | None = setting(
        None, '{"dtype": "bfloat16"} loads the weights in that dtype (TRL\'s); None = float32'
    )
    bf16: bool | None = setting(
        None,
        "compute in bfloat16 (autocast, or FSDP2 mixed precision; fp32 weights). "
        "None: on CUDA yes, on CPU no (TRL's None means yes; bf16 is slow on CPU)",
    )
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    torch_num_threads: int | None = setting(
        None,
        "CPU threads for torch's ops; None = OMP_NUM_THREADS's if set, else 1 for a model under "
        "20M parameters on CPU (its ops are too small to share: two runs at once stall each "
        "other), else torch's default (the cores)",
    )
    seed: int = setting(42, "seeds init, prompt order and sampling")
    gradient_checkpointing: bool = setting(True, "recompute activations in backward to save memory")
    disable_dropout: bool = setting(False, "set every dropout probability (LoRA's) to 0")

    use_peft: bool = setting(
        False,
        "train LoRA adapters (nanogrpo/extras/lora.py) instead of every weight; base frozen",
        group="LoRA (TRL's ModelConfig names)",
    )
    lora_r: int = setting(16, "adapter rank")
    lora_alpha: int = setting(32, "adapter scaling = lora_alpha / lora_r")
    lora_dropout: float = setting(0.05, "dropout on each adapter's input")
    lora_target_modules: list[str] | str | None = setting(
        None, 'None = q_proj, v_proj (PEFT\'s default); "all-linear"'
    )
    lora_modules_to_save: list[str] | None = setting(
        None, "trained in full and saved with the adapter: embed_tokens, lm_head"
    )
    use_rslora: bool = setting(False, "rank-stabilized scaling lora_alpha / sqrt(lora_r)")
    merge_adapter: bool = setting(
        False,
        "at the end, also write the adapter merged into a full HF checkpoint (output_dir/merged)",
    )

    dataset: str | None = setting(
        "default",
        "see extras/datasets.load_dataset: file, hf://datasets/..., gsm8k, default, "
        "countdown; None: no dataset, only with environment_factory (its reset() writes "
        "each prompt; set max_steps)",
        group="data",
    )
    dataset_split: str | None = setting(None, 'split for gsm8k / procedural tasks (None = "train")')
    eval_dataset: str | None = setting(None, "same forms as dataset; None = no evaluation")
    eval_split: str | None = setting("test", "split of eval_dataset")
    eval_size: int = setting(256, "evaluate on the first this-many eval prompts")
    shuffle_dataset: bool = setting(True, "a new prompt order every epoch")
    max_prompt_length: int | None = setting(
        None, "prompt tokens kept, cut from the left with a warning; None = all"
    )
    chat_template_kwargs: dict | None = setting(
        None, 'extra variables of the chat template, e.g. {"enable_thinking": False}'
    )

    reward_funcs: list = setting(
        help="built-in names, module:function, a reward model, or functions defined "
        "in the config file itself",
        factory=lambda: ["default_task"],
        group="rewards",
    )
    reward_weights: list[float] | None = setting(None, "one per reward function; None = all 1.0")
    reward_processing_classes: list[str | None] | None = setting(
        None, "per reward model: its tokenizer; None = its own"
    )
    soft_punish_cache: int | None = setting(
        None, "soft_overlong reward's window (None = max_completion_length // 4)"
    )

    num_generations: int = setting(
        8, "completions per prompt (G), at least 2", group="batch (TRL's arithmetic)"
    )
    per_device_train_batch_size: int = setting(
        8,
        "completions per forward/backward on one process; an optimizer step trains on "
        "per_device_train_batch_size x gradient_accumulation_steps x processes "
        "completions, a multiple of num_generations",
    )
    gradient_accumulation_steps: int = setting(1, "forward/backwards summed per optimizer step")
    padding_free: bool = setting(
        False,
        "TRL's: each micro-batch's sequences packed into one row, no padding, attention within "
        "each sequence (nanogrpo/fast/packing.py), for the update's and the old/reference "
        "log-probs, each group's prompt once; the same numbers to rounding. Not with "
        "batch_invariant",
    )
    token_budget: int | None = setting(
        None,
        "TRL AsyncGRPOConfig's: with padding_free, the update's forwards hold at most this many "
        "packed tokens (each group's prompt once, each completion up to its last scored token): "
        "a micro-batch is cut into as many as it needs, so peak memory is bounded whatever the "
        "lengths; the loss and gradient stay the padded update's (a sequence longer than the "
        "budget is an error, not dropped). None: a micro-batch a forward",
    )
    async_rollouts: bool = setting(
        False,
        "a sampler process draws the rounds ahead of the update, on weights at most max_staleness "
        "steps old, sent to it through torch.distributed (nanogrpo/run/async_rollouts.py); on CPU "
        "it takes half the run's torch threads, the trainer the rest. Under torchrun the last "
        "rollout_processes of the processes sample",
    )
    rollout_processes: int = setting(
        1,
        "under torchrun with async_rollouts: the processes that sample (the last ranks; each "
        "its LOCAL_RANK's device), round r on the (r mod rollout_processes)-th; the rest train, "
        "FSDP2 among themselves",
    )
    max_staleness: int = setting(
        4, "TRL AsyncGRPOConfig's: the most optimizer steps a completion's weights may lag"
    )
    weight_sync_steps: int = setting(
        1, "TRL AsyncGRPOConfig's: optimizer steps between two sends of the weights"
    )
    queue_maxsize: int = setting(
        0, "TRL AsyncGRPOConfig's: rounds the sampler may queue ahead (0: max_staleness, >= 1)"
    )
    async_reproducible: bool = setting(
        True,
        "round r is drawn with exactly the weights after step max(0, r - max_staleness) (at a "
        "weight_sync_steps multiple): reproducible bit for bit, the run its synchronous replay's, "
        "resumed exactly; "
        "false: the newest weights the sampler has, rounds past max_staleness dropped (TRL's)",
    )
    heartbeat_stale_after_s: float = setting(
        600.0, "a sampler process silent this long ends the run (one line naming it)"
    )
    steps_per_generation: int | None = setting(
        None, "micro-batches per process sampled at once; None = gradient_accumulation_steps"
    )
    generation_batch_size: int | None = setting(
        None, "completions sampled at once, all processes; None = from steps_per_generation"
    )
    num_iterations: int = setting(1, "optimizer passes over each generated batch (mu)")
    num_generations_eval: int | None = setting(
        None, "completions per prompt in evaluation; None = num_generations (TRL's)"
    )

    max_completion_length: int = setting(
        512, "new tokens per completion, also dr_grpo's constant", group="generation"
    )
    temperature: float = setting(1.0, "> 0: training samples (0 = greedy is for sample.py)")
    top_k: int = setting(0, "0 = off")
    top_p: float = setting(1.0, "nucleus sampling, in (0, 1]")
    min_p: float | None = setting(None, "None = off")
    repetition_penalty: float = setting(1.0, "1 = off")
    generation_kwargs: dict | None = setting(
        None,
        "TRL's, in transformers' names: stop_strings (or vLLM's stop; a row ends with "
        "the token completing one and counts as truncated, as in TRL), suppress_tokens, "
        "min_new_tokens, and temperature/top_k/top_p/min_p/repetition_penalty, which win "
        "over the fields above. Its temperature samples only: the loss's log-probs keep "
        "the temperature field's, as in TRL, so the two can differ",
    )
    torch_compile: bool = setting(
        False,
        "compile the decode step (nanogrpo/fast/sampling.py's StaticDecoder): CUDA graphs on GPU",
    )
    plain: bool = setting(
        False,
        "train with the course functions only (nanogrpo/fast/ off): the plain draw "
        "and log-probs, no compiled decode step, no rows skipped; the same numbers, slower",
    )
    batch_invariant: bool = setting(
        False,
        "sample and score with batch-invariant matmuls and attention (nanogrpo/fast/"
        "batch_invariant.py): each drawn token's log-prob equals the trainer's bit for bit "
        "(sampling/sampling_logp_difference 0, importance ratio 1); eager, slower",
    )

    tools: list = setting(
        help="functions the policy may call mid-completion (see extras/tools.py): "
        '"module:function", "path/to/file.py:function", or a function of the config file',
        factory=list,
        group="tools (TRL's names)",
    )
    max_tool_calling_iterations: int | None = setting(
        None, "tool rounds per completion; None = until no row calls one"
    )
    tool_timeout: float = setting(
        30.0, 'seconds an async tool may run before its result is {"error": ...}'
    )
    tool_call_format: str = setting(
        "auto",
        "how calls are written in the text: hermes (<tool_call>{json}), qwen3_5 "
        "(<function=...>), or auto: the form the chat template writes",
    )
    environment_factory: dict | str | typing.Callable | None = setting(
        None,
        "GRPOTrainer's: a class (or function) making an environment, one per completion, "
        "whose public methods are its tools and whose get_reward() a reward; or {name: class} "
        "routed by the dataset's `environment` column. A class of the config file, "
        '"module:Class" or "path/to/file.py:Class" (see extras/environments.py)',
    )
    rollout_func: str | typing.Callable | None = setting(
        None,
        "GRPOTrainer's: rollout_func(prompts, trainer) -> {prompt_ids, completion_ids, "
        "logprobs, [env_mask], fields for the rewards} replaces the sampler (see "
        'extras/custom_rollout.py); a function of the config file or "module:function"',
    )

    loss_type: str = setting(
        "dapo",
        "grpo | dr_grpo | dapo | bnpo | cispo | sapo | luspo | vespo",
        group="loss (TRL GRPOConfig names and defaults)",
    )
    beta: float = setting(0.0, "KL coefficient; 0 = no reference model")
    epsilon: float = setting(0.2, "lower clip range")
    epsilon_high: float | None = setting(
        None, "upper clip range (None = epsilon); cispo's weight cap"
    )
    delta: float | None = setting(None, "INTELLECT-2 upper bound on the ratio, None = off")
    importance_sampling_level: str = setting("token", "token | sequence (GSPO)")
    sapo_temperature_pos: float = setting(1.0, "sapo gate temperature for positive advantages")
    sapo_temperature_neg: float = setting(1.05, "sapo gate temperature for non-positive advantages")
    vespo_k_pos: float = setting(2.0, "vespo power, positive advantages")
    vespo_lambda_pos: float = setting(3.0, "vespo decay, positive advantages")
    vespo_k_neg: float = setting(3.0, "vespo power, negative advantages")
    vespo_lambda_neg: float = setting(2.0, "vespo decay, negative advantages")
    use_bias_correction_kl: bool = setting(True, "multiply the KL term by the importance ratio")
    top_entropy_quantile: float = setting(
        1.0, "keep the top-rho tokens by entropy in the loss, 1 = all"
    )
    # bool first: the text true/false (any case; 1/0, yes/no) is the bool, as for a bool field
    scale_rewards: bool | str = setting(
        "group",
        "group | batch | none: what the advantage is divided by; True means group, "
        "False none (TRL's)",
    )
    multi_objective_aggregation: str = setting("sum_then_normalize", "or normalize_then_sum (GDPO)")
    mask_truncated_completions: bool = setting(
        False, "drop completions that hit max_completion_length from the loss"
    )

    entropy_coef: float = setting(
        0.0,
        "loss - coef x mean entropy of the trained tokens, for every loss_type; "
        "0 = off; > 0 keeps the policy from collapsing (exploration)",
        group="entropy bonus (TRL's names)",
    )
    use_adaptive_entropy: bool = setting(
        False,
        "Skywork-OR1's control: entropy_coef moves one entropy_coef_delta per "
        "step, up while the entropy is at or below entropy_target (the bonus applies "
        "only then), down otherwise; saved with checkpoints",
    )
    entropy_coef_min: float = setting(0.0, "the adaptive coefficient's lower bound")
    entropy_coef_max: float = setting(1.0, "the adaptive coefficient's upper bound")
    entropy_coef_delta: float = setting(0.005, "the adaptive coefficient's move per step")
    entropy_target: float = setting(0.2, "nats; set it near the `entropy` metric of early training")

    off_policy_mask_threshold: float | None = setting(
        None,
        "DeepSeek-V3.2 OPSM: drop a negative-advantage completion whose mean "
        "per-token KL from the sampling policy exceeds this (e.g. 0.5); None = off",
        group="off-policy corrections (TRL's names; its \"vllm\" is nanogrpo's sampler)",
    )
    vllm_importance_sampling_correction: bool = setting(
        True,
        "weight each token's loss by pi_trainer / pi_sampler (the sampler's own "
        "log-probs): they differ in bf16 and with the compiled decode step; ~1 in fp32 "
        "on CPU",
    )
    vllm_importance_sampling_mode: str = setting(
        "sequence_mask",
        "token_truncate | token_mask | sequence_truncate | sequence_mask: "
        "truncate clamps the weight into [clip_min, clip_max]; mask zeroes it outside",
    )
    vllm_importance_sampling_clip_min: float | None = setting(
        None, "the weight's lower bound; None = no bound"
    )
    vllm_importance_sampling_clip_max: float | None = setting(
        3.0, "the weight's upper bound; None = no bound"
    )
    cast_lm_head_to_fp32: bool = setting(
        False, "the LM head in float32 under bf16, sampler and trainer (ScaleRL)"
    )

    dynamic_sampling: bool = setting(
        False,
        "arXiv 2503.14476: drop groups whose rewards are all equal (no learning "
        "signal) and sample more prompts until the round has its number of groups",
        group="dynamic sampling (DAPO; verl's filter_groups, not in TRL)",
    )
    max_num_gen_batches: int = setting(
        10,
        "generation batches drawn for one round at most (verl's name); then "
        "equal-reward groups fill what is missing, with a warning",
    )

    learning_rate: float = setting(
        1e-6,
        "peak learning rate",
        group="optimizer and learning-rate schedule (transformers' names)",
    )
    optim: str = setting("adamw_torch_fused", "or adamw_torch (fused where the device has it)")
    adam_beta1: float = setting(0.9, "AdamW's first-moment decay")
    adam_beta2: float = setting(0.999, "AdamW's second-moment decay")
    adam_epsilon: float = setting(1e-8, "AdamW's denominator epsilon")
    weight_decay: float = setting(0.0, "decoupled weight decay")
    lr_scheduler_type: str = setting(
        "linear", "linear | cosine | constant | constant_with_warmup | cosine_with_min_lr"
    )
    lr_scheduler_kwargs: dict | None = setting(
        None, 'cosine_with_min_lr: {"min_lr": x} or {"min_lr_rate": x}; cosine: {"num_cycles": x}'
    )
    warmup_steps: float = setting(
        0, "warmup steps (the first at lr 0); below 1, a fraction of max_steps"
    )
    warmup_ratio: float = setting(
        0.0, "warmup as a fraction of max_steps, rounded up (when warmup_steps is 0)"
    )
    max_grad_norm: float | None = setting(1.0, "gradient clipping; None = off")

    sync_ref_model: bool = setting(
        False,
        "TR-DPO: pull the reference model toward the policy",
        group="reference model (beta > 0)",
    )
    ref_model_mixup_alpha: float = setting(0.6, "ref = alpha * policy + (1 - alpha) * ref")
    ref_model_sync_steps: int = setting(512, "optimizer steps between syncs")

    max_steps: int = setting(
        -1, "optimizer steps; -1 = num_train_epochs passes over the dataset", group="run"
    )
    num_train_epochs: float = setting(
        3.0, "passes over the prompts, as TRL counts them (when max_steps is -1)"
    )
    logging_steps: int | float = setting(
        10,
        "steps between logs (a console line, a metrics.jsonl and tracker record), each the mean "
        "over its steps as TRL's (grad_norm, learning_rate, epoch: the logging step's); the last "
        "step logs too. Below 1, a fraction of the run's steps, rounded up (transformers')",
    )
    logging_first_step: bool = setting(False, "also log step 1")
    eval_strategy: str = setting("no", "no | steps")
    eval_steps: int | float | None = setting(
        None, 'with eval_strategy="steps"; None = logging_steps; below 1, a fraction of the steps'
    )
    eval_on_start: bool = setting(
        False,
        "also evaluate before the first step (transformers' sanity check); needs eval_dataset",
    )
    save_steps: int | float = setting(
        500,
        "steps between checkpoints, 0 = only at the end; also on Ctrl-C; below 1, a fraction of "
        "the run's steps, rounded up (transformers')",
    )
    save_total_limit: int | None = setting(
        None, "keep the newest this-many checkpoints this run wrote; None = all"
    )
    log_completions: bool = setting(False, "print a sample of completions at each log step")
    num_completions_to_print: int | None = setting(
        None, "prompts whose first completion log_completions prints; None = 2"
    )
    output_dir: str | None = setting(
        None, 'checkpoints, train_config.json and logs; None = "trainer_output"'
    )
    run_name: str | None = setting(None, "the trackers' run name; None = output_dir")
    resume_from_checkpoint: bool | str | None = setting(
        None,
        "None/False; True = the latest checkpoint in output_dir if there is one; "
        "or a checkpoint path. The text true/false (any case; 1/0, yes/no) is the bool.",
    )
    overwrite_output_dir: bool = setting(
        False, "start over in an output_dir holding a run (deletes its checkpoints, logs)"
    )
    dry_run: bool = setting(
        False,
        "print the memory plan per process and the batch table, write output_dir/plan.json "
        "and exit (the model's config.json alone is read)",
    )
    dry_run_world_size: int | None = setting(
        None, "dry_run: the process count to plan for; None = this launch's"
    )
    report_to: str | list[str] = setting(
        "none",
        'none | tensorboard | wandb | trackio, or several: comma-separated or a list (["wandb"])',
    )
    push_to_hub: bool = setting(
        False, "upload each checkpoint to the hub repo hub_model_id (huggingface-hub)"
    )
    hub_model_id: str | None = setting(None, "None = the output_dir's name")
    ddp_timeout: int = setting(
        1800,
        "seconds a collective waits for the other processes before the run "
        "ends with an error naming the rank (a hung or dead process)",
    )

    def __post_init__(self):
        # resume_from_checkpoint="False" in a config file is text: it
        # means False, not a checkpoint of that name
        resume = self.resume_from_checkpoint
        words = TRUE_WORDS + FALSE_WORDS
        if isinstance(resume, str) and resume.lower() in words:
            self.resume_from_checkpoint = resume.lower() in TRUE_WORDS
        if self.output_dir is None:
            self.output_dir = DEFAULT_OUTPUT_DIR
        # TRL's GRPOConfig maps the bools so: True = "group", False = "none"
        if self.scale_rewards is True or self.scale_rewards is False:
            self.scale_rewards = "group" if self.scale_rewards else "none"
        # TRL takes report_to as a list too: one comma-separated string here
        if isinstance(self.report_to, (list, tuple)):
            self.report_to = ",".join(self.report_to) or "none"
        # transformers' steps are floats: 10.0 is 10 steps (validate refuses 2.5)
        for key in RATIO_STEPS:
            value = getattr(self, key)
            if isinstance(value, float) and value >= 1 and value.is_integer():
                setattr(self, key, int(value))

    # --- batch arithmetic (TRL's; schedules.py) ----------------------------

    def schedule(self, world_size: int = 1) -> Schedule:
        """Every count derived from the batch settings (call validate first)."""
        return batch_schedule(self, world_size)

    def total_steps(self, num_prompts: int, world_size: int = 1) -> int:
        """max_steps, or num_train_epochs passes counted as TRL counts."""
        return total_steps(self, num_prompts, world_size)

    def with_total_steps(self, total: int) -> "TrainConfig":
        """This config for a run of `total` optimizer steps (max_steps, or num_train_epochs
        counted): logging_steps, eval_steps and save_steps below 1 become the steps they mean,
        math.ceil(total * ratio), as transformers' TrainerState.compute_steps counts them. -> a
        copy, or self when nothing changes."""
        changes = {} if total == self.max_steps else {"max_steps": total}
        for key in RATIO_STEPS:
            value = getattr(self, key)
            if value is not None and 0 < value < 1:
                changes[key] = math.ceil(total * value)
        return dataclasses.replace(self, **changes) if changes else self

    def eval_every(self) -> int:
        """Steps between evaluations; 0 = never."""
        if self.eval_strategy == "no" or not self.eval_dataset:
            return 0
        return self.eval_steps or self.logging_steps

    def evaluates(self) -> bool:
        """Whether the run evaluates at all: every eval_every() steps, or
        once before the first step (eval_on_start)."""
        return self.eval_every() > 0 or (self.eval_on_start and bool(self.eval_dataset))

    # --- rules between settings ---------------------------------------------

    # --- what other modules read --------------------------------------------

    def reporters(self) -> list[str]:
        """The experiment trackers report_to names ("none" = only
        metrics.jsonl and the console)."""
        names = [r.strip() for r in self.report_to.split(",")]
        return [r for r in names if r not in ("", "none")]

    def use_bf16(self, device) -> bool:
        """Whether to compute in bfloat16 on `device` (a torch.device or
        string): the one rule that dist.autocast (one process) and
        dist.shard_model (FSDP2 mixed precision) both follow."""
        if self.bf16 is None:
            return str(device).startswith("cuda")
        return self.bf16

    def weight_dtype(self) -> str:
        """The dtype weights load in: model_init_kwargs' dtype, else float32."""
        kwargs = self.model_init_kwargs or {}
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype", "float32"))
        return "float32" if dtype == "auto" else dtype

    def prompt_encoding(self) -> dict:
        """Tokenizer.encode_prompt's keyword arguments for this run's prompts: max_prompt_length
        (cut from the left) and chat_template_kwargs."""
        return dict(max_length=self.max_prompt_length, **(self.chat_template_kwargs or {}))

    def lora_settings(self) -> dict | None:
        """Keyword arguments for extras/lora.py's apply_lora (PEFT's names),
        or None without use_peft."""
        if not self.use_peft:
            return None
        targets = self.lora_target_modules
        if targets == ["all-linear"]:
            targets = "all-linear"
        return {
            "r": self.lora_r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": 0.0 if self.disable_dropout else self.lora_dropout,
            "target_modules": targets,
            "modules_to_save": self.lora_modules_to_save,
            "use_rslora": self.use_rslora,
        }

    def loss_config(self) -> dict:
        """The loss's and its options' settings (TRL's names), for
        `loss_settings(**cfg.loss_config())` (extras/loss_terms.py): LossConfig,
        LossTerms; the sampler correction off where vespo_drops_sampler_correction."""
        kwargs = {key: getattr(self, key) for key in LOSS_FIELDS}
        if self.vespo_drops_sampler_correction():
            kwargs["vllm_importance_sampling_correction"] = False
        return kwargs
