"""TrainConfig's rules between its fields: `validate` raises ConfigError naming the first broken
rule (ranges and choices, the batch arithmetic, sampling and the loss, rewards, rollouts),
`check_lora` is the LoRA rule trainer.setup applies again once the loaded model shows whether it
carries adapters, and `warnings` names what is valid but probably not meant. TrainConfig inherits
them (run/config.py holds its fields).

Does not know about: the model, tokenization, files, or processes.

The sampler's and the loss's own rules are called, not restated (sampler.check_sampling,
grpo.LossConfig, extras/generation_kwargs.py's generation_settings).
"""

from nanogrpo.extras.generation_kwargs import generation_settings
from nanogrpo.extras.loss_terms import loss_settings
from nanogrpo.extras.lr_schedules import SCHEDULES
from nanogrpo.extras.tools import TOOL_CALL_PARSERS
from nanogrpo.grpo import AGGREGATIONS, SCALE_REWARDS
from nanogrpo.sampler import check_sampling
from nanogrpo.schedules import batch_schedule


class ConfigError(ValueError):
    """A config key is unknown, has the wrong type, or is inconsistent with the others."""


OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")


CHOICES = {
    "scale_rewards": SCALE_REWARDS,
    "multi_objective_aggregation": AGGREGATIONS,
    "lr_scheduler_type": SCHEDULES,
    "tool_call_format": ("auto", *TOOL_CALL_PARSERS),
    "optim": OPTIMIZERS,
    "eval_strategy": ("no", "steps"),
}


# (rule, message, fields): each range rule of TrainConfig once; the loss's own live in LossConfig
AT_LEAST_1 = """per_device_train_batch_size gradient_accumulation_steps num_iterations
    max_completion_length ref_model_sync_steps eval_size lora_r
    steps_per_generation generation_batch_size max_tool_calling_iterations
    save_total_limit soft_punish_cache max_prompt_length
    num_generations_eval num_completions_to_print max_num_gen_batches torch_num_threads""".split()


RANGES = [
    (lambda v: v >= 1, "must be at least 1", AT_LEAST_1),
    (
        lambda v: v >= 0,
        "must be >= 0 (0 = off)",
        ["learning_rate", "weight_decay", "warmup_steps", "save_steps"],
    ),
    (
        lambda v: v > 0,
        "must be > 0",
        [
            "lora_alpha",
            "max_grad_norm",
            "tool_timeout",
            "num_train_epochs",
            "ddp_timeout",
            "logging_steps",
            "eval_steps",
        ],
    ),
    (
        lambda v: 0 <= v < 1,
        "must be in [0, 1)",
        ["adam_beta1", "adam_beta2", "warmup_ratio", "lora_dropout"],
    ),
    (lambda v: 0 <= v <= 1, "must be in [0, 1]", ["ref_model_mixup_alpha"]),
]


# transformers' step counts that below 1 are a fraction of the run's steps
# (TrainConfig.with_total_steps); from 1 up, whole numbers
RATIO_STEPS = ("logging_steps", "eval_steps", "save_steps")


REPORTERS = ("none", "tensorboard", "wandb", "trackio")


# losses that sum a sequence-level weight over the sequence's tokens
LENGTH_WEIGHTED = ("bnpo", "dr_grpo", "dapo", "cispo")


WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


