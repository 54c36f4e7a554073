"""async_rollouts (TRL AsyncGRPOConfig's names): a sampler process draws the rounds ahead of the
update, on weights at most max_staleness optimizer steps old, with no inference engine: it runs
train.py's own sample_round (sample, score, advantages, reference log-probs) on its own copy of
the policy.

Owns: `start` (the sampler process, the store it puts the rounds in, the weights' channel) and
`Rollouts`, the trainer's handle: `take` (train.py's round calls it in place of sample_round: the
weights after the trainer's last step go out when due, then the next round is taken from the
store) and `close`;
what a checkpoint keeps of it (`Rollouts.checkpoint_tensors`) and a resumed run sends
(`resumed_weights`).

Under torchrun (`serve`, `connect`): the last R = rollout_processes of the W processes
launched sample, the others train (FSDP2 among themselves: distributed.setup gives them their own
group). Round r is drawn by rollout process r mod R (rank W - R + r mod R), whole, as one process
would draw the trainers' shares together, and trainer k gets its completions [k n, (k+1) n)
(`share`): whole groups, the advantages over the whole round as the synchronous trainers'
all-gather gives them. The weights go to every rollout process from trainer 0 (FSDP2's shards
gathered first) through a gloo group of every process; the rounds, pickled, through the launch's
store (torchrun's).

Does not know about: the GRPO math.

How the two processes meet:
- Weights travel through torch.distributed: a gloo pair of its own (trainer rank 0, sampler rank
  1), not the run's group, through host memory (on CUDA too: NCCL is not used yet, unmeasured):
  the trainer's trainable parameters (all of them, or LoRA's adapters: the frozen rest is the same
  in both) flattened in their dtype, stamped with their step, sent every weight_sync_steps steps
  without waiting (a copy, so the update goes on). The sampler keeps each on the host while it is
  the newest or a round in flight draws with it (Receiver): rounds overlap (Pipeline), and a
  round loads its own into the model whenever it takes the model.
- Completions travel back, pickled, through a store (the pair's TCPStore; torchrun's), each round
  with the step of the weights that drew it, at most queue_maxsize rounds (0: max_staleness, at
  least 1) ahead of the trainers: the sampler waits while as many are not taken (rounds_out).
- async_reproducible=true: round r is drawn with exactly the weights after step
  s(r) = max(0, r - max_staleness), rounded down to a multiple of weight_sync_steps; the sampler
  waits for them. The run is then its synchronous replay's, bit for bit: the same draws (seeded by
  round), the same weights. false: the sampler waits for those too, then takes any newer weights
  that have arrived (fresher, not reproducible); a round past max_staleness would be dropped
  (TRL's rule), which one round per step never reaches. (TRL's sampler takes whatever it has and
  drops: a sampler faster than the update would then draw every round too stale.)
- Stops and resume: a checkpoint after step k keeps the weights (trainable, flattened) of the
  steps before k that rounds k.. k+max_staleness-1 are due (trainer/async_weights.safetensors;
  the trainer holds them on the host: at most max_staleness // weight_sync_steps + 1 copies); the
  rounds queued or in flight are dropped, and the resumed run's sampler redraws them with those
  weights, exactly.
- The clipped ratio's old policy is the sampler's own log-probs (ro.sampling_logps), as TRL's
  AsyncGRPOTrainer; with max_staleness=0 every round is drawn with the current weights and
  trains on-policy, as the synchronous trainer.
- A sampler that dies or stops answering ends the run within heartbeat_stale_after_s with one line
  naming it; an exception in it comes back as its one line.
- Threads on CPU: the sampler process takes half of the run's torch threads (at least 1), the
  trainer the rest.
"""

import collections
import dataclasses
import datetime
import inspect
import io
import os
import pickle
import signal
import socket
import threading
import time
import traceback
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as c10d
import torch.multiprocessing as mp

from nanogrpo import distributed as dist
from nanogrpo.extras.lora import trainable_parameters  # those that travel (LoRA: adapters)
from nanogrpo.extras.reward_funcs import FILES, from_file
from nanogrpo.extras.trainer_info import RoundState
from nanogrpo.run.stops import RankFailure

SAMPLER_RANK, TRAINER_RANK = 1, 0  # one process: the pair's ranks (torchrun: see launch_group)
HEADER, WEIGHTS = 0, 1  # the tags of a weights message's two parts
END = -1  # a weights header's step: the run is over (a rollout process returns)
SNAPSHOTS = "async_weights.safetensors"  # a checkpoint's trainer/: checkpoint_tensors
SAMPLER = "nanogrpo-sampler"  # the sampler process's name


