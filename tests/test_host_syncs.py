"""Host syncs per optimizer step of the embedded default: the aten ops that would make the
host wait for a CUDA device (a scalar read, nonzero, a boolean-mask index, ...), seen on CPU by
a TorchDispatchMode, outside the sampler's decode loop (its per-token stop check is by design)."""

import math
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train
from nanogrpo.run.configurator import load_config, read_config_file

SYNCS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "unique",
    "_unique2",
    "unique_consecutive",
    "is_nonzero",
    "equal",
    "repeat_interleave",
    "nonzero_static",
    "allclose",
    "masked_scatter",
    "item",
}
MAX_SYNCS_PER_STEP = 12


def _bool_index(args) -> bool:
    for a in args:
        if isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor) and x.dtype == torch.bool:
                    return True
    return False


class CountSyncs(TorchDispatchMode):
    """Counts the syncing ops outside sampler.decode_loop."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        indexing = name in ("index", "index_put_", "index_put")
        if name in SYNCS or (indexing and _bool_index(args)):
            in_decode = any(f.name == "decode_loop" for f in traceback.extract_stack())
            self.count += not in_decode
        return func(*args, **(kwargs or {}))


def _config(tmp_path, steps: int, name: str):
    init = read_config_file("tiny")["init_model"]
    return load_config(
        [
            "--config",
            "tiny.py",
            f"--model={tmp_path}/init",
            f"--init_model={init!r}",
            f"--output_dir={tmp_path}/{name}",
            "--eval_strategy=no",
            "--save_steps=0",
            f"--max_steps={steps}",
        ]
    )


def _syncs(tmp_path, steps: int) -> int:
    with CountSyncs() as mode:
        train.train(_config(tmp_path, steps, f"run{steps}"))
    return mode.count


def test_the_default_syncs_the_host_at_most_12_times_a_step(tmp_path):
    """Steps 2-4 of the default (a 4-step run less a 1-step one: loading and the
    first step's setup cancel): metrics stay tensors through a step and are read once."""
    train.train(_config(tmp_path, 1, "warm"))  # builds the init checkpoint the runs load
    per_step = (_syncs(tmp_path, 4) - _syncs(tmp_path, 1)) / 3
    assert per_step <= MAX_SYNCS_PER_STEP, f"{per_step:.1f} host syncs a step"


def test_tensor_metrics_read_at_once_are_grpo_steps_floats():
    """read_metrics=False keeps grpo_step's metrics as tensors; report.read_floats
    reads them all at once into the very floats grpo_step gives by default."""
    from nanogrpo.extras.loss_terms import LossTerms, grpo_step_with_terms
    from nanogrpo.grpo import LossConfig, LossInputs
    from nanogrpo.run.report import read_floats

    g = torch.Generator().manual_seed(0)
    N, C = 4, 6
    mask = torch.rand(N, C, generator=g) > 0.3
    mask[-1] = False  # a row with no token: NaN in the per-sequence clip metrics
    inputs = LossInputs(
        logps=-torch.rand(N, C, generator=g),
        advantages=torch.tensor([1.0, -1.0, 0.5, 0.0]),
        completion_mask=mask,
        old_logps=-torch.rand(N, C, generator=g),
        entropies=torch.rand(N, C, generator=g),
    )
    sampling = -torch.rand(N, C, generator=g)
    cfg, terms = LossConfig(), LossTerms(entropy_coef=0.01, off_policy_mask_threshold=0.1)
    how = dict(sampling_logps=sampling)
    _, floats = grpo_step_with_terms(inputs, cfg, terms, **how)
    _, tensors = grpo_step_with_terms(inputs, cfg, terms, **how, read_metrics=False)
    assert all(isinstance(v, torch.Tensor) for v in tensors.values())
    read = read_floats(tensors)
    assert read.keys() == floats.keys()
    for k, v in floats.items():
        assert read[k] == v or (math.isnan(read[k]) and math.isnan(v)), k
