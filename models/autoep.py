"""What DeepSpeed's AutoEP (expert parallelism, module_inject/auto_ep*.py) needs of a transformers model.

AutoEP replaces each MoE block (`model.layers.N.mlp`, matched by re.fullmatch on the module's name,
auto_ep.py:429) with an AutoEPMoELayer inside deepspeed.initialize, and moves HF's router-logit recorders (the
router aux loss reads them) onto the new layer. To do that, DeepSpeed 0.19.8 reads and writes transformers'
output-capture registry as a plain dict keyed by class-name strings (auto_ep_presets/base.py:326
`registry.get(key, default)`, :364 `registry.get(key)`, :305 `registry[key] = entry`). transformers 5.24 made it a
dict subclass whose get() and []= take a MODEL and key it by str(model.__class__) (utils/output_capturing.py:39-50):
the two-argument get raises "TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given"
at deepspeed.initialize, and a one-argument get with a string would silently find nothing.

`allow_string_keys()` gives the registry object both readings: a string key is a plain dict key (what DeepSpeed
passes), anything else is transformers' model (what transformers passes). The keys are the same strings either way,
so nothing either side stores changes.
"""


def allow_string_keys() -> None:
    """Let transformers' output-capture registry take DeepSpeed's class-name keys too (idempotent; a no-op where
    the registry is a plain dict, as in the transformers releases DeepSpeed's AutoEP was written against)."""
    from transformers.utils import output_capturing

    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    if registry is None or type(registry) is dict or getattr(registry, "dstk_string_keys", False):
        return

    class StringKeys(type(registry)):
        dstk_string_keys = True

        def get(self, key, default=None):
            return dict.get(self, key, default) if isinstance(key, str) else super().get(key)

        def __setitem__(self, key, value):
            if isinstance(key, str):
                dict.__setitem__(self, key, value)
            else:
                super().__setitem__(key, value)

    registry.__class__ = StringKeys