class SamplerFailed(RankFailure):
    """The sampler process died, stopped answering or raised: its one line (train.py: error)."""


def needed_step(rnd: int, staleness: int, sync_steps: int) -> int:
    """The step of the weights round rnd is drawn with in the reproducible mode."""
    return max(0, rnd - staleness) // sync_steps * sync_steps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pair(port: int, rank: int, timeout: float, alive=None):
    """The trainer's and the sampler's own store (the trainer's the server) and gloo group (not
    the run's); the trainer waits for the sampler while alive() (which raises once it is gone)."""
    wait = datetime.timedelta(seconds=timeout)
    trainer = rank == TRAINER_RANK
    store = c10d.TCPStore("127.0.0.1", port, 2, trainer, timeout=wait, wait_for_workers=False)
    if trainer:
        wait_for(store, "connected", timeout, alive)
    else:
        store.set("connected", b"")
    return store, c10d.ProcessGroupGloo(store, rank, 2, wait)


def watch(process):
    """alive() for `process`: raises SamplerFailed once it has ended."""

    def alive():
        if not process.is_alive():
            code = process.exitcode
            raise SamplerFailed(f"the sampler process died (exit code {code})")

    return alive


# -----------------------------------------------------------------------------
# The trainer's side


def settings(t, sample_round) -> dict:
    """What each trainer's handle (Rollouts, Replay) takes from t."""
    cfg = t.cfg
    return dict(
        staleness=cfg.max_staleness,
        sync_steps=cfg.weight_sync_steps,
        reproducible=cfg.async_reproducible,
        heartbeat=cfg.heartbeat_stale_after_s,
        seed=sample_round.__globals__["round_seed"],
        rank=t.info.rank,
        device=t.info.device,
        next_round=t.round,
    )


