"""What train.py's algorithm holds between rounds (`Trainer`) and how a run builds it (`setup`):
the policy (and a reference model), tokenizer, optimizer and learning-rate schedule, reward
functions, tools and the prompts, each checked before step 1; and `Kernels`, the functions a
round calls where nanogrpo/fast/ has faster equal ones.

Owns: `Trainer`, `Kernels`, `setup`, and the loaders it calls (`load_policy`, `make_optimizer`,
`build_reward_funcs`, `load_data`); `Given`, what a Python caller (nanogrpo/api/) hands setup in
place of the config's names. With environment_factory, setup makes the run's
`Environments` (extras/environments.py): their get_reward functions join the reward functions,
their tools the prompts' checks.

Leaves out: loading weights (checkpoint/__init__.py), the faster kernels (fast/__init__.py's
`kernels`, which train.py picks), and the run around the algorithm: resume, saving, stops,
metrics (nanogrpo/run/).

Does not know about: what a round does with them (train.py), or resume (run.restore fills in
the fields a checkpoint holds; setup only loads the policy's weights from the checkpoint it is
given, and load_data reads its prompt order's row count, to refuse another dataset before
rendering its rows).
"""

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanogrpo import checkpoint, distributed as dist
from nanogrpo.data import PromptSampler, check_prompts, check_same_dataset
from nanogrpo.extras import lora
from nanogrpo.extras.custom_rollout import resolve_rollout_func
from nanogrpo.extras.datasets import load_dataset
from nanogrpo.extras.environments import Environments, placeholder_rows
from nanogrpo.extras.generation_kwargs import sampling_of
from nanogrpo.extras.loss_terms import LossTerms, loss_settings
from nanogrpo.extras.lr_schedules import lr_lambda, warmup_length
from nanogrpo.extras.reward_funcs import check_names, check_reward_columns, resolve_reward_funcs
from nanogrpo.extras.tool_rounds import ToolTurns, tool_rules
from nanogrpo.extras.tools import resolve_tools, tool_schema
from nanogrpo.extras.trainer_info import TrainerState, trainer_state_of
from nanogrpo.grpo import LossConfig
from nanogrpo.logprobs import policy_logprobs, token_logprobs
from nanogrpo.run.config import ConfigError, TrainConfig
from nanogrpo.sampler import Sampling, sample_next_token
from nanogrpo.schedules import Schedule, one_forward_each
from nanogrpo.tokenizer import Tokenizer


@dataclass(frozen=True)
class Kernels:
    """Where nanogrpo/fast/ has an equal, faster function: the course's; train.kernels picks."""

    sample_token: Callable = sample_next_token  # the draw of one token
    decoder: type | None = None  # the decode step's class (sampler.Decoder's interface); None: it
    # old and reference log-probs: logprobs.token_logprobs' signature
    token_logprobs: Callable = token_logprobs
    # the update's log-probs: logprobs.policy_logprobs' signature
    policy_logprobs: Callable = policy_logprobs
    # within(the run's autocast) -> the context every forward of a round runs in (sampling,
    # scoring, the update): the autocast, or fast/batch_invariant.py's BatchInvariant around it
    within: Callable = lambda autocast: autocast
    # (micro-batches, loss type, DistInfo) -> the update's forwards [(Rollout, rows, loss share)]
    forwards: Callable = one_forward_each


@dataclass
class Trainer:
    """What the algorithm holds between rounds."""

    cfg: TrainConfig
    info: dist.DistInfo
    sched: Schedule  # every derived batch count
    tok: Tokenizer
    model: torch.nn.Module  # the policy (FSDP2-sharded on several ranks)
    ref: torch.nn.Module | None  # reference model: beta > 0 without LoRA
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loss_cfg: LossConfig
    loss_terms: LossTerms | None  # the options around the loss when one is on (extras/), or None
    reward_funcs: list  # [(name, fn)]
    reward_weights: torch.Tensor  # [K]
    turns: ToolTurns | None  # the config's tools as rollout's tool rounds (extras/), or None
    sampling: Sampling  # generate's settings (sampling fields, generation_kwargs, stop ids, draw)
    prompts: PromptSampler  # all ranks' prompts, resumable
    eval_rows: list | None
    autocast: object  # bf16 autocast where the run computes in bf16 on one process, else a no-op
    step: int = 0  # optimizer steps done
    round: int = 0  # generation rounds done
    # the entropy bonus's coefficient and the last step's mean entropy (inf: none); checkpointed
    entropy_coef: float = 0.0
    last_entropy: float = math.inf
    environments: Environments | None = None  # environment_factory's (extras/environments.py)
    rollout_func: object = None  # the config's rollout_func, resolved (extras/custom_rollout.py)
    kernels: Kernels = field(default_factory=Kernels)  # sampling and scoring: train.kernels
    # whether the update's forward drops LoRA adapter inputs (lora_dropout > 0), the sampler's not
    drops_adapter_inputs: bool = False
    # transformers' TrainerState of the run, live (extras/trainer_info.py): reward functions get it
    state: TrainerState | None = None
    rollouts: object = None  # async_rollouts' sampler process (run/async_rollouts.py), or None


