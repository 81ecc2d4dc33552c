"""From `./launch.sh` to the end of a 2-step run, and where the wait before the first step goes (issue 26).

    .venv/bin/python bench/launch_time.py                      # old = OLD_COMMIT, new = this tree, 3 repeats
    .venv/bin/python bench/launch_time.py --old HEAD~5 --repeats 5

Each run: `launch.sh --num-gpus 2 --config ds_configs/cpu_pp2.json -- --model tiny-gpt2 --data
toolkit/corpus/corpus.txt --seq-len 32 --steps 2 --no-export` (2 CPU ranks, pp 2, the shipped corpus with its
tokenized rows already cached: the second launch of a day, not the first), from each variant's own tree
(`git archive` of toolkit/, models/, ds_configs/ and launch.sh; PYTHONPATH and working directory), old then
new, repeat after repeat. Reported: the median wall seconds of each, the ratio new / old, and new's own
split of the wait before its first step ("ready after": launcher and --check, the ranks' imports, checks,
process group, data, model, engine; medians). A failed run fails the benchmark (exit 1, its log's tail).
Writes bench/results/launch_time.json (every run) and bench/results/launch_time.md.
"""

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(REPO), str(BENCH)]
import common  # noqa: E402

OLD_COMMIT = "56d1fb2"  # before the package map and issue 26: --check imported torch, no "ready after" line
ARGS = ["--num-gpus", "2", "--config", "ds_configs/cpu_pp2.json", "--", "--model", "tiny-gpt2", "--data",
        "toolkit/corpus/corpus.txt", "--seq-len", "32", "--steps", "2", "--no-export"]


def run_once(tree: Path, out: Path, log: Path) -> tuple[float, str]:
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tree), "DS_ACCELERATOR": "cpu",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("DSTK_LAUNCHED_AT", None)
    rc, seconds = common.launch(["bash", str(tree / "launch.sh"), *ARGS, "--out", str(out), "--overwrite"], log, env,
                                timeout=600, cwd=tree)
    text = log.read_text()
    if rc != 0:
        print(f"launch_time: a run failed (exit {rc}); its log ends:\n{text[-3000:]}", file=sys.stderr)
        sys.exit(1)
    return seconds, text


def ready_split(text: str) -> dict:
    """new's "ready after T s: a 1.0, b 2.0" line -> {"total": T, "a": 1.0, ...}."""
    match = re.search(r"^ready after ([\d.]+) s: (.*)$", text, re.M)
    if not match:
        return {}
    parts = dict((name.strip(), float(sec)) for name, sec in (p.rsplit(" ", 1) for p in match.group(2).split(", ")))
    return {"total": float(match.group(1)), **parts}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--old", default=OLD_COMMIT)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dstk-launch-") as tmp:
        trees = {"old": common.extract(opts.old, Path(tmp) / "old", ("toolkit", "models", "ds_configs", "launch.sh")),
                 "new": REPO}
        walls, splits = {"old": [], "new": []}, []
        for name in ("old", "new"):  # warm the data cache and the page cache once, unmeasured
            run_once(trees[name], Path(tmp) / f"out-{name}", Path(tmp) / f"{name}.log")
        for _ in range(opts.repeats):
            for name, tree in trees.items():
                seconds, text = run_once(tree, Path(tmp) / f"out-{name}", Path(tmp) / f"{name}.log")
                walls[name].append(seconds)
                if name == "new":
                    splits.append(ready_split(text))
    result = common.summarize(walls, baseline="old")
    split = {key: statistics.median(s[key] for s in splits if key in s) for key in splits[0]} if splits[0] else {}
    common.write_result("launch_time", {"old": opts.old, "runs": result, "ready_split_new": split,
                                        "load_before_after": os.getloadavg()})
    lines = ["| variant | median wall (s) | runs (s) | new / old |", "|---|---|---|---|"]
    for name in ("old", "new"):
        r = result[name]
        lines.append(f"| {name} | {r['median_s']:.1f} | {', '.join(f'{x:.1f}' for x in r['runs_s'])} | "
                     f"{r['ratio_to_old']:.2f} |")
    if split:
        lines += ["", "Where new's wait before its first step goes (medians, seconds): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in split.items()) + "."]
    lines += ["", f"old: commit {opts.old}; new: this tree. {opts.repeats} repeats, alternating, after one unmeasured "
              "run of each (data cache warm). 2 CPU ranks of tiny-gpt2 at pp 2, 2 steps, no export."]
    common.write_markdown("launch_time", "Launch to end of a 2-step run (`bench/launch_time.py`)", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