@dataclass
class Rollouts:
    """The trainer's handle on its sampler process(es) (see the module docstring)."""

    staleness: int
    sync_steps: int
    reproducible: bool
    heartbeat: float
    seed: object  # train.round_seed
    store: object = None  # where the rounds arrive (round_key)
    group: object = None  # where the weights go
    process: object = None  # the sampler process (torchrun: None, launched with the trainers)
    samplers: tuple = (SAMPLER_RANK,)  # their ranks in group (torchrun: after the trainers')
    rank: int = 0  # this trainer's: only trainer 0 sends weights and keeps them
    device: object = None  # the rounds' tensors go there
    next_round: int = 0
    sent: list = field(default_factory=list)  # (Work, buffer) not yet known to be received
    published: int = -1  # the step of the last weights sent
    kept: dict = field(default_factory=dict)  # step -> weights sent that rounds still need
    dropped: int = 0  # completions dropped as too stale (async_reproducible=false)

    def publish(self, t):
        """Send the weights after step t.step when due (every weight_sync_steps) and not sent."""
        if t.step == self.published or t.step % self.sync_steps:
            return
        flat = torch.cat([p.reshape(-1) for p in full_weights(t.model)]).cpu()
        self.send(t.step, flat)

    def send(self, step: int, flat: torch.Tensor):
        """The weights after `step` (trainable, flattened) to every sampler, without waiting; kept
        while rounds are due them (the reproducible mode: to redraw them with, should the run
        resume)."""
        self.published = step
        if self.rank != 0:
            return
        if self.reproducible:
            oldest = needed_step(step, self.staleness, self.sync_steps)
            self.kept = {s: w for s, w in self.kept.items() if s >= oldest}
            self.kept[step] = flat
        header = torch.tensor([step], dtype=torch.long)
        self.sent = [(w, b) for w, b in self.sent if not w.is_completed()]
        for sampler in self.samplers:
            for tag, buffer in ((HEADER, header), (WEIGHTS, flat)):
                self.sent.append((self.group.send([buffer], sampler, tag), buffer))

    def checkpoint_tensors(self, step: int) -> dict:
        """What a checkpoint after `step` keeps: {SNAPSHOTS: {"step-<s>": weights}}, the weights
        (trainable, flattened) of the steps before it that the rounds after it are drawn with;
        {} when there are none (the unreproducible mode, max_staleness=0)."""
        oldest = needed_step(step, self.staleness, self.sync_steps)
        kept = {f"step-{s}": w for s, w in sorted(self.kept.items()) if oldest <= s < step}
        return {SNAPSHOTS: kept} if kept else {}

    def take(self, t, rnd: int):
        """train.sample_round's result for round rnd, from the sampler: (Rollout, what the report
        needs of it), with the async metrics."""
        self.publish(t)
        start = time.time()
        while True:
            payload = self.get()
            ro, sampled, drawn_with, waited = payload
            lag = t.step - drawn_with
            if self.reproducible or lag <= self.staleness:
                break
            self.dropped += len(ro.input_ids)  # past max_staleness: TRL drops it
        t.prompts.next_batch()  # as the sampler's did: a checkpoint records where the next begins
        if self.staleness > 0:  # the sampler's policy is the old one
            if ro.sampling_logps is None:
                raise ValueError(
                    f"async_rollouts: round {rnd} came without the sampler's log-probs (a "
                    "rollout_func returning logprobs=None), and they are the update's old "
                    "policy: return them, or set max_staleness=0"
                )
            ro.old_logps = ro.sampling_logps
        # LoRA dropout's masks in the update: seeded per round as the synchronous round seeds them
        torch.manual_seed(self.seed(t.cfg, rnd, t.info.rank, salt=2))
        sampled["timing"] = {"time/wait_for_rollouts": time.time() - start}
        sampled["async"] = {
            "async/staleness/mean": float(lag),
            "async/staleness/max": float(lag),
            "async/dropped": float(self.dropped),
            "async/queue": self.queued(),
            "time/wait_for_weights": waited,
            **{f"async/{k}": v for k, v in sampled.pop("sampler_timing").items()},
        }
        return ro, sampled

    def queued(self) -> float:
        """Rounds drawn and waiting for this trainer."""
        rounds = range(self.next_round, self.next_round + self.staleness + 1)
        return float(sum(self.store.check([round_key(r, self.rank)]) for r in rounds))

    def sampler(self, rnd: int) -> str:
        """Who draws round rnd, in words."""
        if self.process is not None:
            return "the sampler process"
        return f"the rollout process (rank {self.samplers[rnd % len(self.samplers)]})"

    def get(self):
        """The next round's payload (this trainer's share); SamplerFailed when who draws it is
        gone, silent for heartbeat_stale_after_s or raised."""
        rnd = self.next_round
        alive = None if self.process is None else watch(self.process)
        try:
            payload = take_object(
                self.store, round_key(rnd, self.rank), self.device, self.heartbeat, alive
            )
        except TimeoutError:
            raise SamplerFailed(
                f"{self.sampler(rnd)} sent no round for {self.heartbeat:.0f} s "
                "(heartbeat_stale_after_s)"
            ) from None
        if isinstance(payload, str):  # its exception, as one line
            raise SamplerFailed(f"{self.sampler(rnd)} failed: {payload}")
        self.next_round += 1
        return payload

    def close(self):
        """End the sampler process (queued rounds are dropped), or tell the rollout processes
        the run is over (trainer 0)."""
        if self.process is not None:
            if self.process.is_alive():
                self.process.terminate()
            self.process.join(timeout=30)
        elif self.rank == 0 and self.group is not None:
            header = torch.tensor([END], dtype=torch.long)
            for sampler in self.samplers:
                try:
                    self.group.send([header], sampler, HEADER).wait()
                except RuntimeError:  # it has ended already (a stop signal ends it at once)
                    pass
        self.group = None
        self.sent.clear()


def full_weights(model) -> list:
    """The trainable parameters (LoRA: the adapters), whole: FSDP2's shards gathered (every
    trainer calls it), detached."""
    with torch.no_grad():
        params = trainable_parameters(model)
        return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in params]


def start(t, sample_round, kernels, resume_from=None) -> Rollouts:
    """Start t's sampler process (train.py's sample_round and kernels, which it runs with its own
    trainer, its prompts where t's are), or under torchrun meet the rollout processes launched
    with the trainers; then send the weights the first rounds are drawn with: resumed
    (`resume_from`, a checkpoint), those the checkpoint kept, then those after t.step."""
    cfg, info = t.cfg, t.info
    begin = ((t.round, t.round + (cfg.max_steps - t.step)), t.prompts.state_dict())
    if info.launched > info.world_size:
        rollouts = connect(t, sample_round, begin)
    else:
        rollouts = spawn(t, sample_round, kernels, begin)
    if info.is_main:
        for step, flat in resumed_weights(t, resume_from, rollouts).items():
            rollouts.send(step, flat)
    rollouts.publish(t)
    return rollouts


