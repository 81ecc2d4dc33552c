"""bench/gpu_finetune.py (with gpu_inputs.py and gpu_report.py) and bench/gpu.sh: their arithmetic, cases and
reporting without processes; gpu.sh's refusals and step bookkeeping on this machine (a stand-in python where
CUDA would be needed); and one dry run on CPU that launches the trainer (`toolkit.train` through launch.sh)
for every case two CPU processes allow."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_finetune  # noqa: E402
import gpu_inputs  # noqa: E402
import gpu_report  # noqa: E402

NAMES = [c.name for c in gpu_finetune.CASES]


def test_the_1b_model_is_saved_as_dstk_train_builds_it():
    """The config saved for every case is llama-3.2-1b's with the byte tokenizer's 257 rows: N is llama-3.2-1b
    less 128,256 - 257 of its (tied) embedding rows, still ~1B; its tokenizer has a chat template."""
    from toolkit.plan.arch import arch_from_config, load_arch

    config, tokenizer = gpu_inputs.config_and_tokenizer("llama-3.2-1b")
    n = gpu_finetune.matmul_params(arch_from_config(config.to_dict(), "saved"))
    assert n == load_arch("llama-3.2-1b").num_params() - (128_256 - 257) * 2048
    assert 0.9e9 < n < 1.1e9 and len(tokenizer) == config.vocab_size == 257 and tokenizer.chat_template


def test_save_model_writes_a_bf16_directory_dstk_train_loads(tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoTokenizer

    path = gpu_inputs.save_model("tiny-llama", tmp_path)
    with safe_open(path / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert AutoTokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) \
        == "<|im_start|>user\nhi<|im_end|>\n"


def test_chat_rows_come_from_the_corpus_and_hold_the_tokens_asked_for(tmp_path):
    rows = [json.loads(line) for line in gpu_inputs.chat_file(500_000, tmp_path).read_text().splitlines()]
    assert len(rows) > 700 and all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    assert rows[0]["messages"][0]["content"].startswith("Tell me the story that begins: Once a")
    rendered = sum(len(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n") for r in rows for m in r["messages"])
    assert rendered > 1.1 * 500_000  # ChatML, in bytes: the byte tokenizer's tokens
    assert len(gpu_inputs.chat_file(10, tmp_path).read_text().splitlines()) == 700  # each story at least once


@pytest.mark.parametrize("fused,cpu", [(False, False), (True, False), (False, True)])
def test_each_case_gets_generate_configs_layout(fused, cpu):
    for case in gpu_finetune.CASES:
        cfg = gpu_finetune.ds_config(case, fused, cpu)
        assert cfg["pipeline"]["stages"] == case.pp and cfg["zero_optimization"]["stage"] == case.zero
        assert cfg["train_batch_size"] == case.gbs == 8 * case.dp  # 8 sequences per replica per step
        assert cfg["bf16"] == {"enabled": True}
        params = cfg["optimizer"]["params"]
        assert params.get("torch_adam") is (None if fused else True)  # FusedAdam (JIT-built) only when asked
        assert params.get("fused") is (None if fused or cpu else True)


def test_cases_that_cannot_run_are_skipped_with_the_reason(monkeypatch):
    real = gpu_finetune.importlib.util.find_spec
    monkeypatch.setattr(gpu_finetune.importlib.util, "find_spec",
                        lambda name: None if name in ("flash_attn", "bitsandbytes") else real(name))
    one = dict((c.name, why) for c, why in gpu_finetune.plan_cases(NAMES, 1, dry_run=False))
    assert [name for name, why in one.items() if why is None] == ["pp1-zero1", "pp1-ep1", "pp1-zero1-hf", "pp1-lora",
                                                                   "pp1-chat", "pp1-zero3"]
    assert one["pp2"].startswith("needs 2 GPUs, 1 available") and "NCCL refuses two ranks on one GPU" in one["pp2"]
    assert one["pp2-dp2"].startswith("needs 4 GPUs, 1 available")
    assert "flash-attn package, which is not installed" in one["pp1-fa2"] and "bitsandbytes" in one["pp1-qlora"]
    monkeypatch.setattr(gpu_finetune.importlib.util, "find_spec", lambda name: object())  # both installed
    four = {c.name: why for c, why in gpu_finetune.plan_cases(NAMES, 4, dry_run=False)}
    assert all(why is None for why in four.values())
    dry = dict((c.name, why) for c, why in gpu_finetune.plan_cases(NAMES, 2, True))
    assert "bitsandbytes" in dry["pp1-qlora"] and "flash-attn" in dry["pp1-fa2"]  # CUDA only: never in a dry run
    assert dry["pp1-zero1-hf"] is None  # HF Trainer runs on CPU processes too
    monkeypatch.setattr(gpu_finetune.importlib.util, "find_spec", lambda name: None if name == "accelerate" else object())
    hf = dict((c.name, why) for c, why in gpu_finetune.plan_cases(["pp1-zero1-hf"], 1, dry_run=False))
    assert hf["pp1-zero1-hf"] == "HF Trainer needs the accelerate package, which is not installed (pip install accelerate)"


def test_the_case_runs_the_trainer_through_launch_sh_on_the_saved_model():
    opts = gpu_finetune.parse_args([])
    cases = {c.name: c for c in gpu_finetune.CASES}
    cmd = gpu_finetune.launch_command(cases["pp2-dp2"], Path("c.json"), Path("d.txt"), Path("m"), Path("out"), opts)
    assert cmd[:4] == ["bash", str(ROOT / "launch.sh"), "--num-gpus", "4"]
    args = " ".join(cmd[cmd.index("--") + 1:])
    assert "--model m " in args and "--seq-len 2048" in args and "--steps 33" in args
    for flag in ("--attention sdpa", "--no-export", "--eval-fraction 0", "--out out"):
        assert flag in args
    assert "--lora" not in args and "--packing" not in args
    lora = gpu_finetune.launch_command(cases["pp2-lora"], Path("c.json"), Path("d.txt"), Path("m"), Path("out"), opts)
    assert lora[-3:] == ["--lora", "--lora-r", "16"]
    fa2 = gpu_finetune.launch_command(cases["pp1-fa2"], Path("c.json"), Path("d.txt"), Path("m"), Path("out"), opts)
    assert "--attention flash_attention_2" in " ".join(fa2)
    chat = gpu_finetune.launch_command(cases["pp1-chat"], Path("c.json"), Path("chat.jsonl"), Path("m"), Path("o"), opts)
    assert chat[-1] == "--packing" and "--data chat.jsonl" in " ".join(chat)


def test_the_hf_case_runs_hf_trainer_on_the_same_config_model_data_and_steps():
    """DeepSpeed's launcher (launch.sh's, without dstk's program) on bench/hf_trainer.py, with every input the
    dstk case of its layout gets."""
    opts = gpu_finetune.parse_args([])
    cases = {c.name: c for c in gpu_finetune.CASES}
    ours, hf = cases["pp1-zero1"], cases["pp1-zero1-hf"]
    assert {k: v for k, v in vars(ours).items() if k not in ("name", "trainer")} == \
        {k: v for k, v in vars(hf).items() if k not in ("name", "trainer")}
    assert gpu_finetune.ds_config(ours, False, False) == gpu_finetune.ds_config(hf, False, False)
    cmd = gpu_finetune.launch_command(hf, Path("c.json"), Path("d.txt"), Path("m"), Path("out"), opts)
    assert cmd[:5] == [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1"]
    assert cmd[cmd.index("--log_level") + 2] == str(ROOT / "bench" / "hf_trainer.py")
    args = " ".join(cmd[cmd.index("--log_level") + 3:])
    assert args == "--config c.json --model m --data d.txt --seq-len 2048 --steps 33 --attention sdpa --out out"
    import hf_trainer

    parsed = hf_trainer.parse_args(cmd[cmd.index("--log_level") + 3:] + ["--local_rank=0"])  # the launcher adds it
    assert (parsed.seq_len, parsed.steps, parsed.seed) == (2048, 33, 1234)  # dstk train's default seed: its rows


@pytest.mark.parametrize("fused,cpu", [(False, False), (True, False), (False, True)])
def test_hf_trainers_arguments_match_every_value_it_checks_in_the_config(fused, cpu):
    """transformers' own check (HfTrainerDeepSpeedConfig.trainer_config_process, run when TrainingArguments is
    made, raising at the first step) finds no value of the case's config that differs from the arguments."""
    from types import SimpleNamespace

    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    import hf_trainer

    for case in (c for c in gpu_finetune.CASES if c.trainer == "hf"):
        cfg = gpu_finetune.ds_config(case, fused, cpu)
        kwargs = hf_trainer.training_arguments(cfg, "out", 33, 1234, cpu)
        assert kwargs["deepspeed"] is cfg and kwargs["lr_scheduler_type"] == "constant"  # the config has no scheduler
        assert kwargs["train_sampling_strategy"] == "sequential" and kwargs["use_cpu"] is cpu
        checked = HfTrainerDeepSpeedConfig(json.loads(json.dumps(cfg)))
        checked.trainer_config_process(SimpleNamespace(**kwargs, world_size=case.world, fp16_full_eval=False,
                                                       bf16_full_eval=False, save_on_each_node=False))
        assert checked.mismatches == []
        wrong = SimpleNamespace(**{**kwargs, "learning_rate": 3e-4}, world_size=case.world, fp16_full_eval=False,
                                bf16_full_eval=False, save_on_each_node=False)
        checked.trainer_config_process(wrong)
        assert checked.mismatches == ["- ds optimizer.params.lr=0.0001 vs hf learning_rate=0.0003"]  # the check bites


