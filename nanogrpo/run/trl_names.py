"""TRL's other names: its scripts' ScriptArguments and ModelConfig, and the TrainingArguments
TrainConfig lacks. Each is translated (`ALIASES`, `TRANSLATED`), accepted with a note because it
changes nothing here (`NO_EFFECT`), or refused with why (`REFUSED`, `refusal`) unless its value
is off or TRL's default (`TRL_DEFAULTS`), never given a "did you mean" (a close spelling may mean
something else). run/configurator.py and api/config.py read them.

Does not know about: what a setting does, the model, tokenization, or files.
"""

from nanogrpo.run.config import ConfigError
from nanogrpo.run.values import convert, note

# TRL's names for TrainConfig's fields
ALIASES = {
    "model_name_or_path": "model",  # ModelConfig
    "dataset_name": "dataset",  # ScriptArguments
    "dataset_train_split": "dataset_split",
    "dataset_test_split": "eval_split",
    # transformers 5's name; gradient_checkpointing is its deprecated alias, and None the unset
    "activation_checkpointing": "gradient_checkpointing",
    # TRL's deprecated name (its __post_init__ copies it to clip_max); None: unset
    "vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max",
}


def _dtype(key, value, from_text) -> dict:
    """ModelConfig's dtype (torch_dtype before): the weights' dtype, which
    TrainConfig reads from model_init_kwargs as TRL's trainer does."""
    dtype = convert(key, value, str | None, from_text)
    return {} if dtype is None else {"model_init_kwargs": {"dtype": dtype}}


def _save_strategy(key, value, from_text) -> dict:
    """TrainingArguments' save_strategy: "steps" is what save_steps does;
    "no" saves no checkpoint on the way (the last step is saved all the same)."""
    strategy = convert(key, value, str, from_text)
    if strategy == "steps":
        return {}
    if strategy == "no":
        note(
            "save_strategy='no': save_steps=0, no checkpoint on the way; "
            "the last step is saved all the same"
        )
        return {"save_steps": 0}
    raise ConfigError(
        f"{key}={strategy!r}: checkpoints come every save_steps "
        "optimizer steps: use save_strategy='steps' or 'no'"
    )


def _logging_strategy(key, value, from_text) -> dict:
    """Console lines and metrics come every logging_steps, whatever it says."""
    strategy = convert(key, value, str, from_text)
    if strategy != "steps":
        note(
            f"{key}={strategy!r} changes nothing here: a line and a metrics "
            "record come every logging_steps"
        )
    return {}


def _use_cpu(key, value, from_text) -> dict:
    return {"device": "cpu"} if convert(key, value, bool, from_text) else {}


def _model_revision(key, value, from_text) -> dict:
    revision = convert(key, value, str | None, from_text)
    if revision in (None, "main"):
        return {}
    raise ConfigError(
        f"{key}={revision!r}: a hub id loads its main revision; "
        "download that revision (huggingface-cli download --revision) "
        "and pass its directory as model"
    )


def _dataset_config(key, value, from_text) -> dict:
    """datasets' configuration name: nanogrpo reads files, which are one
    configuration's already (gsm8k's are those of "main")."""
    name = convert(key, value, str | None, from_text)
    if name is None:
        return {}
    if name in ("main", "default"):
        note(
            f"{key}={name!r} changes nothing here: the dataset's file is "
            "that configuration's (gsm8k reads main's)"
        )
        return {}
    raise ConfigError(
        f"{key}={name!r}: nanogrpo reads one file, not a datasets "
        "configuration: set dataset to the configuration's file, "
        "hf://datasets/<owner>/<name>/<file>"
    )


def _lora_task_type(key, value, from_text) -> dict:
    task = convert(key, value, str, from_text)
    if task == "CAUSAL_LM":
        return {}
    raise ConfigError(f"{key}={task!r}: nanogrpo trains causal LMs (CAUSAL_LM)")


