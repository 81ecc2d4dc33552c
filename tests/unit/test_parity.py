"""`dstk parity MODEL`: prints the differences, exit 0 within tolerance, clean errors otherwise."""

import json

import pytest

from toolkit.cli import main
from toolkit.train.parity import TOLERANCE, ParityReport


def run_cli(capsys, *args):
    """(exit code, stdout, stderr) of `dstk parity ARGS` through the real entry point."""
    with pytest.raises(SystemExit) as exit_info:
        main(["parity", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_parity_of_a_model_type_passes(ds_world1, capsys):
    code, out, _ = run_cli(capsys, "qwen2", "--json")
    report = json.loads(out[out.index("{"):])
    assert code == 0 and report["ok"] and report["task"] == "causal-lm" and report["num_layers"] == 5
    assert report["params_checked"] > 10 and report["logits_diff"] <= report["tolerance"] == TOLERANCE


def test_parity_text_report_of_a_directory(ds_world1, capsys, tmp_path):
    from toolkit.train.parity import small_model

    small_model("gpt2").save_pretrained(tmp_path)
    code, out, _ = run_cli(capsys, str(tmp_path), "--attn", "eager")
    assert code == 0 and "eager attention" in out and "grads  max abs diff" in out
    assert out.rstrip().endswith("OK: tolerance 1e-05")


@pytest.mark.parametrize("args,code,words", [
    (["nosuchmodel"], 1, "unknown model 'nosuchmodel'"),
    (["./no/such/dir"], 2, "no such directory"),
    (["mamba"], 1, "base_model_pp_plan"),
    (["llama", "--task", "masked-lm"], 1, "cannot be wrapped for task 'masked-lm'"),
])
def test_parity_bad_models_are_clean_errors(capsys, args, code, words):
    got, _, err = run_cli(capsys, *args)
    assert got == code and words in err and "Traceback" not in err


def test_report_ok_is_the_tolerance():
    base = dict(model="m", task="causal-lm", num_layers=5, loss_hf=1.0, logits_diff=0.0, grad_diff=0.0,
                grad_name="", params_checked=3, attn_implementation="eager")
    assert ParityReport(loss_diff=TOLERANCE, **base).ok
    assert not ParityReport(loss_diff=2 * TOLERANCE, **base).ok
