"""--objective dpo in the trainer: the objective built and checked, pp 1's forward, each step's metrics, and the
reference log-probs (computed once before step 1 and cached beside the prepared data, or live with LoRA at pp 1).

    objective.py  the DpoLoss a run trains with, the refusals, pp 1's forward (the LoRA reference with the adapters
                  off), TRL's metrics of a step or an evaluation gathered over the ranks
    reference.py  the reference pass over the training and eval pairs with the initial weights, and its cache
                  (imported by the run itself, not here: it needs torch, and `dstk train --check` reads this package)
"""

from toolkit.train.preference.objective import (build, check, check_prepared, forward_loss, opening_line,
                                                stage_metrics, uses_preference)


__all__ = ["build", "check", "check_prepared", "forward_loss", "opening_line", "stage_metrics", "uses_preference"]