# TRL's names whose meaning depends on their value: name -> fn(key, value,
# from_text) -> the TrainConfig settings it means
TRANSLATED = {
    "dtype": _dtype,  # ModelConfig
    "torch_dtype": _dtype,
    "model_revision": _model_revision,
    "lora_task_type": _lora_task_type,
    "dataset_config": _dataset_config,  # ScriptArguments
    "save_strategy": _save_strategy,  # TrainingArguments
    "logging_strategy": _logging_strategy,
    "use_cpu": _use_cpu,
}
NO_DATALOADER = "prompts come from nanogrpo's own prompt sampler, not a DataLoader"
NO_DDP = "several processes train with FSDP2, not DistributedDataParallel"
ONE_PRINTER = "rank 0 prints nanogrpo's own lines"
# TRL's names that change nothing here, whatever their value: accepted, with a note
NO_EFFECT = {
    "remove_unused_columns": "every dataset column reaches the reward functions",
    "dataloader_num_workers": NO_DATALOADER,
    "dataloader_pin_memory": NO_DATALOADER,
    "dataloader_persistent_workers": NO_DATALOADER,
    "dataloader_prefetch_factor": NO_DATALOADER,
    "log_level": ONE_PRINTER,
    "log_level_replica": ONE_PRINTER,
    "log_on_each_node": ONE_PRINTER,
    "disable_tqdm": "there is no progress bar: a line every logging_steps",
    "skip_memory_metrics": "no memory metrics are logged",
    "bf16_full_eval": "evaluation computes as training does (the bf16 setting)",
    "per_device_eval_batch_size": "evaluation runs in per_device_train_batch_size batches",
    "ddp_find_unused_parameters": NO_DDP,
    "ddp_bucket_cap_mb": NO_DDP,
    "ddp_broadcast_buffers": NO_DDP,
    "ddp_static_graph": NO_DDP,
    "ddp_backend": "the backend is nccl on CUDA, gloo on CPU (nanogrpo/distributed/)",
    "ignore_bias_buffers": NO_DDP,
    "local_rank": "torchrun's LOCAL_RANK environment variable places each process",
    "do_train": "train.py trains",
    "do_eval": "evaluation follows eval_strategy and eval_dataset",
    "do_predict": "train.py does not predict",
    "torch_empty_cache_steps": "it frees cached memory only",
    "gradient_checkpointing_kwargs": "checkpointing is non-reentrant, TRL's default",
    "gradient_checkpointing_use_reentrant": "checkpointing is non-reentrant, TRL's default",
    "activation_checkpointing_kwargs": "checkpointing is non-reentrant, TRL's default",
    "use_liger_kernel": "the LM head's log-probs are already chunked (fast/logprobs.py)",
    "attn_implementation": "nanogrpo's model attends with torch's scaled_dot_product_attention",
    "trust_remote_code": "nanogrpo's own model code loads the weights; no remote code runs",
    "dataset_streaming": "the dataset is read whole",
    "bnb_4bit_quant_type": "there is no 4-bit loading (load_in_4bit)",
    # TRL 1.16 pads its prompt and completion tensors to a multiple of it (128 on Neuron, whose
    # compiler wants few shapes); the padding is masked out of every sum
    "pad_to_multiple_of": "TRL pads its tensors to that multiple of positions, all masked: "
    "no loss, gradient or metric changes",
}

