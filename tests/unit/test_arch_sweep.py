"""bench/arch_sweep.py: tiny configs, the outcome of a few known types, the table, a hung worker."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import arch_sweep  # noqa: E402


def test_tiny_config_shrinks_every_size():
    config = arch_sweep.tiny_config("deepseek_v3")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 128)
    assert config.n_routed_experts <= 4 and config.num_experts_per_tok <= 2 and config.first_k_dense_replace == 1
    assert config.num_key_value_heads == config.num_attention_heads  # MLA keeps one kv head per head
    gemma3 = arch_sweep.tiny_config("gemma3_text")  # one layer of each kind, sliding window cutting seq 8
    assert gemma3.layer_types == ["sliding_attention", "full_attention"] and gemma3.sliding_window == 4


def test_known_types_are_classified(ds_world1):
    rows = {t: arch_sweep.sweep_one(t) for t in ("llama", "gpt2", "mamba")}
    assert rows["llama"]["outcome"] == "exact" and max(rows["llama"]["diffs"].values()) <= 1e-5
    assert rows["gpt2"]["outcome"] == "exact"
    assert rows["mamba"]["outcome"] == "refused" and "base_model_pp_plan" in rows["mamba"]["reason"]


def test_unbuildable_config_is_the_sweeps_fault(ds_world1, monkeypatch):
    monkeypatch.setitem(arch_sweep.PER_TYPE, "llama", {"num_attention_heads": 5})  # 64 % 5 != 0
    row = arch_sweep.sweep_one("llama")
    assert row["outcome"] == "config" and "not a multiple" in row["reason"]  # the config's own check, quoted


def test_table_counts_and_order(tmp_path):
    rows = [{"type": "zeta", "outcome": "exact", "reason": "", "seconds": 1.0},
            {"type": "alpha", "outcome": "refused", "reason": "no plan | here", "seconds": 0.1},
            {"type": "beta", "outcome": "crash", "reason": "KeyError: 'x'", "seconds": 0.2}]
    json_path, md_path = arch_sweep.write_results(rows, tmp_path, "cmd", merge=False)
    text = md_path.read_text()
    assert "3 causal LM types: 1 exact, 1 refused, 0 config, 0 mismatch, 1 crash" in text
    assert text.index("| beta | crash") < text.index("| alpha | refused") < text.index("| zeta | exact")
    assert "no plan \\| here" in text and "transformers " in text
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
