"""dstk: DeepSpeed configs, pipeline wrappers and plans that agree with each other.

Importing this package is cheap: nothing here imports torch, deepspeed or transformers.
"""

__version__ = "0.1.0"
