"""Speed tricks: each computes what a course function computes, faster.

Owns: `kernels`, the fast set of the functions a round calls (the fields of trainer.Kernels,
as a dict): the draw without sorting the vocabulary and the compiled static-shape decode step
(fast/sampling.py), the decode step that reads each prompt's keys once per group
(fast/shared_prefix.py), the LM head in chunks, each prompt's forward shared by its rows and no
backward for rows without advantage (fast/logprobs.py); with padding_free, each micro-batch
packed into one row (fast/packing.py). train.py chooses between them and the course's in one place
(its `kernels`); `plain=True` trains with the course's (packed with padding_free). Beside them,
fast/batch_invariant.py: not faster but exact, the sampler's log-probs the trainer's bit for bit.

Does not know about: rewards, losses, optimizers, files, or what a run does around the
algorithm, or the trainer (train.py builds its `Kernels` record from what `kernels` returns).

Each trick is held equal to its course function by a test (tests/test_sampler.py,
tests/test_logprobs.py, tests/test_packing.py), and the two paths' training trajectories by
tests/test_train.py.
"""

from nanogrpo.fast import logprobs, packing  # noqa: F401 (packing: train.py's fast.packing)
from nanogrpo.fast.batch_invariant import kernels as invariant_kernels
from nanogrpo.fast.sampling import StaticDecoder, sample_next_token_fast
from nanogrpo.fast.shared_prefix import SharedPrefixDecoder


def kernels(torch_compile: bool = False, batch_invariant: bool = False) -> dict:
    """The fast functions, by trainer.Kernels' field names; with torch_compile the decode step
    is compiled (with static shapes: the prompts' keys copied to their rows) instead of reading
    each prompt's keys once per group. batch_invariant: fast/batch_invariant.py's instead
    (exact, not fast). The packed log-probs (padding_free) are fast/packing.py's
    packed_kernels."""
    if batch_invariant:
        return invariant_kernels()
    fast = dict(
        sample_token=sample_next_token_fast,
        decoder=StaticDecoder if torch_compile else SharedPrefixDecoder,
        token_logprobs=logprobs.token_logprobs,
        policy_logprobs=logprobs.policy_logprobs,
    )
    return fast
