"""Learning-rate schedules = transformers' get_scheduler, step for step (fixtures/make_trl_config_fixtures.py)."""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st

import train
from nanogrpo import schedules
from nanogrpo.data import PromptSampler
from nanogrpo.distributed import DistInfo
from nanogrpo.extras import lr_schedules
from nanogrpo.run.config import ConfigError, TrainConfig

CASES = json.load(
    open(os.path.join(os.path.dirname(__file__), "fixtures", "trl", "schedules.json"))
)["cases"]


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{c['kind']}-{c['max_steps']}-{c['warmup']}" for c in CASES]
)
def test_every_step_runs_at_transformers_rate(case):
    warmup = lr_schedules.warmup_length(
        case["max_steps"], case["warmup_steps"], case["warmup_ratio"]
    )
    assert warmup == case["warmup"]
    fn = lr_schedules.lr_lambda(
        case["kind"], warmup, case["max_steps"], case["learning_rate"], case["kwargs"]
    )
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=case["learning_rate"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
    lrs = []
    for _ in range(case["max_steps"]):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx(case["lrs"], rel=1e-12, abs=1e-15)


def test_the_first_warmup_step_runs_at_zero_and_a_ratio_rounds_up():
    assert lr_schedules.warmup_length(10, warmup_ratio=0.15) == 2  # ceil(1.5)
    assert lr_schedules.lr_lambda("linear", 2, 10, 1.0)(0) == 0.0


def test_bad_schedules_are_named():
    with pytest.raises(ValueError, match="lr_scheduler_type='polynomial' is not supported"):
        lr_schedules.lr_lambda("polynomial", 0, 10, 1.0)
    with pytest.raises(ValueError, match="needs exactly one of min_lr or min_lr_rate"):
        lr_schedules.lr_lambda("cosine_with_min_lr", 0, 10, 1.0)
    with pytest.raises(
        ValueError, match=r"\['num_cycles'\] do not apply to lr_scheduler_type='linear'"
    ):
        lr_schedules.lr_lambda("linear", 0, 10, 1.0, {"num_cycles": 2})


# -----------------------------------------------------------------------------
# The batch schedule: TRL's shapes, groups that span processes


SHAPES = json.load(
    open(os.path.join(os.path.dirname(__file__), "fixtures", "trl", "batch_shapes.json"))
)["cases"]
BATCH_KEYS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
    "num_generations",
)
TRL_REASONS = {  # the words of each of TRL's refusals that nanogrpo's must contain
    "divisible by the global batch size": "divisible by the global batch size",
    "divisible by num_generations": "divisible by num_generations",
    "can not be both configured": "not both",
}


@pytest.mark.parametrize(
    "case",
    SHAPES,
    ids=lambda c: (
        "P{processes}-b{per_device_train_batch_size}-"
        "ga{gradient_accumulation_steps}-spg{steps_per_generation}-"
        "gbs{generation_batch_size}-G{num_generations}".format(**c)
    ),
)
def test_every_batch_shape_runs_or_is_refused_as_trl_does(case):
    """tests/fixtures/trl/batch_shapes.json: GRPOConfig's own derivation (or refusal) of 400
    shapes on 1, 2, 3 and 8 processes. A shape TRL accepts gets TRL's counts; one it refuses is
    refused with TRL's reason."""
    P = case["processes"]
    cfg = TrainConfig(**{k: case[k] for k in BATCH_KEYS})
    if "error" in case["trl"]:
        reason = next(
            ours for theirs, ours in TRL_REASONS.items() if theirs in case["trl"]["error"]
        )
        with pytest.raises(ConfigError, match=reason):
            cfg.validate(P)
        return
    s = cfg.validate(P).schedule(P)
    assert s.generation_batch_size == case["trl"]["generation_batch_size"]
    assert s.steps_per_generation == case["trl"]["steps_per_generation"]
    assert s.prompts_per_round * s.num_generations == s.generation_batch_size
    assert s.completions_per_round_per_rank * P == s.generation_batch_size