def spawn(t, sample_round, kernels, begin) -> Rollouts:
    """start's one process: the sampler process, on t's device (on CPU, half the threads)."""
    cfg = t.cfg
    code = pickled((cfg, given_of(t), sample_round, kernels))
    threads = torch.get_num_threads()
    sampler_threads = max(1, threads // 2)
    torch.set_num_threads(max(1, threads - sampler_threads))
    port = free_port()
    heartbeat = cfg.heartbeat_stale_after_s
    # its start is small: the rest goes through the pair's store (a process that ended before it
    # read more than a pipe holds would leave process.start() waiting)
    args = (heartbeat, port, begin, t.info.device, sampler_threads)
    ctx = mp.get_context("spawn")
    process = ctx.Process(target=sampler_main, args=args, daemon=True, name=SAMPLER)
    process.start()
    on = f"{sampler_threads} CPU thread(s), the trainer {torch.get_num_threads()}"
    dist.print0(
        f"async_rollouts: a sampler process draws up to {cfg.rounds_in_flight()} round(s) "
        f"ahead" + (f" on {on}" if t.info.device.type == "cpu" else "")
    )
    store, group = pair(port, TRAINER_RANK, heartbeat, watch(process))
    store.set("code", code)
    return Rollouts(**settings(t, sample_round), store=store, group=group, process=process)


def given_of(t):
    """What a sampler's own trainer is given of t's: its rows and tokenizer (a Python caller's
    too, which the config only names)."""
    from nanogrpo.trainer import Given

    return Given(rows=t.prompts.rows, tokenizer=t.tok)


def not_in_a_sampler():
    """run.start's check: spawn runs the script that started the run anew in the sampler process
    (to find its functions), and a script that trains on import would start a run there."""
    if mp.current_process().name == SAMPLER:
        raise RuntimeError(
            "async_rollouts: the sampler process imports the script that started the run, and "
            'it starts training again: put the training under `if __name__ == "__main__":`'
        )


def connect(t, sample_round, begin) -> Rollouts:
    """start's torchrun side: trainer 0 says which rounds to draw and where the prompts are (the
    rollout processes wait for it), and every process joins the launch's group."""
    cfg, info = t.cfg, t.info
    store = launch_store()
    if info.is_main:
        put_object(store, "start", begin)
    group = launch_group(info, cfg.heartbeat_stale_after_s)
    trainers, R = info.world_size, cfg.rollout_processes
    samplers = tuple(range(trainers, info.launched))
    dist.print0(
        f"async_rollouts: {R} rollout process(es), rank(s) {trainers}..{info.launched - 1} "
        f"(round r on rank {trainers} + r mod {R}), each drawing up to "
        f"{cfg.rounds_in_flight()} round(s) ahead for {trainers} trainer process(es)"
    )
    return Rollouts(**settings(t, sample_round), store=store, group=group, samplers=samplers)


def resumed_weights(t, resume_from, rollouts) -> dict:
    """{step: weights} a checkpoint kept for the rounds after it (Rollouts.checkpoint_tensors),
    checked against the model; {} (said) when it kept none and the first rounds would need them."""
    steps = range(t.step, t.step + rollouts.staleness)
    needed = {needed_step(r, rollouts.staleness, rollouts.sync_steps) for r in steps}
    needed.discard(t.step)
    if not resume_from or not rollouts.reproducible or not needed:
        return {}
    path = os.path.join(resume_from, "trainer", SNAPSHOTS)
    if not os.path.exists(path):
        dist.print0(
            f"note: {resume_from} holds no async_rollouts weights (saved without async_rollouts "
            f"or async_reproducible): rounds {t.round}..{t.round + len(steps) - 1} are drawn "
            f"with the weights after step {t.step}, so this run continues the run but does not "
            "replay it"
        )
        return {}
    from safetensors.torch import load_file

    saved = {int(k.split("-")[1]): v for k, v in load_file(path).items()}
    params = trainable_parameters(t.model)
    size, dtype = sum(p.numel() for p in params), params[0].dtype
    missing = sorted(needed - set(saved))
    wrong = [s for s, v in saved.items() if v.numel() != size or v.dtype != dtype]
    if missing or wrong:
        raise ValueError(
            f"{path} does not hold the weights of steps {missing or wrong} as this model's "
            f"{size} trainable values: resume with the checkpoint's model and max_staleness"
        )
    return {s: saved[s] for s in sorted(needed)}


# -----------------------------------------------------------------------------
# The sampler's side


def pickled(obj) -> bytes:
    """obj as the sampler process unpickles it: the functions and classes of the files run as
    modules (reward_funcs.run_file: a config file's, a reward file's, train.py under the Python
    API) as where to find them (from_file), since the other process cannot import them by name;
    an error naming what cannot be pickled."""

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            name = getattr(obj, "__module__", None)
            kind = isinstance(obj, (types.FunctionType, type))
            if kind and name in FILES and "<locals>" not in obj.__qualname__:
                return from_file, (FILES[name], name, obj.__qualname__)
            return NotImplemented

    buffer = io.BytesIO()
    try:
        Pickler(buffer).dump(obj)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(
            f"async_rollouts: the sampler process is given the run's settings pickled, and {e}: "
            "define the reward functions, environments and tools at the top level of a file (a "
            "config file, a module, your script), not as lambdas or inside a function"
        ) from None
    return buffer.getvalue()


def sampler_main(heartbeat, port, begin, device, threads):
    """The sampler process: its own trainer (model, rewards, the trainer's rows and tokenizer,
    its prompts where the trainer's are) from the run's settings, train.py's sample_round and
    kernels (spawn's "code", pickled, from the pair's store); the rounds drawn and put in the
    pair's store (rounds_out)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's: it ends this process
    torch.set_num_threads(threads)
    store, group = pair(port, SAMPLER_RANK, heartbeat)
    try:
        wait_for(store, "code", heartbeat)
        cfg, given, sample_round, kernels = pickle.loads(store.get("code"))
    except Exception as e:  # (a file whose code the settings name is gone)
        return failed(store, rounds_of(begin), one_line(e))

    def trainer():
        from nanogrpo.trainer import setup

        return setup(cfg, dist.DistInfo(device=device), kernels=kernels(cfg), given=given)

    rounds_out(trainer, sample_round, group, store, begin, cfg)


def serve(t, sample_round):
    """A rollout process under torchrun (run.begin calls it, t its own trainer: rollout_config's
    whole round, on its device): trainer 0 says which rounds and where the prompts are, and this
    process's rounds (every R-th) are drawn and put in the launch's store for the trainers
    (rounds_out). SIGTERM or Ctrl-C ends it at once (the trainers save)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda n, frame: os._exit(128 + n))
    cfg, store = t.cfg, launch_store()
    group = launch_group(t.info, cfg.heartbeat_stale_after_s)
    begin = take_object(store, "start", "cpu", cfg.heartbeat_stale_after_s, keep=True)
    trainers = cfg.trainer_processes(t.info.launched)
    of = (dist.rank() - trainers, cfg.rollout_processes)  # (this one's index, R)
    rounds_out(lambda: t, sample_round, group, store, begin, cfg, trainers, of)


