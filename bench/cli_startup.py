"""CLI start-up: `dstk --help`, `generate-config`, `validate` vs `python -c "import deepspeed"`.

    python bench/cli_startup.py [--reps 7]

Alternates the commands round by round and prints medians and the ratio of each to importing deepspeed.
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import alternate, summarize, time_command, write_markdown, write_result  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    py = sys.executable
    config = Path(tempfile.mkdtemp()) / "ds.json"
    dstk = [py, "-m", "toolkit.cli"]
    time_command(dstk + ["generate-config", "--strategy", "hybrid", "--world-size", "8", "--pp", "4", "--mbs", "2",
                         "--gbs", "64", "-o", str(config)])
    commands = {
        "import deepspeed": [py, "-c", "import deepspeed"],
        "dstk --help": dstk + ["--help"],
        "dstk generate-config": dstk + ["generate-config", "--world-size", "8", "--pp", "4", "--mbs", "2", "--gbs", "64"],
        "dstk validate": dstk + ["validate", str(config), "--world-size", "8"],
        "python -c pass": [py, "-c", "pass"],
    }
    time_command(commands["import deepspeed"])  # warm the file cache once
    samples = alternate({name: (lambda c=cmd: time_command(c)) for name, cmd in commands.items()}, args.reps)
    result = summarize(samples, baseline="import deepspeed")
    path = write_result("cli_startup", {"reps": args.reps, "results": result})
    rows = ["| command | median (s) | / `import deepspeed` |", "|---|---:|---:|"]
    rows += [f"| `{name}` | {r['median_s']:.3f} | {r['ratio_to_import deepspeed']:.3f} |" for name, r in result.items()]
    rows += ["", f"Medians of {args.reps} alternating rounds. Target: `--help`, `generate-config` and `validate` "
             "well under 0.5 s, importing no torch/deepspeed/transformers."]
    write_markdown("cli_startup", "CLI start-up", rows)
    print("\n".join(rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