def test_the_issues_shapes_and_the_seeds_recipe_on_8_processes():
    """The seeds' recipe (4 per device, accumulation 2, G 16) on 8 processes: 64 completions a
    round = 4 prompts, each group over two processes."""
    s = (
        TrainConfig(
            per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=16
        )
        .validate(8)
        .schedule(8)
    )
    assert (s.prompts_per_round, s.completions_per_round_per_rank) == (4, 8)
    assert not s.whole_groups_per_rank
    assert [s.rank_share(r) for r in (0, 1, 2, 7)] == [[(0, 8)], [(0, 8)], [(1, 8)], [(3, 8)]]
    # 2 processes x 6, accumulation 2, G 8: 3 prompts, rank 0 holds a group and a half
    s = (
        TrainConfig(per_device_train_batch_size=6, gradient_accumulation_steps=2, num_generations=8)
        .validate(2)
        .schedule(2)
    )
    assert s.prompts_per_round == 3
    assert s.rank_share(0) == [(0, 8), (1, 4)] and s.rank_share(1) == [(1, 4), (2, 8)]
    # 1 x 4, accumulation 1, steps_per_generation 2, G 8: a round of 1 prompt feeds 2 steps; with
    # max_steps=-1 an epoch of 10 prompts is 20 steps (it divided by zero)
    cfg = TrainConfig(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        steps_per_generation=2,
        num_generations=8,
        max_steps=-1,
        num_train_epochs=1,
    ).validate()
    assert cfg.schedule().prompts_per_round == 1 and cfg.total_steps(10) == 20
    table = (
        TrainConfig(
            per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=16
        )
        .validate(8)
        .schedule(8)
        .table()
    )
    assert "4 x 16 = 64" in table and "groups span processes" in table


def test_dynamic_sampling_needs_whole_groups_on_each_process():
    with pytest.raises(ConfigError, match="dynamic_sampling.*whole groups"):
        TrainConfig(
            per_device_train_batch_size=4, num_generations=8, dynamic_sampling=True
        ).validate(2)
    TrainConfig(per_device_train_batch_size=8, num_generations=8, dynamic_sampling=True).validate(2)


def test_num_train_epochs_counts_steps_as_trl():
    """max_steps=-1: ceil(epochs x the optimizer steps one pass over the prompts feeds, TRL's
    len(dataloader) // accumulation); max_steps > 0 wins."""
    cfg = TrainConfig(
        per_device_train_batch_size=8,
        num_generations=8,
        gradient_accumulation_steps=2,
        num_train_epochs=1.5,
    ).validate()
    assert cfg.total_steps(100) == 75  # 2 prompts a round, a round a step
    assert TrainConfig(num_iterations=2, num_train_epochs=1).total_steps(10) == 20
    assert TrainConfig(max_steps=7).total_steps(100) == 7
    # a step over 3 rounds of 1 prompt: 10 prompts feed 20 micro-batches, 3 whole steps and
    # one of the 2 left over (transformers rounds the epoch's steps up)
    spans = TrainConfig(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=6,
        steps_per_generation=2,
        num_generations=8,
        num_train_epochs=1,
    ).validate()
    assert spans.total_steps(10) == 4


def test_an_epoch_that_ends_inside_a_step_ends_it_early_as_transformers():
    """Regression: 8 prompts, a round of 1 prompt feeds 2 micro-batches and a step takes 3: an
    epoch's 16 micro-batches are 5 steps of 3 and one of 1 (transformers' remainder), 6 steps,
    so 3 epochs are TRL's 18 steps of 48 micro-batches (nanogrpo counted 15 steps, 45)."""
    cfg = TrainConfig(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        steps_per_generation=2,
        num_generations=8,
        num_train_epochs=3,
    ).validate()
    assert schedules.micro_batches_per_epoch(cfg, 8) == 16
    assert schedules.steps_per_epoch(cfg, 8) == 6
    assert cfg.total_steps(8) == 18
    sizes = [schedules.micro_batches_in_step(cfg, step, 8) for step in range(18)]
    assert sizes == [3, 3, 3, 3, 3, 1] * 3 and sum(sizes) == 48