class Rules:
    """The rules of TrainConfig's fields (a base class: the fields are TrainConfig's)."""

    def _need(self, ok: bool, key: str, why: str):
        if not ok:
            raise ConfigError(f"{key}={getattr(self, key)!r}: {why}")

    def check_async(self, world_size: int):
        """async_rollouts' settings, and what it does not run with (each in one line)."""
        need = self._need
        need(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        need(
            1 <= self.weight_sync_steps <= self.max_staleness + 1,
            "weight_sync_steps",
            f"must be in [1, max_staleness + 1 = {self.max_staleness + 1}]: a round may not wait "
            "for weights older than max_staleness steps",
        )
        need(self.queue_maxsize >= 0, "queue_maxsize", "must be >= 0 (0: max_staleness)")
        need(self.heartbeat_stale_after_s > 0, "heartbeat_stale_after_s", "must be > 0 seconds")
        if not self.async_rollouts:
            return
        trainers = self.trainer_processes(world_size)
        share = batch_schedule(self, trainers).completions_per_round_per_rank
        refused = [  # (holds, the setting it names, why not)
            (self.rollout_processes >= 1, "rollout_processes", "must be >= 1"),
            (
                world_size == 1 or self.rollout_processes < world_size,
                "rollout_processes",
                f"must be < the {world_size} processes launched: the others train",
            ),
            (
                share % self.num_generations == 0,
                "per_device_train_batch_size",
                f"with {trainers} trainer processes each trains whole groups: "
                f"{share} completions a round is not a multiple of num_generations",
            ),
            (
                not self.dynamic_sampling,
                "dynamic_sampling",
                "its extra draws wait on the round they fill: unset it or async_rollouts",
            ),
            (
                self.num_iterations == 1,
                "num_iterations",
                "async_rollouts trains each round once (its old policy is the sampler's)",
            ),
            (
                self.steps_per_generation in (None, self.gradient_accumulation_steps),
                "steps_per_generation",
                "async_rollouts draws one round per optimizer step: unset it",
            ),
            (
                not self.sync_ref_model,
                "sync_ref_model",
                "the sampler's reference model would lag the trainer's: unset it",
            ),
        ]
        for holds, key, why in refused:
            need(holds, key, f"with async_rollouts=true: {why}")

    def validate(self, world_size: int = 1) -> "Rules":
        """Raise ConfigError naming the first inconsistent setting;
        returns self."""
        need = self._need
        need(
            self.optim in OPTIMIZERS or "8bit" not in self.optim,
            "optim",
            "needs bitsandbytes, which nanogrpo does not use: use adamw_torch "
            "(or LoRA, use_peft=True, for a small optimizer state)",
        )
        for key, allowed in CHOICES.items():
            value = getattr(self, key)
            need(value in allowed, key, f"must be one of {list(allowed)}")
        # None passes where the field allows it (its comment says what None means)
        for ok, why, keys in RANGES:
            for key in keys:
                value = getattr(self, key)
                need(value is None or ok(value), key, why)
        for key in RATIO_STEPS:
            value = getattr(self, key)
            need(
                value is None or value < 1 or value == int(value),
                key,
                "must be a whole number of steps, or below 1 a fraction of the run's "
                "steps (transformers')",
            )
        d = self.device
        cuda_n = d.startswith("cuda:") and d[5:].isdigit()
        need(d in ("auto", "cpu", "cuda") or cuda_n, "device", "must be auto, cpu, cuda or cuda:N")
        self._validate_batch(self.trainer_processes(world_size))
        kwargs = self.model_init_kwargs or {}
        unknown = sorted(set(kwargs) - {"dtype", "torch_dtype"})
        need(
            not unknown,
            "model_init_kwargs",
            f"nanogrpo builds its own model: only dtype is read, not {unknown}",
        )
        need(
            self.weight_dtype() in WEIGHT_DTYPES,
            "model_init_kwargs",
            f"dtype must be one of {list(WEIGHT_DTYPES)} or auto",
        )
        self._validate_sampling_and_loss()
        self._validate_rewards()
        self._validate_rollouts()
        need(
            not self.eval_on_start or self.eval_dataset,
            "eval_on_start",
            "needs an eval_dataset to evaluate (transformers' rule)",
        )
        need(
            not self.sync_ref_model or self.beta > 0,
            "sync_ref_model",
            "needs beta > 0 (a reference model)",
        )
        self.check_lora(self.use_peft)
        need(
            not self.merge_adapter or self.use_peft,
            "merge_adapter",
            "needs use_peft=true (an adapter to merge)",
        )
        need(
            not (self.plain and self.torch_compile),
            "torch_compile",
            "compiles nanogrpo/fast/'s decode step, which plain=true leaves out: set one of them",
        )
        need(
            not (self.batch_invariant and self.torch_compile),
            "torch_compile",
            "batch_invariant=true decodes eagerly with its own kernels: set one of them",
        )
        self.check_async(world_size)
        need(
            self.token_budget is None or self.padding_free and self.token_budget >= 1,
            "token_budget",
            "cuts packed forwards: set padding_free=true, and a budget >= 1 token",
        )
        need(
            self.token_budget is None
            or self.top_entropy_quantile == 1.0
            and not (self.entropy_coef or self.use_adaptive_entropy),
            "token_budget",
            "top_entropy_quantile < 1 and the entropy bonus are taken over a whole micro-batch: "
            "unset token_budget or them",
        )
        need(
            not (self.batch_invariant and self.padding_free),
            "padding_free",
            "batch_invariant=true scores padded rows with its own kernels: set one of them",
        )
        need(
            not (self.batch_invariant and (self.tools or self.environment_factory is not None)),
            "batch_invariant",
            "tool rounds re-lay each turn's context at other slots than the trainer's; "
            "unset tools/environment_factory or batch_invariant",
        )
        need(
            all(r in REPORTERS for r in self.reporters()),
            "report_to",
            f"takes names from {list(REPORTERS)}",
        )
        return self

    def trainer_processes(self, launched: int) -> int:
        """Of the processes launched, those that train (async_rollouts under torchrun: not the
        rollout_processes)."""
        if not self.async_rollouts or launched == 1:
            return launched
        return max(1, launched - self.rollout_processes)  # (fewer: refused by check_async)

    def rounds_in_flight(self) -> int:
        """async_rollouts: the rounds a sampler draws and scores at once, max_staleness (round r +
        max_staleness needs the weights trained on round r), at least 1."""
        return max(1, self.max_staleness)

    def _validate_batch(self, world_size: int):
        """TRL's GRPOConfig rules for the batch, with TRL's reasons."""
        need = self._need
        G = self.num_generations
        need(G >= 2, "num_generations", "GRPO needs at least 2 completions per prompt")
        both = self.steps_per_generation and self.generation_batch_size
        need(
            not both,
            "generation_batch_size",
            "set it or steps_per_generation, not both (as in TRL)",
        )
        global_batch = self.per_device_train_batch_size * world_size
        gbs = self.generation_batch_size
        need(
            gbs is None or gbs % global_batch == 0,
            "generation_batch_size",
            f"must be divisible by the global batch size "
            f"(per_device_train_batch_size x processes = {global_batch}; TRL's rule)",
        )
        sched = batch_schedule(self, world_size)
        if sched.generation_batch_size % G:
            raise ConfigError(
                f"generation_batch_size ({sched.generation_batch_size} = "
                f"per_device_train_batch_size x {world_size} process(es) x "
                f"steps_per_generation {sched.steps_per_generation}) must be "
                f"divisible by num_generations ({G}): a generation round "
                "holds whole groups (TRL's rule)"
            )
        need(
            not self.dynamic_sampling or sched.whole_groups_per_rank,
            "dynamic_sampling",
            f"needs each process to hold whole groups: "
            f"per_device_train_batch_size x steps_per_generation "
            f"({sched.completions_per_round_per_rank}) must be a multiple of "
            f"num_generations={G}",
        )
        need(
            self.max_steps > 0 or self.max_steps == -1,
            "max_steps",
            "must be > 0, or -1 for num_train_epochs",
        )

    def _validate_sampling_and_loss(self):
        try:  # the sampler's and the loss's own rules, not restated here
            check_sampling(
                temperature=self.temperature,
                top_k=self.top_k,
                top_p=self.top_p,
                min_p=self.min_p or 0.0,
                repetition_penalty=self.repetition_penalty,
            )
            generation_settings(self.generation_kwargs)  # its keys, over those
            loss_settings(**self.loss_config())
        except ValueError as e:
            message = str(e).removeprefix("LossConfig.").removeprefix("LossTerms.")
            raise ConfigError(message) from None
        self._need(
            self.temperature > 0,
            "temperature",
            "training samples, so it must be > 0 (0 = greedy is for sample.py)",
        )

    def _validate_rewards(self):
        need = self._need
        n = len(self.reward_funcs)
        # an environment's get_reward may be the reward: trainer.setup checks once it has one
        need(
            n >= 1 or self.environment_factory is not None,
            "reward_funcs",
            "needs at least one reward function (or an environment_factory whose "
            "environment defines get_reward)",
        )
        for key in ("reward_weights", "reward_processing_classes"):
            value = getattr(self, key)
            need(
                value is None or len(value) == n,
                key,
                f"needs one entry per reward function ({n}); "
                "reward_processing_classes holds None where a function "
                "is not a reward model",
            )
        window = self.soft_punish_cache
        need(
            window is None or window <= self.max_completion_length,
            "soft_punish_cache",
            "must be in [1, max_completion_length]",
        )

    def _validate_rollouts(self):
        """TRL's rules for environment_factory, rollout_func and a run without a dataset."""
        need = self._need
        factory = self.environment_factory
        need(
            self.rollout_func is None or not (self.tools or factory is not None),
            "rollout_func",
            "generates whole completions: call tools from inside it, and "
            "leave tools and environment_factory unset",
        )
        if self.dataset is not None:
            return
        need(
            factory is not None,
            "dataset",
            "a dataset is required unless an environment_factory is provided (TRL's rule), "
            "whose reset() returns each prompt",
        )
        need(
            not isinstance(factory, dict),
            "dataset",
            "a dict environment_factory (several environments) needs a dataset with an "
            "`environment` column to route each row to its environment (TRL's rule)",
        )
        need(
            self.max_steps > 0,
            "max_steps",
            "must be > 0 without a dataset: the environment owns the data, so max_steps "
            "sets the length of training (TRL's rule)",
        )

    def check_lora(self, lora: bool):
        """The rules that depend on whether the policy carries LoRA
        adapters: `lora` is use_peft here (validate), or, once the model is
        loaded, whether it has them (a PEFT adapter directory as `model`
        brings its own)."""
        if lora and self.sync_ref_model:
            raise ConfigError(
                "sync_ref_model=True: refused with LoRA adapters (use_peft, or "
                "a PEFT adapter directory as model), as TRL does"
            )

    def warnings(self) -> list[str]:
        """What is valid but probably not meant, one sentence each."""
        out = []
        if self.eval_strategy != "no" and not self.eval_dataset:
            out.append(
                f"eval_strategy={self.eval_strategy!r} without an eval_dataset: no evaluation"
            )
        # the sampler's own settings: the fields, with generation_kwargs over them
        given = generation_settings(self.generation_kwargs)
        top_k = given.get("top_k", self.top_k)
        top_p = given.get("top_p", self.top_p)
        min_p = given.get("min_p", self.min_p)
        filtered = (
            top_k > 0
            or top_p < 1
            or bool(min_p)
            or bool(given.get("suppress_tokens"))
            or given.get("min_new_tokens", 0) > 0
        )
        if filtered and self.vllm_importance_sampling_correction:
            out.append(
                "the sampler's log-probs are those of the distribution "
                "top_k/top_p/min_p (or generation_kwargs' suppress_tokens, "
                "min_new_tokens) leave (as vLLM's processed_logprobs, "
                "which TRL uses), so vllm_importance_sampling_correction "
                "weighs each completion by the probability mass the "
                "filters kept; TRL without vLLM applies no correction: "
                "vllm_importance_sampling_correction=False matches it"
            )
        if self.importance_sampling_level == "sequence" and self.loss_type in LENGTH_WEIGHTED:
            out.append(
                f"importance_sampling_level='sequence' with loss_type={self.loss_type!r}: "
                "the loss adds each sequence's weight once per token, so a longer "
                "completion counts more, not once per sequence as in GSPO; "
                "loss_type='grpo' is GSPO's objective (TRL warns the same)"
            )
        if self.vespo_drops_sampler_correction():
            out.append(
                "loss_type='vespo' folds only a token-level sampler correction into its "
                f"weight: with vllm_importance_sampling_mode="
                f"{self.vllm_importance_sampling_mode!r} it trains with none, as TRL does "
                "without vLLM; token_truncate or token_mask folds it in, as TRL with vLLM"
            )
        return out

    def vespo_drops_sampler_correction(self) -> bool:
        """loss_type='vespo' with the sampler correction on at sequence level: TRL refuses
        it only with vLLM (use_vllm, which nanogrpo has not) and applies no correction
        without it, so loss_config turns the correction off."""
        token_level = self.vllm_importance_sampling_mode in ("token_truncate", "token_mask")
        correcting = self.vllm_importance_sampling_correction
        return self.loss_type == "vespo" and correcting and not token_level