def test_hf_trainer_gets_each_micro_batch_as_dstks_forward_does():
    """Packed rows: position_ids restarting per document and no attention mask (HF's packed-sequence format,
    models.attention.model_inputs); a row of one document: its padding mask. Targets and padding per step."""
    import torch

    import hf_trainer
    from models.attention import model_inputs
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32)
    config._attn_implementation = "sdpa"
    docs = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 2, 2, 2, 2]])
    labels = torch.tensor([-100, 1, 2, -100, 4, -100])
    rows = [{"input_ids": torch.arange(6) + 10 * r, "doc_ids": docs[r], "labels": labels} for r in range(2)]
    batch = hf_trainer.collator(config)(rows)
    expected = model_inputs(docs, config)
    assert set(batch) == {"input_ids", "labels", "position_ids", "use_cache"} and expected["attention_mask"] is None
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]] and batch["use_cache"] is False
    assert torch.equal(batch["input_ids"][1], torch.arange(6) + 10)
    single = hf_trainer.collator(config)([{**rows[0], "doc_ids": torch.tensor([1, 1, 1, 1, 0, 0])}])
    assert single["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0]]
    # targets: labels after the causal shift that are not -100 (1, 2, 4 in each row); padding: doc id 0 (one position)
    assert hf_trainer.step_counts(rows, 2) == ([6], [1]) and hf_trainer.step_counts(rows, 1) == ([3, 3], [1, 0])


def test_tokens_per_s_leaves_out_the_warmup_steps():
    records = [{"step": 1, "tokens_per_s": 1.0}, {"step": 2, "tokens_per_s": 100.0}, {"step": 3, "tokens_per_s": 300.0}]
    # steps 2 and 3 of 600 tokens: 6 s + 2 s for 1200 tokens
    assert gpu_finetune.timed_rate(records, 1, 600) == 150.0


def test_figures_of_a_finished_run(monkeypatch):
    """MFU over all the case's GPUs with the planner's FLOPs per token, the largest rank's peak against the
    planner, the loss."""
    from toolkit.plan.arch import load_arch
    from toolkit.plan.cost.mfu import flops_per_token

    monkeypatch.setattr(gpu_finetune, "predicted_bytes", lambda *args: int(2.2 * 2**30))
    case, opts = next(c for c in gpu_finetune.CASES if c.name == "pp2"), gpu_finetune.parse_args([])
    records = [{"step": s, "tokens_per_s": 10.0 if s <= 3 else 1e4, "loss": 6.0 - s / 10} for s in range(1, 34)]
    summary = {"peak_gpu_mib_per_rank": [1000.0, 2048.0], "first_loss": 5.9, "last_loss": 2.7, "mfu": 0.1}
    arch = load_arch("llama-3.2-1b")
    ctx = {"peak_tflops": 1000, "arch": {"dense": arch}, "model_dir": {"dense": None}, "preset": "h200"}
    out = gpu_finetune.figures(case, records, summary, ctx, opts)
    flops = flops_per_token(arch, 2048)
    assert out["tokens_per_s"] == pytest.approx(1e4) and out["mfu"] == pytest.approx(1e4 * flops / 2e15)
    assert out["flops_per_token"] == flops and out["trainer_mfu"] == 0.1
    assert out["peak_gpu_bytes"] == 2 * 2**30 and out["predicted_error"] == pytest.approx(0.1)
    assert out["loss_fell"] and len(out["losses"]) == 33
    assert out["rows_per_s"] == pytest.approx(1e4 / 2048) and out["timed_steps"] == 30
    assert out["timed_seconds"] == pytest.approx(30 * 8 * 2048 / 1e4) and out["timed_targets"] is None  # dstk's: uncounted
    assert out["load_peak_gpu_bytes"] is None  # a summary from before the load's peak was kept
    hf = gpu_finetune.figures(case, [{**r, "targets": 100, "padding": 7} for r in records],
                              {**summary, "load_peak_gpu_mib_per_rank": [3072.0, None]}, ctx, opts)
    assert (hf["timed_targets"], hf["timed_padding"], hf["load_peak_gpu_bytes"]) == (3000, 210, 3 * 2**30)


def _finished(name: str, seconds: float, peak_gib: float, load_gib: float, **extra) -> dict:
    """A gpu.json entry of a finished pp1-zero1-shaped case: 30 timed steps of 8 x 2048 tokens in `seconds`."""
    case = next(c for c in gpu_finetune.CASES if c.name == name)
    rate = 30 * 8 * 2048 / seconds
    return {**vars(case), "world": 1, "gbs": 8, "seq_len": 2048, "status": "ok", "tokens_per_s": rate,
            "rows_per_s": rate / 2048, "timed_steps": 30, "timed_seconds": seconds, "mfu": 0.4, "predicted_bytes": None,
            "predicted_error": None, "peak_gpu_bytes": peak_gib * 2**30, "load_peak_gpu_bytes": load_gib * 2**30,
            "first_loss": 5.6, "last_loss": 4.1, **extra}


def test_the_report_sets_dstk_beside_hf_trainer():
    """The rates of the same tokens side by side (trained tokens: the targets HF's run counted on the rows both
    trained, over each run's own seconds), both peaks, the ratios; one line saying why when a side is missing."""
    ours = _finished("pp1-zero1", 20.0, 30.0, 33.0, timed_targets=None, timed_padding=None)
    hf = _finished("pp1-zero1-hf", 25.0, 36.0, 34.0, timed_targets=400_000, timed_padding=4915)
    text = "\n".join(gpu_report.markdown(META, [ours, hf]))
    assert "| tokens/s (row positions, padding included) | 24,576 | 19,661 | 1.250x |" in text
    assert "| trained tokens/s (positions with a loss target) | 20,000 | 16,000 | 1.250x |" in text
    assert "| rows/s | 12.00 | 9.60 | 1.250x |" in text
    assert "| peak GPU memory in training (GiB) | 30.00 | 36.00 | 0.833x |" in text
    assert "| peak GPU memory at load (GiB) | 33.00 | 34.00 | 0.971x |" in text
    assert "| loss, first -> last step | 5.600 -> 4.100 | 5.600 -> 4.100 | |" in text
    assert "(1.0% of the timed positions are padding" in text  # 4915 of 30 x 8 x 2048
    failed = {**hf, "status": "failed", "reason": "exit code 1"}
    text = "\n".join(gpu_report.markdown(META, [ours, failed]))
    assert "**dstk vs HF Trainer:** not compared (pp1-zero1-hf failed: exit code 1)." in text


def test_no_prediction_for_qlora():
    qlora = next(c for c in gpu_finetune.CASES if c.name == "pp1-qlora")
    assert gpu_finetune.predicted_bytes(qlora, 2048, None, "h200") is None  # the planner has no 4-bit base


META = {"gpu": "g", "peak_tflops": 989, "preset": "h100-sxm", "model": "m", "matmul_params": 1e9, "seq_len": 2048,
        "optimizer": "o", "warmup": 1, "steps": 2}


def test_a_failed_case_is_reported_with_its_log(tmp_path, monkeypatch):
    def crash(cmd, log, env, timeout, cwd=None):
        log.write_text("starting\nRuntimeError: CUDA out of memory\n")
        return 1, 2.0

    monkeypatch.setattr(gpu_finetune.common, "launch", crash)
    opts = gpu_finetune.parse_args(["--dry-run"])
    ctx = {"work": tmp_path, "data": {"text": tmp_path / "d.txt"}, "model_dir": {"dense": tmp_path / "m"}}
    entry = gpu_finetune.run_case(gpu_finetune.CASES[0], ctx, opts, 60)
    assert entry["status"] == "failed" and entry["reason"] == "exit code 1"
    assert entry["log_tail"].endswith("CUDA out of memory")
    skipped = {**vars(gpu_finetune.CASES[-1]), "status": "skipped", "reason": "needs 4 GPUs, 1 available"}
    text = "\n".join(gpu_report.markdown(META, [entry, skipped]))
    assert "| pp1-zero1 | 1 | 1 x 1 | 1 | 4 x 2 | sdpa | text | failed: exit code 1 |" in text
    assert "| pp2-dp2 | 4 | 2 x 2 | 1 | 2 x 4 | sdpa | text | skipped: needs 4 GPUs, 1 available |" in text


def test_cases_past_the_budget_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_finetune.common, "RESULTS", tmp_path)
    monkeypatch.setattr(gpu_finetune, "run_case", lambda case, ctx, opts, timeout: pytest.fail("started"))
    opts = gpu_finetune.parse_args(["--budget", "100"])
    cases, planned = [], [(gpu_finetune.CASES[0], None)]
    gpu_finetune.run_cases(cases, dict(META), {}, planned, opts, deadline=gpu_finetune.time.perf_counter() + 30)
    assert cases[0]["status"] == "skipped" and cases[0]["reason"].startswith("the --budget of 100 s was spent")