def trl_epochs(cfg, num_prompts, world_size):
    """What TRL 1.16 with transformers 5.23 and accelerate 1.15 make of a shape, written from
    their source -> (len(train_dataloader) on a process, max_steps, the micro-batches of each
    optimizer step)."""
    P = world_size
    micro = cfg.per_device_train_batch_size
    GA = cfg.gradient_accumulation_steps
    G = cfg.num_generations
    # trl GRPOConfig.__post_init__: steps_per_generation and generation_batch_size
    if cfg.generation_batch_size is None:
        spg = cfg.steps_per_generation or GA
        gbs = micro * P * spg
    else:
        gbs = cfg.generation_batch_size
        spg = gbs // (micro * P)
    # trl GRPOTrainer._get_train_sampler: RepeatSampler(mini_repeat_count=G, batch_size=gbs // G,
    # repeat_count=num_iterations * spg); RepeatSampler.__len__
    chunk = gbs // G
    repeats = cfg.num_iterations * spg
    samples = (num_prompts // chunk) * chunk * G * repeats
    # GRPOTrainer.get_train_dataloader: batches of micro * spg, drop_last False (torch BatchSampler)
    batches = -(-samples // (micro * spg))
    # accelerate BatchSamplerShard.__len__ (even_batches, no split_batches)
    if batches % P == 0:
        length = batches // P
    else:
        length = batches // P + 1
    # transformers Trainer.set_initial_training_values
    per_epoch = max(length // GA + int(length % GA > 0), 1)
    max_steps = cfg.max_steps
    if max_steps < 0:
        max_steps = math.ceil(cfg.num_train_epochs * per_epoch)
    # transformers Trainer._run_epoch: the last update of an epoch takes the remainder
    remainder = length % GA or GA
    sizes = []
    while len(sizes) < max_steps:
        sizes += [GA] * (per_epoch - 1) + [remainder]
    return length, max_steps, sizes[:max_steps]


@settings(max_examples=150, deadline=None)
@given(
    world_size=st.sampled_from([1, 2, 3, 8]),
    per_device=st.integers(1, 12),
    GA=st.integers(1, 7),
    spg=st.integers(1, 5),
    by_gbs=st.booleans(),
    mu=st.integers(1, 3),
    G=st.sampled_from([2, 3, 4, 8, 16]),
    prompts_factor=st.integers(1, 40),
    extra_prompts=st.integers(0, 15),
    epochs=st.sampled_from([0.1, 0.5, 1.0, 1.5, 2.0, 2.7, 3.0]),
)
def test_total_steps_and_each_steps_micro_batches_are_trls_for_every_shape(
    world_size, per_device, GA, spg, by_gbs, mu, G, prompts_factor, extra_prompts, epochs
):
    """Over random shapes TRL accepts: max_steps from num_train_epochs, and how many
    micro-batches each optimizer step accumulates, equal TRL's chain of lengths (trl_epochs)."""
    gbs = per_device * world_size * spg
    if gbs % G:
        return  # TRL refuses it (test_every_batch_shape_runs_or_is_refused_as_trl_does)
    batch = {"generation_batch_size": gbs} if by_gbs else {"steps_per_generation": spg}
    cfg = TrainConfig(
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=GA,
        num_generations=G,
        num_iterations=mu,
        num_train_epochs=epochs,
        **batch,
    ).validate(world_size)
    num_prompts = prompts_factor * (gbs // G) + extra_prompts
    length, max_steps, sizes = trl_epochs(cfg, num_prompts, world_size)
    assert schedules.micro_batches_per_epoch(cfg, num_prompts, world_size) == length
    assert cfg.total_steps(num_prompts, world_size) == max_steps
    ours = [
        schedules.micro_batches_in_step(cfg, step, num_prompts, world_size)
        for step in range(max_steps)
    ]
    assert ours == sizes


def simulate_cycle(cfg, world_size, rank):
    """train.train_cycle on one rank with sampling and the update replaced by records of what
    they were given: the real round_prompts, micro_batches and step loop.
    -> (the (row, copies) rollouts sampled, the micro-batches of each step as (round, row))."""
    sched = cfg.schedule(world_size)
    rows = [{"prompt": f"p{i}"} for i in range(10 * sched.prompts_per_round)]
    t = SimpleNamespace(
        cfg=cfg,
        sched=sched,
        step=0,
        round=0,
        info=DistInfo(rank=rank, local_rank=rank, world_size=world_size, device="cpu"),
        prompts=PromptSampler(rows, sched.prompts_per_round, shuffle=False),
        rollouts=None,  # (async_rollouts off)
    )
    sampled, steps = [], []

    def sample_round(t, rnd):
        rows, copies = train.round_prompts(t)
        sampled.append((rnd, [(row["prompt"], copies) for row in rows]))
        return SimpleNamespace(round=rnd), {"stats": {}}

    def update(t, micro):
        steps.append([(ro.round, int(i)) for ro, idx in micro for i in idx])
        assert all(len(idx) == cfg.per_device_train_batch_size for _, idx in micro)
        t.step += 1
        return {}

    patched = dict(sample_round=train.sample_round, update=train.update)
    try:
        train.sample_round, train.update = sample_round, update
        train.train_cycle(t)
    finally:
        train.sample_round, train.update = patched["sample_round"], patched["update"]
    return sched, t, sampled, steps


@settings(max_examples=60, deadline=None)
@given(
    world_size=st.sampled_from([1, 2, 3, 8]),
    per_device=st.integers(1, 12),
    GA=st.integers(1, 4),
    spg_factor=st.integers(1, 4),
    mu=st.integers(1, 3),
    G=st.sampled_from([2, 3, 4, 8, 16]),
)
def test_completions_sampled_are_completions_trained_and_trls_count(
    world_size, per_device, GA, spg_factor, mu, G
):
    """Over random shapes TRL accepts, simulated on every rank: the ranks' shares of a round are
    TRL's prompt-major list of generation_batch_size completions cut in consecutive slices; each
    pass trains every sampled completion once; a cycle's steps take whole micro-batches."""
    spg = spg_factor
    if (per_device * world_size * spg) % G:
        return  # TRL refuses it (test_every_batch_shape_runs_or_is_refused_as_trl_does)
    cfg = TrainConfig(
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=GA,
        steps_per_generation=spg,
        num_generations=G,
        num_iterations=mu,
        max_steps=10**6,
    ).validate(world_size)
    everyone = []
    for rank in range(world_size):
        sched, t, sampled, steps = simulate_cycle(cfg, world_size, rank)
        assert len(sampled) == sched.rounds_per_cycle == t.round
        assert len(steps) == sched.steps_per_cycle == t.step
        n = sched.completions_per_round_per_rank
        for rnd, share in sampled:
            assert sum(copies for _, copies in share) == n  # sampled on this rank
            trained = [i for step in steps for r, i in step if r == rnd]
            assert sorted(trained) == sorted(list(range(n)) * mu)  # each row mu times
        everyone.append(
            [prompt for _, share in sampled[:1] for prompt, c in share for _ in range(c)]
        )
    # the ranks' slices, in rank order, are the round's prompts each repeated G times
    round_list = [p for rank in everyone for p in rank]
    prompts = [f"p{i}" for i in range(sched.prompts_per_round)]
    assert round_list == [p for p in prompts for _ in range(G)]
    assert len(round_list) == sched.generation_batch_size


def test_small_config_runs_on_any_number_of_gpus_as_its_comment_says():
    """configs/small.py: 64 completions a step per GPU on any count; 32 / GPUs accumulation
    steps give its 512."""
    from nanogrpo.run.config import TrainConfig
    from nanogrpo.run.configurator import read_config_file

    settings = {k: v for k, v in read_config_file("small").items() if k in BATCH_KEYS}
    for gpus in range(1, 9):
        s = TrainConfig(**settings).validate(gpus).schedule(gpus)
        assert s.completions_per_step == 64 * gpus and s.prompts_per_round == 8 * gpus
    for gpus in (1, 2, 4, 8):
        same = dict(settings, gradient_accumulation_steps=32 // gpus)
        s = TrainConfig(**same).validate(gpus).schedule(gpus)
        assert s.completions_per_step == 512 and s.prompts_per_round == 64
