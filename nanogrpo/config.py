"""Every training setting: one dataclass and the rules between its fields.

Owns: `TrainConfig` (fields, defaults, the rules between them). Names,
meanings and defaults are TRL's GRPOConfig's (with transformers'
TrainingArguments) wherever TRL has the setting. configurator.py reads a
config file and the command line into it; schedules.py derives the batch
Schedule and the learning rate from it.

Does not know about: what the settings do; train.py and the modules it
calls read them.

Choices: `validate` raises ConfigError naming the first broken rule,
`check_lora` is the LoRA rule train.py applies again once the loaded
model shows whether it carries adapters, and `warnings` names what is
valid but probably not meant. train.py checks only what needs the model,
the disk or the environment.
"""

import dataclasses
from dataclasses import dataclass, field

from nanogrpo.grpo import AGGREGATIONS, SCALE_REWARDS, VESPO_NEEDS_TOKENS, LossConfig
from nanogrpo.tools import TOOL_CALL_PARSERS
from nanogrpo.sampler import check_sampling
from nanogrpo.schedules import SCHEDULES, Schedule, batch_schedule, micro_batches_per_round
from nanogrpo.schedules import total_steps


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or is inconsistent with the others."""


OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")
CHOICES = {
    "scale_rewards": SCALE_REWARDS,
    "multi_objective_aggregation": AGGREGATIONS,
    "lr_scheduler_type": SCHEDULES,
    "tool_call_format": tuple(TOOL_CALL_PARSERS),
    "optim": OPTIMIZERS,
    "eval_strategy": ("no", "steps"),
}
# (rule, message, fields): each range rule of TrainConfig once; the loss's own live in LossConfig
AT_LEAST_1 = """per_device_train_batch_size gradient_accumulation_steps num_iterations
    max_completion_length logging_steps ref_model_sync_steps eval_size lora_r
    steps_per_generation generation_batch_size max_tool_calling_iterations
    save_total_limit soft_punish_cache eval_steps max_prompt_length
    num_generations_eval num_completions_to_print max_num_gen_batches""".split()
RANGES = [
    (lambda v: v >= 1, "must be at least 1", AT_LEAST_1),
    (lambda v: v >= 0, "must be >= 0 (0 = off)",
     ["learning_rate", "weight_decay", "warmup_steps", "save_steps"]),
    (lambda v: v > 0, "must be > 0",
     ["lora_alpha", "max_grad_norm", "tool_timeout", "num_train_epochs"]),
    (lambda v: 0 <= v < 1, "must be in [0, 1)",
     ["adam_beta1", "adam_beta2", "warmup_ratio", "lora_dropout"]),
    (lambda v: 0 <= v <= 1, "must be in [0, 1]", ["ref_model_mixup_alpha"]),
]
REPORTERS = ("none", "tensorboard", "wandb", "trackio")
# TrainConfig has each loss field, with the same name and default
LOSS_FIELDS = tuple(f.name for f in dataclasses.fields(LossConfig))
TRUE_WORDS = ("true", "1", "yes")  # how a bool is spelled in text
FALSE_WORDS = ("false", "0", "no")
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_OUTPUT_DIR = "trainer_output"  # transformers' output_dir=None


@dataclass
class TrainConfig:
    """All settings of a run; see the comment on each field. Names,
    meanings and defaults are TRL's GRPOConfig's (with transformers'
    TrainingArguments) wherever TRL has the setting."""

    # --- model
    # checkpoint dir or hub id (the config file decides what the tiny default is)
    model: str = "tiny"
    # ModelConfig fields: create a random model at `model` if it does not exist
    init_model: dict | None = None
    # with init_model: the characters of its char-level tokenizer
    init_tokenizer_chars: str = "abcdefgh="
    # {"dtype": "bfloat16"} loads the weights in that dtype (TRL's); None = float32
    model_init_kwargs: dict | None = None
    # compute in bfloat16 (autocast, or FSDP2 mixed precision; fp32 weights).
    # None: on CUDA yes, on CPU no (TRL's None means yes; bf16 is slow on CPU)
    bf16: bool | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 42  # seeds init, prompt order and sampling
    # recompute activations in backward to save memory
    gradient_checkpointing: bool = True
    # set every dropout probability (LoRA's) to 0
    disable_dropout: bool = False

    # --- LoRA (TRL's ModelConfig names)
    # train LoRA adapters (nanogrpo/lora.py) instead of every weight; base frozen
    use_peft: bool = False
    lora_r: int = 16  # adapter rank
    lora_alpha: int = 32  # adapter scaling = lora_alpha / lora_r
    lora_dropout: float = 0.05  # dropout on each adapter's input
    # None = q_proj, v_proj (PEFT's default); "all-linear"
    lora_target_modules: list[str] | str | None = None
    # trained in full and saved with the adapter: embed_tokens, lm_head
    lora_modules_to_save: list[str] | None = None
    # rank-stabilized scaling lora_alpha / sqrt(lora_r)
    use_rslora: bool = False
    # at the end, also write the adapter merged into a full HF checkpoint
    # (output_dir/merged)
    merge_adapter: bool = False

    # --- data
    # see data.load_dataset: file, hf://datasets/..., gsm8k, default, countdown
    dataset: str = "default"
    # split for gsm8k / procedural tasks (None = "train")
    dataset_split: str | None = None
    # same forms as dataset; None = no evaluation
    eval_dataset: str | None = None
    eval_split: str | None = "test"  # split of eval_dataset
    eval_size: int = 256  # evaluate on the first this-many eval prompts
    shuffle_dataset: bool = True  # a new prompt order every epoch
    # prompt tokens kept, cut from the left with a warning; None = all
    max_prompt_length: int | None = None
    # extra variables of the chat template, e.g. {"enable_thinking": False}
    chat_template_kwargs: dict | None = None

    # --- rewards
    # built-in names, module:function, a reward model, or functions defined
    # in the config file itself
    reward_funcs: list = field(default_factory=lambda: ["default_task"])
    # one per reward function; None = all 1.0
    reward_weights: list[float] | None = None
    # per reward model: its tokenizer; None = its own
    reward_processing_classes: list[str | None] | None = None
    # soft_overlong reward's window (None = max_completion_length // 4)
    soft_punish_cache: int | None = None

    # --- batch (TRL's arithmetic: an optimizer step trains on
    # per_device_train_batch_size x gradient_accumulation_steps x processes
    # completions, a multiple of num_generations)
    num_generations: int = 8  # completions per prompt (G), at least 2
    # completions per forward/backward on one process
    per_device_train_batch_size: int = 8
    # forward/backwards summed per optimizer step
    gradient_accumulation_steps: int = 1
    # micro-batches per process sampled at once; None = gradient_accumulation_steps
    steps_per_generation: int | None = None
    # completions sampled at once, all processes; None = from steps_per_generation
    generation_batch_size: int | None = None
    # optimizer passes over each generated batch (mu)
    num_iterations: int = 1
    # completions per prompt in evaluation; None = 1 (nanogrpo scores one)
    num_generations_eval: int | None = None

    # --- generation
    # new tokens per completion, also dr_grpo's constant
    max_completion_length: int = 512
    # > 0: training samples (0 = greedy is for sample.py)
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus sampling, in (0, 1]
    min_p: float | None = None  # None = off
    repetition_penalty: float = 1.0  # 1 = off
    # compile the decode step (sampler.generate(torch_compile=)):
    # CUDA graphs on GPU
    torch_compile: bool = False

    # --- tools (TRL's names): functions the policy may call mid-completion;
    # see tools.py
    # "module:function", "path/to/file.py:function", or a function of the config file
    tools: list = field(default_factory=list)
    # tool rounds per completion; None = until no row calls one
    max_tool_calling_iterations: int | None = None
    # seconds an async tool may run before its result is {"error": ...}
    tool_timeout: float = 30.0
    # how calls are written in the text: a key of tools.TOOL_CALL_PARSERS
    tool_call_format: str = "hermes"

    # --- loss (TRL GRPOConfig names and defaults)
    # grpo | dr_grpo | dapo | bnpo | cispo | sapo | luspo | vespo
    loss_type: str = "dapo"
    beta: float = 0.0  # KL coefficient; 0 = no reference model
    epsilon: float = 0.2  # lower clip range
    # upper clip range (None = epsilon); cispo's weight cap
    epsilon_high: float | None = None
    # INTELLECT-2 upper bound on the ratio, None = off
    delta: float | None = None
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    # sapo gate temperatures, positive and non-positive advantages
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    # vespo power and decay, positive and negative advantages
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # multiply the KL term by the importance ratio
    use_bias_correction_kl: bool = True
    # keep the top-rho tokens by entropy in the loss, 1 = all
    top_entropy_quantile: float = 1.0
    # group | batch | none: what the advantage is divided by
    scale_rewards: str = "group"
    # or normalize_then_sum (GDPO)
    multi_objective_aggregation: str = "sum_then_normalize"
    # drop completions that hit max_completion_length from the loss
    mask_truncated_completions: bool = False

    # --- entropy bonus (TRL's names)
    # loss - coef x mean entropy of the trained tokens, for every loss_type;
    # 0 = off; > 0 keeps the policy from collapsing (exploration)
    entropy_coef: float = 0.0
    # Skywork-OR1's control: entropy_coef moves one entropy_coef_delta per
    # step, up while the entropy is at or below entropy_target (the bonus
    # applies only then), down otherwise; saved with checkpoints
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0  # the adaptive coefficient's bounds
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    # nats; set it near the `entropy` metric of early training
    entropy_target: float = 0.2

    # --- off-policy corrections (TRL's names; its "vllm" is nanogrpo's sampler)
    # DeepSeek-V3.2 OPSM: drop a negative-advantage completion whose mean
    # per-token KL from the sampling policy exceeds this (e.g. 0.5); None = off
    off_policy_mask_threshold: float | None = None
    # weight each token's loss by pi_trainer / pi_sampler (the sampler's
    # own log-probs): they differ in bf16 and with the compiled decode
    # step; ~1 in fp32 on CPU
    vllm_importance_sampling_correction: bool = True
    # token_truncate | token_mask | sequence_truncate | sequence_mask
    vllm_importance_sampling_mode: str = "sequence_mask"
    # truncate clamps the weight into [min, max]; mask zeroes it outside
    vllm_importance_sampling_clip_min: float | None = None  # None = no bound
    vllm_importance_sampling_clip_max: float | None = 3.0
    # the LM head in float32 under bf16, sampler and trainer (ScaleRL)
    cast_lm_head_to_fp32: bool = False

    # --- dynamic sampling (DAPO; verl's filter_groups, not in TRL)
    # arXiv 2503.14476: drop groups whose rewards are all equal (no learning signal) and sample
    # more prompts until the round has its number of groups
    dynamic_sampling: bool = False
    # generation batches drawn for one round at most (verl's name); then
    # equal-reward groups fill what is missing, with a warning
    max_num_gen_batches: int = 10

    # --- optimizer and learning-rate schedule (transformers' names)
    learning_rate: float = 1e-6  # peak learning rate
    optim: str = "adamw_torch_fused"  # or adamw_torch (fused where the device has it)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0  # decoupled weight decay
    # linear | cosine | constant | constant_with_warmup | cosine_with_min_lr
    lr_scheduler_type: str = "linear"
    # cosine_with_min_lr: {"min_lr": x} or {"min_lr_rate": x}; cosine: {"num_cycles": x}
    lr_scheduler_kwargs: dict | None = None
    # warmup steps (the first at lr 0); below 1, a fraction of max_steps
    warmup_steps: float = 0
    # warmup as a fraction of max_steps, rounded up (when warmup_steps is 0)
    warmup_ratio: float = 0.0
    # gradient clipping; None = off
    max_grad_norm: float | None = 1.0

    # --- reference model (beta > 0)
    # TR-DPO: pull the reference model toward the policy
    sync_ref_model: bool = False
    # ref = alpha * policy + (1 - alpha) * ref
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512  # optimizer steps between syncs

    # --- run
    # optimizer steps; -1 = num_train_epochs passes over the dataset
    max_steps: int = -1
    # passes over the prompts, as TRL counts them (when max_steps is -1)
    num_train_epochs: float = 3.0
    logging_steps: int = 10  # steps between console lines and tracker logs
    logging_first_step: bool = False  # also log step 1
    eval_strategy: str = "no"  # no | steps
    eval_steps: int | None = None  # with eval_strategy="steps"; None = logging_steps
    # steps between checkpoints, 0 = only at the end; also on Ctrl-C
    save_steps: int = 500
    # keep the newest this-many checkpoints this run wrote; None = all
    save_total_limit: int | None = None
    # print a sample of completions at each log step
    log_completions: bool = False
    # prompts whose first completion log_completions prints; None = 2
    num_completions_to_print: int | None = None
    # checkpoints, train_config.json and logs; None = "trainer_output"
    output_dir: str | None = None
    run_name: str | None = None  # the trackers' run name; None = output_dir
    # None/False; True = the latest checkpoint in output_dir if there is
    # one; or a checkpoint path. The text true/false (any case; 1/0,
    # yes/no) is the bool.
    resume_from_checkpoint: bool | str | None = None
    # start over in an output_dir holding a run (deletes its checkpoints, logs)
    overwrite_output_dir: bool = False
    # none | tensorboard | wandb | trackio, or several comma-separated
    report_to: str = "none"
    # upload each checkpoint to the hub repo hub_model_id (huggingface-hub)
    push_to_hub: bool = False
    hub_model_id: str | None = None  # None = the output_dir's name

    def __post_init__(self):
        # resume_from_checkpoint="False" in a config file is text: it
        # means False, not a checkpoint of that name
        resume = self.resume_from_checkpoint
        words = TRUE_WORDS + FALSE_WORDS
        if isinstance(resume, str) and resume.lower() in words:
            self.resume_from_checkpoint = resume.lower() in TRUE_WORDS
        if self.output_dir is None:
            self.output_dir = DEFAULT_OUTPUT_DIR

    # --- batch arithmetic (TRL's; schedules.py) ----------------------------

    def schedule(self, world_size: int = 1) -> Schedule:
        """Every count derived from the batch settings (call validate first)."""
        return batch_schedule(self, world_size)

    def total_steps(self, num_prompts: int, world_size: int = 1) -> int:
        """max_steps, or num_train_epochs passes counted as TRL counts."""
        return total_steps(self, num_prompts, world_size)

    def eval_every(self) -> int:
        """Steps between evaluations; 0 = never."""
        if self.eval_strategy == "no" or not self.eval_dataset:
            return 0
        return self.eval_steps or self.logging_steps

    # --- rules between settings ---------------------------------------------

    def _need(self, ok: bool, key: str, why: str):
        if not ok:
            raise ConfigError(f"{key}={getattr(self, key)!r}: {why}")

    def validate(self, world_size: int = 1) -> "TrainConfig":
        """Raise ConfigError naming the first inconsistent setting;
        returns self."""
        need = self._need
        need(self.optim in OPTIMIZERS or "8bit" not in self.optim, "optim",
             "needs bitsandbytes, which nanogrpo does not use: use adamw_torch "
             "(or LoRA, use_peft=True, for a small optimizer state)")
        for key, allowed in CHOICES.items():
            value = getattr(self, key)
            need(value in allowed, key, f"must be one of {list(allowed)}")
        # None passes where the field allows it (its comment says what None means)
        for ok, why, keys in RANGES:
            for key in keys:
                value = getattr(self, key)
                need(value is None or ok(value), key, why)
        d = self.device
        cuda_n = d.startswith("cuda:") and d[5:].isdigit()
        need(d in ("auto", "cpu", "cuda") or cuda_n, "device",
             "must be auto, cpu, cuda or cuda:N")
        self._validate_batch(world_size)
        kwargs = self.model_init_kwargs or {}
        unknown = sorted(set(kwargs) - {"dtype", "torch_dtype"})
        need(not unknown, "model_init_kwargs",
             f"nanogrpo builds its own model: only dtype is read, not {unknown}")
        need(self.weight_dtype() in WEIGHT_DTYPES, "model_init_kwargs",
             f"dtype must be one of {list(WEIGHT_DTYPES)} or auto")
        self._validate_sampling_and_loss()
        self._validate_rewards()
        need(not self.sync_ref_model or self.beta > 0, "sync_ref_model",
             "needs beta > 0 (a reference model)")
        self.check_lora(self.use_peft)
        need(not self.merge_adapter or self.use_peft, "merge_adapter",
             "needs use_peft=true (an adapter to merge)")
        need(all(r in REPORTERS for r in self.reporters()), "report_to",
             f"takes names from {list(REPORTERS)}")
        return self

    def _validate_batch(self, world_size: int):
        need = self._need
        G = self.num_generations
        need(G >= 2, "num_generations", "GRPO needs at least 2 completions per prompt")
        both = self.steps_per_generation and self.generation_batch_size
        need(not both, "generation_batch_size",
             "set it or steps_per_generation, not both (as in TRL)")
        per_round = self.per_device_train_batch_size * world_size
        gbs = self.generation_batch_size
        need(gbs is None or gbs % per_round == 0, "generation_batch_size",
             f"must be a multiple of per_device_train_batch_size x processes "
             f"= {per_round}")
        spg = micro_batches_per_round(self, world_size)
        GA = self.gradient_accumulation_steps
        need(spg % GA == 0, "steps_per_generation",
             f"counts micro-batches per generation, as in TRL: it must be a "
             f"multiple of gradient_accumulation_steps={GA}")
        sampled = self.per_device_train_batch_size * spg
        need(sampled % G == 0, "per_device_train_batch_size",
             f"x steps_per_generation ({sampled} completions sampled per "
             f"process) must be a multiple of num_generations={G}: each "
             "process holds whole groups (TRL asks this of all processes "
             "together)")
        need(self.max_steps > 0 or self.max_steps == -1, "max_steps",
             "must be > 0, or -1 for num_train_epochs")

    def _validate_sampling_and_loss(self):
        try:  # the sampler's and the loss's own rules, not restated here
            check_sampling(
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                min_p=self.min_p or 0.0,
                repetition_penalty=self.repetition_penalty,
            )
            loss = LossConfig(**self.loss_config())
        except ValueError as e:
            message = str(e).removeprefix("LossConfig.")
            raise ConfigError(message) from None
        self._need(self.temperature > 0, "temperature",
                   "training samples, so it must be > 0 "
                   "(0 = greedy is for sample.py)")
        # the sampler always returns its log-probs: checked here, not per step
        self._need(loss.correction_fits_the_loss(),
                   "vllm_importance_sampling_mode", VESPO_NEEDS_TOKENS)

    def _validate_rewards(self):
        need = self._need
        n = len(self.reward_funcs)
        need(n >= 1, "reward_funcs", "needs at least one reward function")
        for key in ("reward_weights", "reward_processing_classes"):
            value = getattr(self, key)
            need(value is None or len(value) == n, key,
                 f"needs one entry per reward function ({n}); "
                 "reward_processing_classes holds None where a function "
                 "is not a reward model")
        window = self.soft_punish_cache
        need(window is None or window <= self.max_completion_length,
             "soft_punish_cache", "must be in [1, max_completion_length]")

    def check_lora(self, lora: bool):
        """The rules that depend on whether the policy carries LoRA
        adapters: `lora` is use_peft here (validate), or, once the model is
        loaded, whether it has them (a PEFT adapter directory as `model`
        brings its own)."""
        if lora and self.sync_ref_model:
            raise ConfigError(
                "sync_ref_model=True: refused with LoRA adapters (use_peft, or "
                "a PEFT adapter directory as model), as TRL does")

    def warnings(self) -> list[str]:
        """What is valid but probably not meant, one sentence each."""
        out = []
        if self.eval_strategy != "no" and not self.eval_dataset:
            out.append(f"eval_strategy={self.eval_strategy!r} without an "
                       "eval_dataset: no evaluation")
        filtered = self.top_k > 0 or self.top_p < 1 or bool(self.min_p)
        if filtered and self.vllm_importance_sampling_correction:
            out.append("the sampler's log-probs are those of the distribution "
                       "top_k/top_p/min_p leave (as vLLM's processed_logprobs, "
                       "which TRL uses), so vllm_importance_sampling_correction "
                       "weighs each completion by the probability mass the "
                       "filters kept; TRL without vLLM applies no correction: "
                       "vllm_importance_sampling_correction=False matches it")
        return out

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

    def lora_settings(self) -> dict | None:
        """Keyword arguments for nanogrpo.lora.apply_lora (PEFT's names),
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
        """Keyword arguments for nanogrpo.grpo.LossConfig (TRL's names):
        `LossConfig(**cfg.loss_config())`."""
        return {key: getattr(self, key) for key in LOSS_FIELDS}