def test_a_crash_and_earlier_steps_are_recorded_in_gpu_json(tmp_path, monkeypatch):
    """gpu.sh's earlier steps (--step) go into gpu.json; a crash of this script too, before its traceback;
    --record-only adds a later step's failure; the table names every failed step and leaves out plan_gpu.py's
    figures when that step failed."""
    monkeypatch.setattr(gpu_finetune.common, "RESULTS", gpu_finetune.common.RESULTS)  # main() repoints it
    monkeypatch.setattr(gpu_finetune, "hardware", lambda opts: ("NVIDIA H200", "h200", 989.0, 1))

    def broken(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gpu_finetune, "prepare", broken)
    args = ["--out-dir", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"),
            "--step", "make setup=ok: 41 s", "--step", "plan_gpu.py=failed: exit code 3"]
    with pytest.raises(RuntimeError, match="disk full"):
        gpu_finetune.main(args)
    result = json.loads((tmp_path / "out" / "gpu.json").read_text())
    steps = result["script_steps"]
    assert steps[:2] == [{"name": "make setup", "status": "ok", "detail": "41 s"},
                         {"name": "plan_gpu.py", "status": "failed", "detail": "exit code 3"}]
    assert steps[2]["name"] == "gpu_finetune.py" and steps[2]["detail"] == "RuntimeError: disk full"
    assert "Traceback" in steps[2]["traceback"]
    md = (tmp_path / "out" / "gpu.md").read_text()
    assert "**Steps that failed:** plan_gpu.py (exit code 3); gpu_finetune.py (RuntimeError: disk full)." in md
    (tmp_path / "out" / "plan_gpu.json").write_text(json.dumps({"gpu": "NVIDIA H200", "cases": []}))
    assert gpu_report.plan_gpu_lines({**result, "gpu": "NVIDIA H200"}) == []  # its step failed: no stale table
    assert gpu_finetune.main(["--record-only", "--step", "report.py=failed: exit code 4", *args[:2]]) == 0
    steps = json.loads((tmp_path / "out" / "gpu.json").read_text())["script_steps"]
    assert steps[-1] == {"name": "report.py", "status": "failed", "detail": "exit code 4"} and len(steps) == 4


