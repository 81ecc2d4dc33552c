"""Long sequences at a bounded activation peak: the causal LM loss with the head inside it, in tiles of tokens
(loss), and the decoder blocks' MLPs through DeepSpeed's TiledMLP, in shards of tokens (mlp). Neither imports
torch until it computes: the planner counts with their arithmetic (toolkit.plan.layouts.estimate)."""
