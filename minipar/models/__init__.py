"""Models small enough to train in seconds on two CPU cores."""
from .gpt import GPT, Block, GPTConfig, lm_loss
from .lstm import LSTMLM
from .mlp import MLP
from .sizes import gpt_config

__all__ = ["GPT", "GPTConfig", "Block", "lm_loss", "MLP", "LSTMLM", "gpt_config"]
