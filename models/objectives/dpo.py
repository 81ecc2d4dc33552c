"""DPO on a micro-batch of pairs: rows 2i (chosen) and 2i + 1 (rejected) (toolkit.data.pairs), labels -100 on each
row's prompt and padding, and the reference model's log-probs of each row beside them.

    logp(row)  = sum over the completion tokens t of log p(labels[t + 1] | tokens <= t)   (TRL's default: a sum)
    delta      = (logp(chosen) - ref(chosen)) - (logp(rejected) - ref(rejected))
    loss       = mean over the pairs of LOSSES[name](delta, beta)      (sigmoid: -log sigmoid(beta delta))

A micro-batch's loss is the mean over its pairs; every training micro-batch holds mbs / 2 pairs, so the mean of the
micro-batch means over gas and dp (what DeepSpeed's accumulation and all-reduce take) is the mean over the step's
pairs, as one big batch. TRL's metrics (rewards = beta x the log-ratio) are summed per pair in PairStats, on the
device, and read once a step.
"""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def sigmoid(delta: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO's loss (TRL loss_type "sigmoid", label_smoothing 0): -log sigmoid(beta delta), per pair."""
    return -F.logsigmoid(beta * delta)


# --dpo-loss NAME -> its per-pair loss of (delta (P,), beta). IPO, hinge and robust are one function each here
# (TRL's DPOTrainer._compute_loss has them), with their choice in toolkit.cli.train's --dpo-loss.
LOSSES = {"sigmoid": sigmoid}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) fp32: each row's summed log-prob of its labelled tokens. logits (B, T, V) in any dtype (log-softmax in
    fp32, as cross_entropy computes it on upcast logits), labels (B, T) with -100 where nothing is scored."""
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]  # (B, T): position t scores token t + 1
    logits = logits.float()  # a no-op in fp32; shifting the labels, not the logits, copies no (B, T, V) slice
    per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), shifted.reshape(-1).to(logits.device),
                                ignore_index=IGNORE_INDEX, reduction="none")  # (B T,): 0 where ignored
    return -per_token.view(shifted.shape).sum(dim=1)


def pair_losses(logps: torch.Tensor, ref: torch.Tensor, beta: float, name: str = "sigmoid") -> tuple:
    """(per-pair loss (P,), chosen rewards (P,), rejected rewards (P,)) of rows' log-probs (2P,) and the reference's."""
    chosen, rejected = logps[0::2] - ref[0::2].to(logps), logps[1::2] - ref[1::2].to(logps)
    return LOSSES[name](chosen - rejected, beta), beta * chosen.detach(), beta * rejected.detach()


def disable_dropout(model) -> None:
    """Dropout off in every module (TRL's DPOConfig.disable_dropout, its default): the policy's log-probs at the first
    step are then the reference's, and the loss ln 2."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


class PairStats:
    """Sums over pairs of TRL's metrics (METRICS, then the pair count), kept where the loss is computed; `take`
    returns them (a (7,) fp64 tensor on `device`, zeros where nothing was added) and starts again."""

    def __init__(self):
        self.sums = None

    def add(self, chosen_r, rejected_r, logps, weights) -> None:
        with torch.no_grad():
            w = weights.double()
            values = torch.stack([chosen_r.double(), rejected_r.double(), (chosen_r > rejected_r).double(),
                                  (chosen_r - rejected_r).double(), logps[0::2].detach().double(),
                                  logps[1::2].detach().double()])  # (6, P)
            sums = torch.cat([(values * w).sum(dim=1), w.sum().view(1)])
            self.sums = sums if self.sums is None else self.sums + sums

    def take(self, device) -> torch.Tensor:
        sums = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=device) if self.sums is None else \
            self.sums.to(device)
        self.sums = None
        return sums


class DpoLoss:
    """The DPO loss of a micro-batch: `(logits (B, T, V), (labels (B, T), ref (B,)))` -> its mean over the pairs that
    carry a target (an eval micro-batch's filler pairs carry none); the pipeline's loss_fn(outputs, labels), and pp 1's
    after the forward. With `collect` a list, it only appends each row's log-probs there (the reference pass) and
    returns a zero that keeps the graph (a pipeline's stages send gradients back only in training)."""

    def __init__(self, beta: float = 0.1, name: str = "sigmoid"):
        if name not in LOSSES:
            raise ValueError(f"--dpo-loss {name}: built are {sorted(LOSSES)}")
        self.beta, self.name, self.stats, self.collect = beta, name, PairStats(), None
        self.live_reference = False  # pp 1 with LoRA: the reference computed with the adapters off, each micro-batch

    def __call__(self, logits, labels) -> torch.Tensor:
        labels, ref = labels
        logits = logits[0] if isinstance(logits, tuple) else logits
        logps = sequence_logps(logits, labels)
        if self.collect is not None:
            self.collect.append(logps.detach())
            return logps.sum() * 0
        return self.loss(logps, ref, labels)

    def loss(self, logps: torch.Tensor, ref: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        weights = (labels[0::2, 1:] != IGNORE_INDEX).any(dim=1).to(logps.dtype)  # (P,) 0 for a filler pair
        losses, chosen_r, rejected_r = pair_losses(logps, ref, self.beta, self.name)
        self.stats.add(chosen_r, rejected_r, logps, weights)
        return (losses * weights).sum() / weights.sum().clamp(min=1)
