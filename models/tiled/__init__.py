"""Long sequences at a bounded activation peak: the causal LM loss with the head inside it, in tiles of tokens
(loss), and the decoder blocks' MLPs through DeepSpeed's TiledMLP, in shards of tokens (mlp). Neither imports
torch until it computes: the planner counts with their arithmetic (toolkit.plan.layouts.estimate)."""


def size_words(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def choose_mode(flag: str, mode: str, need: int, size: str, blocker: str | None, auto_bytes: int) -> tuple:
    """(on, why) for `flag` (--tiled-loss, --tiled-mlp) set to `mode`: `blocker` (why this run cannot) leaves it off,
    and refuses `on`; on and off as asked; auto: on from `auto_bytes` of what tiling removes (`need`, said in
    `size`)."""
    from toolkit.errors import ConfigError

    if blocker is not None:
        if mode == "on":
            raise ConfigError(f"{flag} on: {blocker}; use {flag} auto or off")
        return False, blocker
    if mode != "auto":
        return mode == "on", f"{flag} {mode}; {size}"
    on = need >= auto_bytes
    return on, f"{size}, {'at least' if on else 'below'} {auto_bytes / 2**30:g} GiB; {flag} on/off to choose"