def load_policy(path, cfg: TrainConfig, info, lora_settings=None):
    """The policy in the config's weight dtype (float32 unless model_init_kwargs says otherwise;
    bf16 compute under autocast, or FSDP2's mixed precision on several ranks, where it is
    sharded); with lora_settings, fresh LoRA adapters on it."""
    model = checkpoint.load_model(
        path,
        dtype=cfg.weight_dtype(),
        device=info.device,
        info=info,
        mixed_precision=cfg.use_bf16(info.device),
        lora_settings=lora_settings,
    )
    model.cast_lm_head_to_fp32 = cfg.cast_lm_head_to_fp32
    return model


@dataclass(frozen=True)
class Given:
    """What a Python caller hands setup in place of the config's names: the rows of dataset and
    eval_dataset (which then only name them), a tokenizer, the policy's loader."""

    rows: list | None = None
    eval_rows: list | None = None
    tokenizer: Tokenizer | None = None
    load_policy: Callable = load_policy


def make_optimizer(model, cfg: TrainConfig, info):
    """AdamW (transformers' optim names) and its learning-rate schedule,
    step for step transformers' get_scheduler (extras/lr_schedules.py)."""
    # fused: one kernel for the whole step; FSDP2's sharded parameters keep the default one
    fused = cfg.optim == "adamw_torch_fused" and info.world_size == 1
    optimizer = torch.optim.AdamW(
        lora.trainable_parameters(model),
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.weight_decay,
        eps=cfg.adam_epsilon,
        fused=fused,
    )
    warmup = warmup_length(cfg.max_steps, cfg.warmup_steps, cfg.warmup_ratio)
    if cfg.lr_scheduler_type == "constant" and warmup == 0:  # the rate never moves
        return optimizer, torch.optim.lr_scheduler.ConstantLR(optimizer, 1.0, total_iters=0)
    multiplier = lr_lambda(
        cfg.lr_scheduler_type, warmup, cfg.max_steps, cfg.learning_rate, cfg.lr_scheduler_kwargs
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
    return optimizer, scheduler


def setup(cfg: TrainConfig, info, resume_from=None, kernels=None, given=Given()) -> Trainer:
    """Model (+ reference), tokenizer, optimizer, rewards, data (checked before step 1), kernels;
    each from `given` where it holds one."""
    kernels = kernels or Kernels()  # the course's, unless train.py picks
    torch.manual_seed(cfg.seed + info.rank)
    tok = given.tokenizer or Tokenizer.from_pretrained(cfg.model)
    model = given.load_policy(resume_from or cfg.model, cfg, info, cfg.lora_settings())
    model.gradient_checkpointing = cfg.gradient_checkpointing
    check_context(cfg, model)
    peft = hasattr(model, "lora_config")  # use_peft, or an adapter dir
    cfg.check_lora(peft)
    ref = None
    if cfg.beta > 0 and not peft:  # with LoRA: the adapters switched off
        ref = load_policy(cfg.model, cfg, info)
        ref.eval().requires_grad_(False)
    reward_funcs = build_reward_funcs(cfg, info)
    weights = cfg.reward_weights or [1.0] * len(reward_funcs)
    tools = resolve_tools(cfg.tools)
    rules = tool_rules(cfg)  # how the tool rounds run
    envs = None
    if cfg.environment_factory is not None:
        envs = Environments(cfg.environment_factory, tools, rules)
        owned = envs.reward_funcs()  # TRL: weight 1 each, named after the class
        reward_funcs += owned
        weights = weights + [1.0] * len(owned)
    check_names(reward_funcs)
    if not reward_funcs:  # TRL's message
        raise ConfigError(
            "No reward source provided. Pass `reward_funcs`, or an "
            "`environment_factory` whose environment defines a "
            "`get_reward` method."
        )
    sched = cfg.schedule(info.world_size)
    rows, eval_rows = load_data(
        cfg,
        tok,
        model,
        reward_funcs,
        tools=tools,
        envs=envs,
        num_placeholder_rows=sched.prompts_per_round,
        ckpt=resume_from,
        given=given,
    )
    # max_steps=-1: num_train_epochs passes over the prompts, as TRL counts, and steps below 1
    # (logging_steps, ...) a fraction of them; the trainer holds a copy with the counts
    cfg = cfg.with_total_steps(cfg.total_steps(len(rows), info.world_size))
    optimizer, scheduler = make_optimizer(model, cfg, info)
    loss_cfg, terms = loss_settings(**cfg.loss_config())
    t = Trainer(
        cfg=cfg,
        info=info,
        sched=sched,
        tok=tok,
        model=model,
        ref=ref,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_cfg=loss_cfg,
        loss_terms=terms if terms.on() else None,
        reward_funcs=reward_funcs,
        reward_weights=torch.tensor(weights, device=info.device),
        turns=ToolTurns(tools, rules=rules) if tools else None,
        sampling=sampling_of(cfg, tok, kernels),
        prompts=PromptSampler(
            rows, sched.prompts_per_round, seed=cfg.seed, shuffle=cfg.shuffle_dataset
        ),
        eval_rows=eval_rows,
        autocast=kernels.within(dist.autocast(info, cfg.use_bf16(info.device))),
        entropy_coef=cfg.entropy_coef,
        environments=envs,
        rollout_func=resolve_rollout_func(cfg.rollout_func),
        kernels=kernels,
        drops_adapter_inputs=lora.has_dropout(model),
    )
    t.state = trainer_state_of(t)
    return t


def check_context(cfg: TrainConfig, model):
    context = model.config.max_position_embeddings
    if cfg.max_completion_length >= context:
        raise ConfigError(
            f"max_completion_length={cfg.max_completion_length}: the "
            f"model's context is {context} positions and the prompt needs "
            "some; lower it"
        )


def build_reward_funcs(cfg: TrainConfig, info) -> list:
    dtype = torch.bfloat16 if cfg.use_bf16(info.device) else torch.float32
    return resolve_reward_funcs(
        cfg.reward_funcs,
        max_completion_length=cfg.max_completion_length,
        soft_punish_cache=cfg.soft_punish_cache,
        batch_size=cfg.per_device_train_batch_size,
        reward_processing_classes=cfg.reward_processing_classes,
        device=info.device,
        dtype=dtype,
    )


def load_data(
    cfg: TrainConfig,
    tok,
    model,
    reward_funcs,
    *,
    tools,
    envs=None,
    num_placeholder_rows=1,
    ckpt=None,
    given=Given(),
):
    """Training and eval rows, checked before step 1: each prompt fits the context (with the
    tools' schemas: with environments, those of its row's environment) and carries every column
    the reward functions read (a rollout_func's fields may bring them: not checked then). Without
    a dataset, TRL's num_placeholder_rows empty prompts, which the environment's reset() fills.
    Resuming checkpoint `ckpt`, another dataset than its run's is refused first. given.rows and
    given.eval_rows, where set, are the datasets' rows (checked by their caller)."""
    needs_prompt = envs is None  # an environment's reset() may write it
    if cfg.dataset is None:
        rows = placeholder_rows(num_placeholder_rows)
    else:
        rows = given.rows or load_dataset(
            cfg.dataset, split=cfg.dataset_split, seed=cfg.seed, needs_prompt=needs_prompt
        )
    if ckpt:  # its prompt order is over its dataset's rows: checked before they are rendered
        state = checkpoint.read_json(os.path.join(ckpt, "trainer", "trainer_state.json"))
        check_same_dataset(rows, state["prompts"], cfg.dataset)
    eval_rows = None
    if cfg.evaluates():
        eval_rows = given.eval_rows or load_dataset(
            cfg.eval_dataset, split=cfg.eval_split, seed=cfg.seed, needs_prompt=needs_prompt
        )
        eval_rows = eval_rows[: cfg.eval_size]
    for warning in cfg.warnings():
        dist.print0(f"warning: {warning}")
    room = model.config.max_position_embeddings - cfg.max_completion_length
    schemas = [tool_schema(fn) for fn in tools.values()] or None
    encode = cfg.prompt_encoding()
    for source, checked in ((cfg.dataset, rows), (cfg.eval_dataset, eval_rows or [])):
        prompts = checked
        if envs is not None:
            envs.check_rows(checked, source)
            schemas = envs.schemas_of
            prompts = [{**row, "prompt": envs.prompt_of(row)} for row in checked]
        cut = check_prompts(prompts, source, tok, room, tools=schemas, **encode)
        if cut:
            dist.print0(
                f"warning: {cut} of {len(checked)} prompts of "
                f"{source} are longer than max_prompt_length="
                f"{cfg.max_prompt_length} tokens: cut from the left"
            )
        # a rollout_func's fields may hold the columns the functions need
        needing = reward_funcs if cfg.rollout_func is None else []
        check_reward_columns(needing, checked, source, environments=envs is not None)
    return rows, eval_rows
