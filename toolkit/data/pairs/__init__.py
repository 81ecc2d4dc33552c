"""Preference pairs (TRL's format: prompt, chosen, rejected) for --objective dpo: each pair two adjacent rows.

    encode.py   a batch of pair rows -> 2 token rows each (chosen, then rejected), labels -100 on the prompt;
                the refusals (a field missing, chosen == rejected, a prompt that leaves no completion token)
    check.py    every row of a file checked (dstk train --check)
    rows.py     Pairs: the prepared rows read a pair at a time, with the reference log-probs beside them
"""

from toolkit.data.pairs.encode import PAIR_FIELDS, encode_pairs, is_preference
from toolkit.data.pairs.rows import Pairs, pair_rows, pair_weight

__all__ = ["PAIR_FIELDS", "encode_pairs", "is_preference", "Pairs", "pair_rows", "pair_weight"]