def rounds_out(trainer, sample_round, group, store, begin, cfg, trainers=1, of=(0, 1)):
    """The sampler's rounds (rounds_of: begin's, every R-th for of = (i, R)) drawn by trainer()
    (draw) and trainer k's share of each put in the store (round_key), at most queue_maxsize
    (0: max_staleness) rounds ahead of the trainers; an exception (trainer()'s too) goes, as one
    line, in place of each round left."""
    rounds = rounds_of(begin, of)
    ahead = cfg.queue_maxsize or cfg.rounds_in_flight()
    left = list(rounds)  # not yet delivered whole

    def deliver(payload):
        rnd = left[0]
        taken = [round_key(rnd - ahead, k) for k in range(trainers)]
        while any(store.check([key]) for key in taken):  # the queue is full
            time.sleep(0.01)
        for k in range(trainers):
            put_object(store, round_key(rnd, k), share(payload, k, trainers))
        left.pop(0)

    try:
        draw(trainer(), sample_round, group, begin, deliver, rounds)
    except Exception as e:
        failed(store, left, one_line(e), trainers)


def failed(store, rounds, line: str, trainers: int = 1):
    """The sampler's exception, as one line, in place of each of its rounds left: each trainer's
    next round, whichever it waits for."""
    for rnd in rounds:
        for k in range(trainers):
            put_object(store, round_key(rnd, k), line)


def rounds_of(begin, of=(0, 1)) -> range:
    """The rounds a sampler draws: begin's [first, last), those r with r mod R = i, of = (i, R)."""
    (first, last), _ = begin
    i, R = of
    return range(first + (i - first) % R, last, R)


def round_key(rnd: int, trainer: int) -> str:
    return f"round-{rnd}-trainer-{trainer}"


