"""TRL's Python API: a TRL user's script runs with its import changed,
`from nanogrpo import GRPOConfig, GRPOTrainer`.

Owns: the names a script imports: `GRPOConfig` (api/config.py: TrainConfig from TRL's keywords)
and `GRPOTrainer` (api/trainer.py: TRL's signature over train.py's loop), `TrainOutput`.

Does not know about: the GRPO math, sampling, or log-probs.
"""

from nanogrpo.api.config import GRPOConfig
from nanogrpo.api.trainer import GRPOTrainer, TrainOutput

__all__ = ["GRPOConfig", "GRPOTrainer", "TrainOutput"]
