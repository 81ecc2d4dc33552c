"""bench/arch_sweep.py: tiny configs, the outcome of a few known types (in memory and from a saved
checkpoint), the table, a hung worker, and (slow tier) the whole sweep against the committed table."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import arch_sweep  # noqa: E402

TABLE = Path(arch_sweep.RESULTS) / "arch_sweep.json"


def test_tiny_config_shrinks_every_size():
    config = arch_sweep.tiny_config("deepseek_v3")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 128)
    assert config.n_routed_experts <= 4 and config.num_experts_per_tok <= 2 and config.first_k_dense_replace == 1
    assert config.num_key_value_heads == config.num_attention_heads  # MLA keeps one kv head per head
    gemma3 = arch_sweep.tiny_config("gemma3_text")  # one layer of each kind, sliding window cutting seq 8
    assert gemma3.layer_types == ["sliding_attention", "full_attention"] and gemma3.sliding_window == 4


def test_tiny_config_keeps_per_layer_overrides_and_sub_configs_consistent():
    gemma4 = arch_sweep.tiny_config("gemma4_text")  # per_layer_config {"05": {"head_dim": 512}, ...} (zero-padded)
    assert gemma4.layer_types == ["sliding_attention", "full_attention"]
    per_layer = {int(k): v for k, v in gemma4.to_dict()["per_layer_config"].items()}
    assert per_layer == {1: {"head_dim": 32}}  # still twice the others' 16
    dbrx = arch_sweep.tiny_config("dbrx")  # PER_TYPE updates the shrunk attn_config, not replaces it
    assert (dbrx.attn_config.clip_qkv, dbrx.attn_config.kv_n_heads, dbrx.ffn_config.moe_num_experts) == (8.0, 2, 4)
    from arch_sweep_config import causal_lm_class

    cls, config = causal_lm_class(arch_sweep.tiny_config("musicgen"))  # the CausalLM takes the decoder's config
    assert cls.__name__ == "MusicgenForCausalLM" and config.model_type == "musicgen_decoder"


def test_known_types_are_classified(ds_world1):
    rows = {t: arch_sweep.sweep_one(t) for t in ("llama", "gpt2", "mamba")}
    assert rows["llama"]["outcome"] == "exact" and max(rows["llama"]["diffs"].values()) <= 1e-5
    assert rows["gpt2"]["outcome"] == "exact"
    assert rows["mamba"]["outcome"] == "refused" and "base_model_pp_plan" in rows["mamba"]["reason"]
    assert [rows[t]["dir"] for t in ("llama", "gpt2", "mamba")] == ["exact", "exact", "refused"]  # from save_pretrained
    assert rows["mamba"]["dir_reason"] == rows["mamba"]["reason"] and not any(r.get("moe") for r in rows.values())


def test_a_moe_checkpoint_loads_per_stage_exactly_and_a_wrong_expert_order_shows(ds_world1, monkeypatch):
    """mixtral saved by save_pretrained (block_sparse_moe.experts.{e}.w1/w2/w3 on disk): stages built from the
    directory hold from_pretrained's fused experts and match it at pp 1 and pp 2. A loader that put the experts
    in another order (the fused tensors flipped) is caught: a mismatch naming the tensors."""
    from models.weights.conversion import DiskNames

    row = arch_sweep.sweep_one("mixtral")
    assert (row["outcome"], row["moe"], row["dir"], row["aux"]) == ("exact", True, "exact", "exact"), row
    convert = DiskNames._convert  # the real one, wrapped

    def flipped(self, group, get_tensor):
        return {n: t.flip(0) if ".experts." in n else t for n, t in convert(self, group, get_tensor).items()}

    monkeypatch.setattr(DiskNames, "_convert", flipped)
    row = arch_sweep.sweep_one("mixtral")
    assert row["outcome"] == "exact" and row["dir"] == "mismatch", row  # the model in memory never reads files
    assert "differ from from_pretrained's: model.layers.0.mlp.experts.down_proj" in row["dir_reason"], row


def test_unbuildable_config_is_the_sweeps_fault(ds_world1, monkeypatch):
    monkeypatch.setitem(arch_sweep.PER_TYPE, "llama", {"num_attention_heads": 5})  # 64 % 5 != 0
    row = arch_sweep.sweep_one("llama")
    assert row["outcome"] == "config" and "not a multiple" in row["reason"]  # the config's own check, quoted


def test_table_counts_and_order(tmp_path):
    rows = [{"type": "zeta", "outcome": "exact", "reason": "", "seconds": 1.0, "dir": "exact", "dir_reason": "",
             "moe": True},
            {"type": "alpha", "outcome": "refused", "reason": "no plan | here", "seconds": 0.1, "dir": "refused",
             "dir_reason": "no plan | here", "moe": True},
            {"type": "beta", "outcome": "crash", "reason": "KeyError: 'x'", "seconds": 0.2, "dir": "mismatch",
             "dir_reason": "pp 2: loss diff 0.1"}]
    json_path, md_path = arch_sweep.write_results(rows, tmp_path, "cmd", merge=False)
    text = md_path.read_text()
    assert "3 causal LM types: 1 exact, 1 refused, 0 config, 0 mismatch, 1 crash" in text
    assert "from dir: 1 exact, 1 refused, 1 mismatch" in text and "2 MoE types from their saved checkpoints: " \
        "1 exact, 1 refused" in text
    assert "| alpha | refused | no plan \\| here |" in text and "| zeta | exact |  |" in text  # the MoE table
    assert "| beta | crash |  | mismatch | KeyError: 'x'; from dir: pp 2: loss diff 0.1 |" in text
    assert "| alpha | refused |  | refused | no plan \\| here |" in text  # the same reason once
    assert text.index("| beta | crash") < text.index("| alpha | refused |  |") < text.index("| zeta | exact |  | exact")
    assert "transformers " in text and json.loads(json_path.read_text())["dir_counts"]["mismatch"] == 1
    arch_sweep.write_results([{"type": "zeta", "outcome": "crash", "reason": "r", "seconds": 1}], tmp_path,
                             "cmd", merge=True)  # a re-run of one type updates its row only
    assert "2 crash" in md_path.read_text() and json_path.exists()


def test_a_hung_type_is_a_crash_and_the_sweep_goes_on():
    rows = arch_sweep.run_sweep(["llama", "gpt2"], timeout=0.01)  # the worker is still importing: no result
    assert [r["outcome"] for r in rows] == ["crash", "crash"] and "Timeout" in rows[0]["reason"]


@pytest.mark.parametrize("model_type, words", [("hrm_text", "has no .layers list"),
                                               ("beam", "has no rotary parameters"),
                                               ("gemma3n_text", "hidden_size_per_layer_input")])
def test_what_used_to_crash_is_refused_with_the_reason(ds_world1, model_type, words):
    row = arch_sweep.sweep_one(model_type)
    assert row["outcome"] == "refused" and words in row["reason"], row


@pytest.mark.heavy
def test_the_whole_sweep_has_no_failure_and_matches_the_committed_table_and_readme():
    """Every causal LM type (~2 min on 2 cores, as `bench/arch_sweep.py`): no crash or mismatch, in memory
    (MoE types also with their router aux loss) or from its saved checkpoint; every MoE type exact from its
    checkpoint or refused; bench/results/arch_sweep.json holds today's outcome of every type."""
    rows = {r["type"]: r for r in arch_sweep.run_sweep(sorted(arch_sweep.causal_lm_types()), timeout=120)}
    broken = {t: f"{r['outcome']}/{r.get('dir')}: {arch_sweep.full_reason(r)}" for t, r in rows.items()
              if r["outcome"] in ("crash", "mismatch") or r.get("dir") in ("crash", "mismatch")}
    assert not broken, "crash/mismatch:\n" + "\n".join(f"  {t}: {why}" for t, why in sorted(broken.items()))
    moe = {t: r["dir"] for t, r in rows.items() if r.get("moe") and r["dir"] not in ("exact", "refused")}
    assert not moe, f"MoE types neither exact from their saved checkpoint nor refused: {moe}"
    committed = {r["type"]: (r["outcome"], r.get("aux"), r.get("dir"), r.get("moe"))
                 for r in json.loads(TABLE.read_text())["rows"]}
    fresh = {t: (r["outcome"], r.get("aux"), r.get("dir"), r.get("moe")) for t, r in rows.items()}
    stale = {t: f"{committed.get(t)} -> {fresh.get(t)}" for t in sorted(committed.keys() | fresh.keys())
             if committed.get(t) != fresh.get(t)}
    assert not stale, f"{TABLE.name} is stale; re-run `.venv/bin/python bench/arch_sweep.py`: {stale}"


def test_models_page_lists_what_the_committed_sweep_measured():
    import arch_table

    page = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    section = arch_table.section(json.loads(TABLE.read_text()))
    assert section in page, "docs/models.md's architecture section is stale: run `.venv/bin/python bench/arch_table.py`"
    assert "| other |" not in section  # every refusal falls under a named kind
