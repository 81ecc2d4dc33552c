"""`dstk parity` on an empty folder or with a sequence length the model cannot take: one clean line and
an exit code, never a torch traceback; `--attention` is the flag's name, as in `plan` and `partition`."""

import pytest

from tests.invoke import invoke_dstk
from toolkit.cli import main


def run_cli(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(["parity", *map(str, args)])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.mark.parametrize("args,code,needle", [
    (["gpt2", "--seq-len", "0"], 1, "--seq-len must be >= 4, got 0: the first sequence is right-padded by 3 tokens"),
    (["gpt2", "--seq-len", "3"], 1, "--seq-len must be >= 4, got 3"),
    (["gpt2", "--seq-len", "1", "--no-pad"], 1, "--seq-len must be >= 2, got 1"),
    (["gpt2", "--seq-len", "100000"], 1, "--seq-len 100000 exceeds the max_position_embeddings of the gpt2 model "
                                         "(random weights) (1024); use --seq-len <= 1024"),  # the registry's GPT-2
    (["llama", "--seq-len", "100000"], 1, "--seq-len 100000 exceeds"),
    (["gpt2", "--attention", "sdpa", "--attn", "eager"], 2, "--attention sdpa and --attn eager disagree"),
])
def test_bad_sequence_lengths_are_refused(capsys, args, code, needle):
    got, out, err = run_cli(capsys, *args)
    assert got == code and needle in err and out == "", err


def test_an_empty_folder_is_not_a_model(capsys, tmp_path):
    code, _, err = run_cli(capsys, tmp_path)
    assert code == 2 and f"MODEL {tmp_path}: no config.json in this directory, so it is not a HF model directory" in err


def test_a_directory_without_weights_is_unusable(capsys, tmp_path):
    from toolkit.train.parity import small_model

    small_model("gpt2").config.save_pretrained(tmp_path)
    code, _, err = run_cli(capsys, tmp_path)
    assert code == 2 and "holds no weights (none of model.safetensors" in err


def test_a_directory_checks_its_own_max_positions_before_loading(capsys, tmp_path):
    from toolkit.train.parity import small_model

    small_model("gpt2").config.save_pretrained(tmp_path)  # no weights: the length is refused first
    code, _, err = run_cli(capsys, tmp_path, "--seq-len", "65")
    assert code == 1 and f"exceeds the max_position_embeddings of {tmp_path} (64)" in err


def test_help_names_attention_like_plan_and_partition():
    for command in ("parity", "plan", "partition"):
        text = invoke_dstk([command, "--help"]).stdout
        assert "--attention" in text and "--attn " not in text, command


def test_attention_flag_reaches_the_model(ds_world1, capsys):
    code, out, _ = run_cli(capsys, "gpt2", "--attention", "eager")
    assert code == 0 and "eager attention" in out and out.rstrip().endswith("OK: tolerance 1e-05")
