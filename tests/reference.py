"""Reference computations tests compare dstk's own numbers with, done directly with the HF model."""


def eval_reference(model, held, rows_per_batch: int = 32) -> float:
    """The token-weighted mean loss of `model` over every row of the eval split `held` (data.Rows), computed
    directly: summed cross entropy of every target / the number of targets (rows in batches: each row has
    its own attention mask and positions, so a batch computes what its rows compute alone)."""
    import torch
    import torch.nn.functional as F

    from models.spec import attention_inputs

    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(held), rows_per_batch):
            (ids, docs), labels = held.batch(range(start, min(start + rows_per_batch, len(held))))
            if labels.dim() == 1:  # a classifier: one target per row
                logits = model(input_ids=ids, attention_mask=docs).logits
                total, count = total + float(F.cross_entropy(logits.double(), labels, reduction="sum")), count + len(labels)
                continue
            mask, positions = attention_inputs(docs)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
            target = labels[:, 1:].reshape(-1)
            total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).double(), target,
                                           ignore_index=-100, reduction="sum"))
            count += int((target != -100).sum())
    return total / count
