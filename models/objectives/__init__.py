"""Training objectives other than the causal LM's own loss, on a model's logits: at pp 1 after the HF model's
forward, in a pipeline as the last stage's loss_fn.

    dpo.py   Direct Preference Optimization (Rafailov et al. 2023) as TRL's DPOTrainer computes it: per-sequence
             log-probs of chosen/rejected rows, the pair losses (sigmoid; one function per variant), TRL's metrics
"""

from models.objectives.dpo import LOSSES, METRICS, DpoLoss, PairStats, disable_dropout, pair_losses, sequence_logps

__all__ = ["LOSSES", "METRICS", "DpoLoss", "PairStats", "disable_dropout", "pair_losses", "sequence_logps"]
