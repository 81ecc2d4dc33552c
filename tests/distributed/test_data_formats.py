"""Every input kind and row format trains on 2 CPU ranks (gloo, forked by tests/ranks.py)
and the loss falls; the eval loss a run reports is the token-weighted mean over
the whole eval split, recomputed here from the exported HF model.

One launch per case: text from .parquet at pp 2 (packed rows through the
pipeline), chat .jsonl at dp 2, alpaca .csv, sharegpt from a save_to_disk folder at pp 2, and
prompt/completion from .arrow with --eval-data.
"""

import json
from pathlib import Path

import pytest

from tests.configs import run_config, write_config
from tests.distributed.launch import launch
from tests.distributed.test_train import losses, summary

pytestmark = pytest.mark.distributed

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
COLORS = ["red", "green", "blue", "black", "white", "yellow", "brown", "grey"]
THINGS = ["apple", "sky", "leaf", "night", "snow", "sun", "bear", "stone"]


def qa(n: int) -> list:
    """n (question, answer) pairs a tiny model learns fast: the answer repeats a word of the question."""
    return [(f"What color is the {THINGS[i % 8]} number {i}?", f"The {THINGS[i % 8]} is {COLORS[(i * 3) % 8]}.")
            for i in range(n)]


def write_case(kind: str, tmp: Path) -> Path:
    import datasets

    pairs = qa(48)
    if kind == "text":
        path = tmp / "text.parquet"
        datasets.Dataset.from_dict({"text": [f"{q} {a}" for q, a in pairs]}).to_parquet(str(path))
    elif kind == "chat":
        path = tmp / "chat.jsonl"
        path.write_text("\n".join(json.dumps({"messages": [{"role": "system", "content": "Answer."},
                                                           {"role": "user", "content": q},
                                                           {"role": "assistant", "content": a}]}) for q, a in pairs))
    elif kind == "alpaca":
        path = tmp / "alpaca.csv"
        datasets.Dataset.from_dict({"instruction": [q for q, _ in pairs], "input": [""] * 48,
                                    "output": [a for _, a in pairs]}).to_csv(str(path), index=False)
    elif kind == "sharegpt":
        path = tmp / "sharegpt_saved"
        datasets.Dataset.from_list([{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
                                    for q, a in pairs]).save_to_disk(str(path))
    else:  # prompt-completion, from an Arrow file
        saved = tmp / "pc_saved"
        datasets.Dataset.from_dict({"prompt": [q for q, _ in pairs],
                                    "completion": [" " + a for _, a in pairs]}).save_to_disk(str(saved))
        path = next(saved.glob("*.arrow"))
    return path


CASES = {  # kind: (procs, mbs, gas, pp, extra args)
    "text": (2, 2, 4, 2, ["--seq-len", "128"]),
    "chat": (2, 2, 2, 1, ["--seq-len", "160"]),
    "alpaca": (2, 2, 2, 1, ["--seq-len", "256", "--packing"]),
    "sharegpt": (2, 2, 4, 2, ["--seq-len", "128"]),
    "prompt-completion": (2, 2, 2, 1, ["--seq-len", "64", "--eval-data", "EVAL"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("formats")
    template = tmp / "chatml.jinja"
    template.write_text(CHATML)
    done = {}
    for kind, (procs, mbs, gas, pp, extra) in CASES.items():
        path = write_case(kind, tmp)
        extra = [str(path) if a == "EVAL" else a for a in extra]  # prompt-completion evaluates on its own file
        args = ["--model", "tiny-gpt2", "--data", str(path), "--no-progress", "--chat-template", str(template),
                "--data-cache", str(tmp / "cache"), "--eval-fraction", "0.125", *extra]
        rc, log = launch(write_config(tmp / f"{kind}.json", run_config(mbs, gas, pp, lr=3e-3)), tmp / f"run_{kind}", procs, "--steps", 12,
                         *(["--no-export"] if kind in ("alpaca",) else []), model_args=args)
        assert rc == 0, f"{kind}:\n{log[-6000:]}"
        done[kind] = (tmp / f"run_{kind}", args, log)
    return done


@pytest.mark.parametrize("kind", list(CASES))
def test_each_format_trains_through_the_launcher_and_the_loss_falls(runs, kind):
    out, _, log = runs[kind]
    got = losses(out)
    assert got[12] < got[1] - 0.3, (kind, got)
    assert f"format {kind}" in log and "inferred from the column" in log, log[-2000:]  # the log says what it read
    info = summary(out)["data"]
    assert info["format"] == kind and info["train_rows"] > 0 and info["eval_rows"] > 0


def _options(args: list):
    """The DataOptions a run's flags make (what toolkit.train.job.data_options builds from TrainArgs)."""
    from toolkit import data

    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    return data.DataOptions(path=flag["--data"], seq_len=int(flag["--seq-len"]), eval_fraction=0.125,
                            eval_data=flag.get("--eval-data"), packing=True if "--packing" in args else None,
                            cache_dir=flag["--data-cache"], seed=1234)


@pytest.mark.parametrize("kind", ["text", "chat", "sharegpt", "prompt-completion"])
def test_reported_eval_loss_is_the_token_weighted_mean_over_the_whole_eval_split(runs, kind):
    """pp 1 and pp 2 runs: the exported model, on the eval rows prepared again from the cache, summed
    cross entropy over every target token / their count == the run's eval_loss."""
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.reference import eval_reference
    from toolkit import data

    out, args, _ = runs[kind]
    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    tok = AutoTokenizer.from_pretrained(out / "hf")  # saved with the run's chat template
    held = data.prepare(_options(args), tok).eval
    loss = eval_reference(model, held)
    reported = summary(out)
    assert abs(loss - reported["eval_loss"]) < 1e-4 * loss, (loss, reported)
    assert abs(reported["eval_ppl"] - math.exp(reported["eval_loss"])) < 1e-6 * reported["eval_ppl"]
