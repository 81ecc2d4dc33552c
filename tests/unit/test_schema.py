"""The shipped JSON Schema: valid draft 2020-12, documented, and its look-ups (fast to load without
torch: tests/commands/test_start_up.py)."""

import json

import pytest
from click.testing import CliRunner
from jsonschema import Draft202012Validator

from toolkit.config import schema as S


def _walk(node, path):
    """Yield (dotted path, property schema) for every property, through $defs, anyOf and if/then."""
    for key, sub in node.get("properties", {}).items():
        yield f"{path}.{key}", sub
        yield from _walk(sub, f"{path}.{key}")
    for i, branch in enumerate(node.get("anyOf", [])):
        yield from _walk(branch, f"{path}|{i}")
    for items in [node["items"]] if isinstance(node.get("items"), dict) else []:
        yield from _walk(items, f"{path}[]")


def _all_properties():
    schema = S.load_schema()
    yield from _walk(schema, "$")
    for name, sub in schema["$defs"].items():
        yield from _walk(sub, f"$defs.{name}")


def test_schema_is_valid_draft_2020_12():
    schema = S.load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)


def test_every_property_has_a_description_and_a_type():
    props = list(_all_properties())
    assert len(props) > 250  # every section DeepSpeed 0.19 reads, not a sample
    for path, prop in props:
        assert prop.get("description", "").strip(), f"{path} has no description"
        branches = [S.resolve(b) for b in prop.get("anyOf", [])]
        types = [prop.get("type")] + [b.get("type") for b in branches if "const" not in b]
        assert any(types), f"{path} has no type"


def test_fixed_key_sets_are_closed():
    """Typos must be caught at the top level and in the sections DeepSpeed reads as plain dicts."""
    schema = S.load_schema()
    assert schema["additionalProperties"] is False
    for key in ("zero_optimization", "fp16", "bf16", "activation_checkpointing", "pipeline", "checkpoint",
                "flops_profiler", "aio", "data_types", "optimizer", "scheduler", "tensorboard", "comms_logger"):
        assert S.node_at(key)["additionalProperties"] is False, key
    for name in ("adam_params", "lamb_params", "WarmupLR_params", "WarmupCosineLR_params", "OneCycle_params"):
        assert schema["$defs"][name]["additionalProperties"] is False, name


def test_auto_is_allowed_only_where_hf_fills_it():
    def allows_auto(dotted):
        return {"$ref": "#/$defs/auto"} in S.node_at(dotted).get("anyOf", [])

    for dotted in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "gradient_clipping", "fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size",
                   "zero_optimization.stage3_prefetch_bucket_size", "optimizer.params.lr",
                   "optimizer.params.betas", "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps"):
        assert allows_auto(dotted), dotted
    for dotted in ("steps_per_print", "zero_optimization.overlap_comm", "pipeline.stages"):
        assert not allows_auto(dotted), dotted


def test_lookups_by_dotted_key():
    assert "stage" in S.describe("zero_optimization.stage").lower()
    assert S.default("gradient_clipping") == 1.0
    assert S.default("zero_optimization.reduce_bucket_size") == 500_000_000
    assert S.enum("zero_optimization.offload_param.device") == ["none", "cpu", "nvme"]
    assert S.enum("zero_optimization.stage") == [0, 1, 2, 3]
    assert S.default("optimizer.params.lr") == 1e-3  # params of the per-type if/then branches
    assert {"stages", "partition_method", "parts", "activation_checkpoint_interval"} <= set(S.keys_at("pipeline"))
    assert S.homes("stage") == ["zero_optimization"]
    with pytest.raises(KeyError, match='did you mean "stage"'):
        S.describe("zero_optimization.stag")


@pytest.mark.parametrize("typo, known", [("zero_optimisation", "zero_optimization"),
                                         ("Zero-Optimization", "zero_optimization"),
                                         ("gradient_acumulation_steps", "gradient_accumulation_steps"),
                                         ("train_micro_batch_size_per_gpus", "train_micro_batch_size_per_gpu")])
def test_suggest_finds_the_key_meant(typo, known):
    assert S.suggest(typo, S.keys_at("")) == known


def test_suggest_stays_quiet_for_unrelated_words():
    assert S.suggest("banana", S.keys_at("")) is None


def test_schema_command_prints_and_writes_the_schema(tmp_path):
    from toolkit.cli import cli

    result = CliRunner().invoke(cli, ["schema"])
    assert result.exit_code == 0
    assert json.loads(result.output) == S.load_schema()
    target = tmp_path / "ds.schema.json"
    result = CliRunner().invoke(cli, ["schema", "-o", str(target)])
    assert result.exit_code == 0
    assert json.loads(target.read_text()) == S.load_schema()