# trl 1.16 GRPOConfig's fields (with TrainingArguments') that TrainConfig
# lacks; tests/test_config.py keeps this list equal to the fixture's
TRL_ONLY = set(
    """
    accelerator_config activation_checkpointing
    activation_checkpointing_kwargs auto_find_batch_size
    average_tokens_across_devices batch_eval_metrics bf16_full_eval
    cache_implementation data_seed
    dataloader_drop_last dataloader_in_order
    dataloader_multiprocessing_context dataloader_num_workers
    dataloader_persistent_workers dataloader_pin_memory
    dataloader_prefetch_factor ddp_backend ddp_broadcast_buffers
    ddp_bucket_cap_mb ddp_find_unused_parameters ddp_static_graph
    debug deepspeed disable_tqdm do_eval do_predict do_train
    ds3_gather_for_generation enable_jit_checkpoint
    eval_accumulation_steps eval_delay eval_do_concat_batches
    eval_use_gather_object fp16 fp16_full_eval fsdp
    fsdp_config full_determinism
    gradient_checkpointing_kwargs greater_is_better hub_always_push
    hub_private_repo hub_revision hub_strategy hub_token
    ignore_data_skip include_for_metrics include_num_input_tokens_seen
    label_names label_smoothing_factor length_column_name
    liger_kernel_config load_best_model_at_end local_rank
    log_completions_hub_repo log_level log_level_replica log_multimodal
    log_on_each_node log_unique_prompts logging_nan_inf_filter
    logging_strategy metric_for_best_model neftune_noise_alpha
    optim_args optim_target_modules
    pad_to_multiple_of parallelism_config per_device_eval_batch_size
    prediction_loss_only project remove_unused_columns
    restore_callback_states_from_checkpoint router_aux_loss_coef
    save_on_each_node save_only_model save_strategy skip_memory_metrics
    tf32 torch_compile_backend torch_compile_mode
    torch_empty_cache_steps trackio_bucket_id trackio_space_id
    trackio_static_space_id train_sampling_strategy
    transformers_continuous_batching_config trust_remote_code
    use_cache use_cpu use_liger_kernel
    use_transformers_continuous_batching use_transformers_paged use_vllm
""".split()
)
FSDP2 = "several processes train with FSDP2 under torchrun: remove it"
NO_BITSANDBYTES = (
    "needs bitsandbytes, which nanogrpo does not use: train LoRA "
    'adapters on bf16 weights (model_init_kwargs={"dtype": "bfloat16"})'
)
# Refused, unless off (False, None, empty): each would change the result
REFUSED = {
    "use_vllm": "generation runs in nanogrpo's own KV-cached sampler: remove it",
    "fp16": "fp16 training is not supported: use bf16=True, or leave both out",
    "fp16_full_eval": "fp16 is not supported: evaluation computes as training does",
    "deepspeed": FSDP2,
    "fsdp": FSDP2,
    "fsdp_config": FSDP2,
    # ModelConfig
    "load_in_8bit": NO_BITSANDBYTES,
    "load_in_4bit": NO_BITSANDBYTES,
    "use_bnb_nested_quant": NO_BITSANDBYTES,
    "use_dora": "LoRA adapters are plain LoRA (extras/lora.py), not DoRA",
    "lora_target_parameters": "LoRA adapts modules (lora_target_modules), not parameters",
    # TRL's dataset mixtures (DatasetMixtureConfig)
    "datasets": "one dataset per run: set dataset",
    # GRPOTrainer's arguments, which a TRL script passes beside its config
    # (its tools, rollout_func and environment_factory are TrainConfig fields)
    "callbacks": "there are no trainer callbacks: a reward function may log "
    "(log_metric, log_extra)",
    "optimizers": "the optimizer is AdamW (optim, learning_rate, lr_scheduler_type)",
    "peft_config": "LoRA is set by ModelConfig's names: use_peft=True, lora_r, "
    "lora_alpha, lora_dropout, lora_target_modules",
    "processing_class": "the tokenizer is the model directory's",
    "train_dataset": "set dataset: a file, hf://datasets/..., or a built-in name",
}


# TRL 1.16's defaults of the names above that are not off (False, None, empty), as
# GRPOConfig().to_dict() writes them: at its default each asks for what nanogrpo does, so it is
# accepted with a note (tests/test_config.py holds the table to the fixture's dump)
TRL_DEFAULTS = {
    "accelerator_config": {
        "split_batches": False,
        "dispatch_batches": None,
        "even_batches": True,
        "use_seedable_sampler": True,
        "non_blocking": False,
        "gradient_accumulation_kwargs": None,
    },
    "average_tokens_across_devices": True,
    "dataloader_in_order": True,
    "ds3_gather_for_generation": True,
    "eval_delay": 0,
    "eval_do_concat_batches": True,
    "hub_strategy": "every_save",
    "hub_token": "<HUB_TOKEN>",  # to_dict()'s mask for any token (the hub login is read here)
    "include_num_input_tokens_seen": "no",
    "label_smoothing_factor": 0.0,
    "length_column_name": "length",
    "log_multimodal": True,
    "logging_nan_inf_filter": True,
    "project": "huggingface",
    "train_sampling_strategy": "random",
}


def at_trl_default(key: str, value, from_text: bool) -> bool:
    """Whether `value` (text read as the default's type) is TRL's default of a TRL_DEFAULTS name."""
    if key not in TRL_DEFAULTS:
        return False
    default = TRL_DEFAULTS[key]
    numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
    try:
        return convert(key, value, float if numeric else type(default), from_text) == default
    except ConfigError:
        return False


def refusal(key: str) -> str | None:
    """Why a TRL setting is refused, or None for a name TRL does not have."""
    if key in REFUSED:
        return REFUSED[key]
    if key in TRL_ONLY:
        return "a TRL/transformers setting nanogrpo does not have: remove it"
    return None