def test_gpu_finetune_skips_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: this would run the real benchmark")
    assert gpu_finetune.main([]) == 0
    assert "skipped: no CUDA" in capsys.readouterr().out


def _gpu_sh(env_changes: dict, *args, path_first: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PY"}
    env.update({"WHEELS": str(ROOT / "no-such-wheels"), **env_changes})  # not the offline path, unless asked
    if path_first:
        env["PATH"] = f"{path_first}{os.pathsep}{env['PATH']}"
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)


def _stand_in(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
    return path


def test_gpu_sh_refuses_in_one_line_and_exit_1_where_it_cannot_run(tmp_path):
    """No usable CUDA (this machine), torch not importable, the set-up failing: one line saying why, exit 1,
    nothing benchmarked and nothing written."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: gpu.sh would run the real benchmark")
    proc = _gpu_sh({"PY": sys.executable})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["gpu.sh: cannot run: torch.cuda.is_available() is False (no CUDA device or "
                                        f"driver; torch {torch.__version__}, built for CUDA {torch.version.cuda})"]
    _stand_in(tmp_path / "fake_torch", "torch.py", "").write_text("raise ImportError('simulated')\n")
    proc = _gpu_sh({"PY": sys.executable, "PYTHONPATH": str(tmp_path / "fake_torch")})
    assert (proc.returncode, proc.stdout) == (1, "gpu.sh: cannot run: torch not importable: ImportError: simulated\n")
    # without PY: the README's `make setup` first (a stand-in make here, logging its arguments)
    log = tmp_path / "make.log"
    _stand_in(tmp_path / "bin", "make", f'echo "$*" >> {log}\nexit 0\n')
    proc = _gpu_sh({}, path_first=tmp_path / "bin")
    assert proc.returncode == 1 and log.read_text() == "setup\n"
    assert proc.stdout.startswith("== make setup\ngpu.sh: set-up took ") and "cannot run: torch.cuda" in proc.stdout
    _stand_in(tmp_path / "bin", "make", "exit 2\n")
    proc = _gpu_sh({}, path_first=tmp_path / "bin")
    assert (proc.returncode, proc.stdout.splitlines()[-1]) == (1, "gpu.sh: cannot run: make setup failed (exit code "
                                                                  "2; its output is above)")


def test_gpu_sh_reports_each_failed_step_and_goes_on(tmp_path):
    """With a stand-in python where CUDA is 'usable': plan_gpu.py fails, gpu_finetune.py still runs and is told
    so (--step, for gpu.json), report.py runs, fails, and its failure is recorded; exit 1 with the list."""
    log = tmp_path / "calls.log"
    fake = _stand_in(tmp_path / "bin", "python", f"""echo "$*" >> {log}
case "$1" in
    -) cat >/dev/null ;;
    bench/plan_gpu.py) echo "plan_gpu: CUDA out of memory"; exit 3 ;;
    bench/report.py) exit 4 ;;