def draw(t, sample_round, group, begin, deliver, rounds):
    """begin: ((first, last), the prompt sampler's state at round first). `rounds` (begin's, or
    every R-th of them: rounds_of) drawn in order, each with the weights it is due, and scored
    while the next ones are drawn (Pipeline); each payload to deliver(); then the weights still
    sent are taken until the trainer ends the run."""
    (first, _), where = begin
    t.prompts.load_state_dict(where)
    receiver = Receiver(group, trainable_parameters(t.model))
    pipeline = Pipeline(t, sample_round, receiver, in_flight=t.cfg.rounds_in_flight())
    for payload in pipeline.run(rounds, first):
        deliver(payload)
    while receiver.receive():
        pass


def one_line(e: Exception) -> str:
    return traceback.format_exception_only(type(e), e)[-1].strip()


def share(payload, k: int, trainers: int):
    """Trainer k's share of a whole round's payload: completions [k n, (k+1) n) of its N = n x
    trainers (whole groups: run/rules.py), every per-row field cut to them, as round_prompts
    hands a rank its slice; the round's rewards, metrics and scalars whole."""
    ro, sampled, step, waited = payload
    N, G = len(ro.completions), ro.num_generations
    lo, hi = k * N // trainers, (k + 1) * N // trainers

    def cut(x):
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == N:
            return x[lo:hi]
        if isinstance(x, list) and len(x) == N:
            return x[lo:hi]
        if isinstance(x, dict):
            return {key: cut(v) for key, v in x.items()}
        return x

    fields = {f.name: cut(getattr(ro, f.name)) for f in dataclasses.fields(ro)}
    fields["rows"] = ro.rows[lo // G : hi // G]
    fields["extra_fields"] = None  # what the rewards read (the environments): scored, stays
    if len(ro.prompt_ids) == len(ro.rows):  # one per prompt
        fields["prompt_ids"] = ro.prompt_ids[lo // G : hi // G]
    mine = dataclasses.replace(ro, **fields)
    logs = dataclasses.replace(sampled["logs"], columns=cut(sampled["logs"].columns))
    return mine, dict(sampled, ro=mine, local=sampled["local"][lo:hi], logs=logs), step, waited


def rollout_config(cfg, info):
    """A rollout process's config (run.start): once trainer 0 has readied the run (the embedded
    default's checkpoint written), the trainers' whole round as one process's."""
    take_object(launch_store(), "start", "cpu", cfg.heartbeat_stale_after_s, keep=True)
    return whole_round(cfg, cfg.trainer_processes(info.launched))


def whole_round(cfg, trainers: int):
    """cfg drawing in one process the round `trainers` processes share."""
    per_device = cfg.per_device_train_batch_size * trainers
    return dataclasses.replace(cfg, per_device_train_batch_size=per_device)


def launch_store():
    """The keys of torchrun's store (every launched process's) that async_rollouts uses."""
    return c10d.PrefixStore("nanogrpo/async/", dist.launch_store())


def launch_group(info, timeout: float):
    """Every launched process's gloo group (torchrun; run's own group is the trainers'): each
    process its launch rank, trainer k rank k, the rollout processes after them."""
    wait = datetime.timedelta(seconds=timeout)
    return c10d.ProcessGroupGloo(launch_store(), dist.rank(), info.launched, wait)


def put_object(store, key: str, obj):
    """obj (torch.save's pickle: tensors too) under key in store."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    store.set(key, buffer.getvalue())


def wait_for(store, key: str, within: float, alive=None):
    """Until key is in store: looked for in a loop, so a signal's handler runs in between (and
    alive() is called, which raises when who sets it is gone); TimeoutError after `within` s."""
    deadline = time.time() + within
    while not store.check([key]):
        if alive is not None:
            alive()
        if time.time() > deadline:
            raise TimeoutError(key)
        time.sleep(0.005)


def take_object(store, key: str, device, within: float, alive=None, keep: bool = False):
    """The object put under key, its tensors on device, once it is there: looked for in a loop,
    so a signal's handler runs in between (and alive() is called, which raises when who sends it
    is gone); TimeoutError after `within` seconds; the key is deleted unless keep."""
    wait_for(store, key, within, alive)
    data = store.get(key)
    if not keep:
        store.delete_key(key)
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False)


class Pipeline:
    """Rounds in flight in the sampler process, up to `in_flight` (max_staleness, as TRL's rollout
    worker keeps max_inflight_tasks): each round a thread running train.sample_round. The model is
    one lock: a round holds it to draw (in round order: the prompts, the seeds and the weights it
    is due come in order) and to score with the model (reference log-probs), and lets it go while
    a tool round's calls run (an environment's steps: tool_rounds.ToolTurns.run_tools), inside
    each reward function call and while an `async def` one is awaited, where the next round
    starts drawing: a tool, an environment or a reward that waits (an LLM judge, a sandbox) waits
    beside the sampling and beside the other rounds' waits. A round that takes the lock back
    finds its own weights in the model (the Receiver keeps them while it is in flight), and its
    own environments (each round thread has its pool). Each round's numbers are its own (its
    trainer_state's global_step too: extras/trainer_info.RoundState): the result does not
    depend on the overlap."""

    def __init__(self, t, sample_round, receiver, in_flight):
        self.t, self.sample_round, self.receiver = t, sample_round, receiver
        self.in_flight = in_flight
        self.model = threading.Lock()
        self.turns = {}  # round -> threading.Event: it may start drawing
        self.current = threading.local()  # the round this thread runs, and its weights' step
        # it never trains: a round's eval_mode, nested in another's, gives eval back
        t.model.eval()
        t.reward_funcs = [(name, self.unlocked(fn)) for name, fn in t.reward_funcs]
        for tools in (t.turns, t.environments):
            if tools is not None:
                tools.run_tools = self.unlocked(tools.run_tools)
        if t.environments is not None:
            t.environments.pool = RoundPools(list(t.environments.pool))
        t.state = RoundState(t, self.current)  # what rewards and rollout_func read of the step

    def unlocked(self, fn):
        """fn, called without the model's lock (and letting the next round draw); an `async def`
        fn's coroutine is awaited without it too, so a round's judges wait beside the next
        rounds' (rewards.await_all awaits a round's coroutines together in its thread: the first
        to run lets the lock go, the last to end takes it back, and the round's weights)."""

        def let_go():
            if self.current.out == 0:
                self.turns[self.following[self.current.round]].set()
                self.model.release()
            self.current.out += 1

        def take_back():
            self.current.out -= 1
            if self.current.out == 0:
                self.model.acquire()
                self.receiver.load(self.current.step)

        async def awaited(coroutine):
            let_go()
            try:
                return await coroutine
            finally:
                take_back()

        def call(*args, **kwargs):
            let_go()
            try:
                out = fn(*args, **kwargs)
            finally:
                take_back()
            return awaited(out) if inspect.isawaitable(out) else out

        return call

    def one_round(self, rnd):
        self.current.round, self.current.out = rnd, 0  # out: its calls running unlocked
        cfg, step = self.t.cfg, None
        try:
            self.turns[rnd].wait()
            start = time.time()
            due = needed_step(rnd, cfg.max_staleness, cfg.weight_sync_steps)
            step = self.receiver.take(due, newest=not cfg.async_reproducible)
            self.current.step, waited = step, time.time() - start
            with self.model:
                self.receiver.load(step)
                for _ in range(self.passed[rnd]):  # the rounds other rollout processes draw
                    self.t.prompts.next_batch()
                ro, sampled = self.sample_round(self.t, rnd)
            sampled["sampler_timing"] = sampled.pop("timing")
            return ro, sampled, step, waited
        finally:
            self.turns[self.following[rnd]].set()  # (one that called no reward function, failed)
            if step is not None:
                self.receiver.give_back(step)

    def run(self, rounds, first):
        """The payloads of `rounds` (ascending: all of a run's from `first`, or every R-th under
        torchrun), in order; the prompts are at round `first`, those of the rounds passed over
        are skipped."""
        rounds = list(rounds)
        self.passed = {r: r - p - 1 for r, p in zip(rounds, [first - 1, *rounds])}
        self.following = dict(zip(rounds, [*rounds[1:], None]))
        self.turns = {r: threading.Event() for r in [*rounds, None]}
        self.turns[rounds[0] if rounds else None].set()
        with ThreadPoolExecutor(self.in_flight, thread_name_prefix="nanogrpo-round") as pool:
            futures = {}
            for rnd in rounds:
                while len(futures) >= self.in_flight:  # the oldest first, in order
                    oldest = min(futures)
                    yield futures.pop(oldest).result()
                futures[rnd] = pool.submit(self.one_round, rnd)
            for rnd in sorted(futures):
                yield futures[rnd].result()


