"""An EAGLE-3 drafter (Li et al., 2025): its shape and layouts (`config`), the model and its training-time test
(`model`), and drafting with it (`drafting`)."""

from blockdecode.drafters.eagle3.config import LAYOUTS, Eagle3Config, check_eagle3, config_for, default_aux_layers
from blockdecode.drafters.eagle3.drafting import MIN_PROB, Eagle3Drafter
from blockdecode.drafters.eagle3.model import Eagle3, ttt_loss

__all__ = [
    "LAYOUTS",
    "MIN_PROB",
    "Eagle3",
    "Eagle3Config",
    "Eagle3Drafter",
    "check_eagle3",
    "config_for",
    "default_aux_layers",
    "ttt_loss",
]