esac
exit 0
""")
    proc = _gpu_sh({"PY": str(fake), "GPU_SH_BUDGET": "400"}, "--quick")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "gpu.sh: step plan_gpu.py FAILED (exit code 3)" in out and "gpu.sh: step report.py FAILED (exit code 4)" in out
    assert "gpu.sh: ops JIT-built during the run: none" in out
    assert out.splitlines()[-1].endswith("s: plan_gpu.py (exit code 3) report.py (exit code 4)")
    calls = log.read_text().splitlines()
    finetune = next(c for c in calls if c.startswith("bench/gpu_finetune.py --step"))
    assert finetune.startswith("bench/gpu_finetune.py --step plan_gpu.py=failed: exit code 3 --budget ")
    assert finetune.endswith(" --quick") and 300 < int(finetune.split("--budget ")[1].split()[0]) <= 385
    assert calls[-1] == "bench/gpu_finetune.py --record-only --step report.py=failed: exit code 4 --quick"


@pytest.mark.distributed
@pytest.mark.heavy  # seven real launches, six through launch.sh, the bench's own path (~4 min on 2 cores)
def test_gpu_finetune_dry_run_on_cpu(tmp_path):
    """Every case two CPU processes allow runs the trainer (tiny-llama saved with save_pretrained in bf16, seq
    128, 2 steps), HF Trainer's case too (bench/hf_trainer.py under DeepSpeed's launcher), set beside dstk's in
    the report; flash_attention_2, QLoRA (CUDA) and pp2 x dp2 are reported as skipped."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the dry run needs a machine without CUDA (DeepSpeed's launcher shows every rank a GPU)")
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_finetune.py"), "--dry-run", "--out-dir", str(tmp_path / "out"),
           "--work-dir", str(tmp_path / "work")]
    from tests.conftest import child_env

    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "gpu.json").read_text())
    cases = {c["name"]: c for c in result["cases"]}
    assert list(cases) == NAMES
    assert {n: c["status"] for n, c in cases.items() if c["status"] != "ok"} == {
        "pp1-fa2": "skipped", "pp1-qlora": "skipped", "pp2-dp2": "skipped"}
    lora = cases["pp2-lora"]["summary"]
    assert all(0 < t < p for t, p in zip(lora["trainable_params_per_rank"], lora["params_per_rank"]))  # a frozen base
    assert "needs 4 CPU processes" in cases["pp2-dp2"]["reason"]
    model = tmp_path / "work" / "tiny-llama"
    assert (model / "model.safetensors").is_file() and result["model_dir"] == str(model)
    for case in (c for c in cases.values() if c["status"] == "ok"):
        per_rank = case["summary"]["params_per_rank"]  # the trainer's own summary, one entry per rank
        assert len(per_rank) == case["pp"] * case["dp"] and min(per_rank) > 0
        program = "hf_trainer.py" if case["trainer"] == "hf" else "launch.sh"
        assert case["config"]["pipeline"]["stages"] == case["pp"] and any(program in part for part in case["command"])
        saved = tmp_path / "work" / "tiny-mixtral" if case["ep"] else model  # the AutoEP case: the MoE model's
        assert case["command"][case["command"].index("--model") + 1] == str(saved)  # the saved directory, every case
        assert len(case["losses"]) == 2 and case["first_loss"] == case["losses"][0]
        assert case["last_loss"] == case["losses"][-1] and case["tokens_per_s"] > 0 and case["predicted_bytes"] > 0
        assert case["flops_per_token"] > 0 and case["mfu"] is None and case["summary"]["mfu"] is None  # no GPU peak
    ep = cases["pp1-ep1"]  # AutoEP's layers at ep 1 on one rank: the case the first GPU run times its kernels with
    assert ep["config"]["expert_parallel"] == {"enabled": True, "autoep_size": 1, "preset_model": "mixtral"}
    assert "experts: ep 1 (DeepSpeed AutoEP)" in Path(ep["log"]).read_text() and result["moe_matmul_params"] > 0
    hf, ours = cases["pp1-zero1-hf"], cases["pp1-zero1"]
    assert hf["summary"]["trainer"] == "transformers.Trainer" and hf["timed_targets"] > 0 and hf["config"] == ours["config"]
    assert abs(hf["first_loss"] - ours["first_loss"]) < 0.01  # the same weights on the same first rows
    chat = cases["pp1-chat"]["summary"]["data"]
    assert chat["format"] == "chat" and chat["packing"] is True
    assert sum(cases["pp2"]["summary"]["params_per_rank"]) == result["matmul_params"]  # two stages, one model
    assert result["script_steps"] == [{"name": "gpu_finetune.py", "status": "ok", "detail": None}]
    md = (tmp_path / "out" / "gpu.md").read_text()
    assert "| pp2 | 2 | 2 x 1 | 1 | 2 x 4 |" in md and "| pp2-dp2 | 4 | 2 x 2 | 1 | 2 x 4 | sdpa | text | skipped:" in md
    assert "**dstk vs HF Trainer** (pp1-zero1 / pp1-zero1-hf" in md and "| rows/s |" in md
    real = ROOT / "bench" / "results" / "gpu.json"
    assert not real.exists() or "CPU" not in real.read_text()  # a dry run never overwrites GPU figures


def test_plan_gpus_dry_run_estimates_every_case_the_long_ones_tiled(monkeypatch, capsys):
    """bench/plan_gpu.py --dry-run on CPU: an estimate per case; the long-sequence cases (checkpointing, the tiled
    loss and TiledMLP, one whole row) grow by less than the tokens from 16K to 32K (kept inputs and one recomputed
    block's shards, not every block's intermediates); the case offloading the checkpoints predicts all but two of them
off the GPU."""
    import plan_gpu

    monkeypatch.setattr(sys, "argv", ["plan_gpu.py", "--dry-run"])
    assert plan_gpu.main() == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(plan_gpu.CASES) + len(plan_gpu.LONG_CASES) and all("predicted" in x for x in lines)
    short, long = (plan_gpu.predict_long("llama-3.2-1b", 4, seq, False, "h100-sxm") for seq in (16384, 32768))
    assert short < long < 2 * short
    kept, offloaded = (plan_gpu.predict_long("llama-3.2-1b", 8, 32768, offload, "h100-sxm") for offload in (False, True))
    assert kept - offloaded == 9 * 32768 * 2048 * 2  # the 11 layers' inputs (embedding, 8 blocks, norm, head) but two