class RoundPools(threading.local):
    """Environments.pool in the sampler process: each round thread its own instances (a round's
    rewards read its environments while the next round resets its own)."""

    def __init__(self, names):
        self.pools = {name: [] for name in names}

    def __getitem__(self, name):
        return self.pools[name]


class Receiver:
    """The sampler's end of the weights channel: the weights received (`step`: the newest), each
    kept on the host, flattened, while it is the newest or a round in flight draws with it
    (`take`, `give_back`), and loaded into the model for the round that holds the model's lock
    (`load`)."""

    def __init__(self, group, params):
        self.group, self.params = group, params
        self.size = sum(p.numel() for p in params)  # flattened, in their dtype (Rollouts.send)
        self.kept = {}  # step -> the weights after it
        self.spare = []  # buffers of weights forgotten, received into again (no new pages)
        self.drawing = collections.Counter()  # step -> rounds in flight drawing with it
        self.lock = threading.Lock()  # over kept and drawing (round threads change them)
        self.step = self.loaded = -1  # the newest weights received; those in the model
        self.header = torch.zeros(1, dtype=torch.long)
        self.pending = group.recv([self.header], TRAINER_RANK, HEADER)

    def receive(self) -> bool:
        """The next weights sent (waits for them), kept. -> False at the run's END."""
        self.pending.wait()
        if int(self.header[0]) == END:
            return False
        with self.lock:
            spare = self.spare.pop() if self.spare else None
        flat = torch.empty(self.size, dtype=self.params[0].dtype) if spare is None else spare
        self.group.recv([flat], TRAINER_RANK, WEIGHTS).wait()
        with self.lock:
            self.step = int(self.header[0])
            self.kept[self.step] = flat
            self.forget()
        self.pending = self.group.recv([self.header], TRAINER_RANK, HEADER)
        return True

    def take(self, step: int, newest: bool = False) -> int:
        """The weights a round draws with, kept until it gives them back: those after `step`
        (received until they come, in order), or with `newest` the newest sent by then. -> their
        step."""
        while self.step < step:
            if not self.receive():
                raise SamplerFailed(f"the run ended before the weights of step {step} came")
        while newest and self.pending.is_completed() and self.receive():
            pass
        with self.lock:
            self.drawing[self.step] += 1
            return self.step

    def give_back(self, step: int):
        with self.lock:
            self.drawing[step] -= 1
            if not self.drawing[step]:
                del self.drawing[step]
            self.forget()

    def forget(self):
        """(holding self.lock) Put aside the weights that are not the newest and no round draws
        with."""
        kept = {s: w for s, w in self.kept.items() if s == self.step or s in self.drawing}
        self.spare += [w for s, w in self.kept.items() if s not in kept]
        self.kept = kept

    def load(self, step: int):
        """The weights after `step` into the model, unless it holds them (called holding the
        model's lock)."""
        if self.loaded == step:
            return
        flat = self.kept[step]
        with torch.no_grad():
            offset = 0
            for p in self.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.loaded = step


# -----------------------------------------------------------------------------
# The synchronous replay


class Replay(Rollouts):
    """The reproducible mode's run without a process: round r drawn in this process, when the
    trainer takes it, by a second trainer holding the saved weights after step
    needed_step(r) (tests/test_async.py holds the asynchronous run equal to it, bit for bit)."""

    def __init__(self, t, sample_round, kernels, resume_from=None):
        from nanogrpo.trainer import setup

        cfg = t.cfg
        super().__init__(**settings(t, sample_round) | dict(reproducible=True))
        self.trainers = t.info.world_size  # each draws the whole round, takes its share
        whole = whole_round(cfg, self.trainers)
        info = dist.DistInfo(device=t.info.device)
        self.sampler = setup(whole, info, kernels=kernels(whole), given=given_of(t))
        self.sampler.prompts.load_state_dict(t.prompts.state_dict())
        self.sample_round = sample_round
        self.saved = {}  # step -> the trainable weights after it
        self.publish(t)

    def queued(self) -> float:
        return 0.0

    def publish(self, t):
        if t.step % self.sync_steps == 0 and t.step not in self.saved:
            self.saved[t.step] = [p.clone() for p in full_weights(t.model)]

    def get(self):
        rnd = self.next_round
        step = needed_step(rnd, self.staleness, self.sync_steps)
        with torch.no_grad():
            for p, saved in zip(trainable_parameters(self.sampler.model), self.saved[step]):
                p.copy_(saved)
        self.sampler.step = rnd  # its state's global_step, as the trainer's when it samples
        ro, sampled = self.sample_round(self.sampler, rnd)
        sampled["sampler_timing"] = sampled.pop("timing")
        self.next_round += 1
        return share((ro, sampled, step, 0.0), self.rank, self.trainers)
