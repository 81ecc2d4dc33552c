#!/usr/bin/env bash
# `make wheelhouse`: the wheels bench/gpu.sh installs on a machine with no package registry (the lent GPU machine:
# Python 3.12, its own torch, transformers, ...; see bench/wheelhouse.txt), into OUT (default wheels/, git-ignored,
# carried with the working tree), at most 60 MiB:
#   - deepspeed, built here: PyPI has only its sdist (DS_BUILD_OPS=0: no op built, a pure wheel; its setup imports
#     torch, so PYTHON needs torch);
#   - dstk's own wheel, from this tree;
#   - every other line of bench/wheelhouse.txt, downloaded as a cp<PY_VERSION> manylinux x86_64 or pure wheel.
#
#   bash bench/wheelhouse.sh PYTHON [PY_VERSION] [OUT]     # PY_VERSION default 3.12 (the image's), OUT wheels
# e.g. `bash bench/wheelhouse.sh .venv/bin/python 3.11 /tmp/wheels311`: the same set for Python 3.11 (the
# simulated image of tests/bench/test_offline_install.py). Needs a registry (PyPI) for the downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:?usage: bash bench/wheelhouse.sh PYTHON [PY_VERSION] [OUT]}
py=${2:-3.12}
out=${3:-wheels}
pins=bench/wheelhouse.txt
limit_mib=60  # the lent machine receives the working tree and what travels with it: 64 MiB in all
start=$SECONDS

"$python" -c 'import torch' 2>/dev/null \
    || { echo "wheelhouse: $python cannot import torch, which deepspeed's setup.py imports (make setup first)"; exit 1; }
mkdir -p "$out"
rm -f "$out"/*.whl  # one version of each package: nothing left from an earlier set
names=$(sed 's/#.*//' "$pins" | awk 'NF {print $1}')
echo "wheelhouse: building deepspeed and dstk, downloading $(echo "$names" | grep -vc '^deepspeed==') wheels for" \
     "Python $py into $out/"
DS_BUILD_OPS=0 "$python" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "$(echo "$names" | grep '^deepspeed==')"
# dstk from a copy of what its wheel holds: setuptools' build/ in the tree can keep modules deleted since
src=$(mktemp -d -t dstk-wheel-src-XXXXXX)
trap 'rm -rf "$src"' EXIT
cp -r setup.cfg pyproject.toml README.md toolkit models "$src"/
"$python" -m pip wheel -q --no-deps --no-build-isolation -w "$out" "$src"
# pip matches platform tags exactly: the manylinux tags these packages' x86_64 wheels carry
echo "$names" | grep -v '^deepspeed==' | xargs "$python" -m pip download -q --only-binary=:all: --no-deps \
    --python-version "$py" --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out"

"$python" - "$out" "$limit_mib" "$(echo "$names" | wc -l)" <<'EOF'
import sys
from pathlib import Path

out, limit_mib, pinned = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
wheels = sorted(out.glob("*.whl"))
for w in wheels:
    print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
names = [w.name.split("-")[0].lower() for w in wheels]
doubled = sorted({n for n in names if names.count(n) > 1})
if doubled or len(wheels) != pinned + 1:  # + dstk
    sys.exit(f"wheelhouse: {len(wheels)} wheels for {pinned} pins + dstk; more than one version of: {doubled}")
total = sum(w.stat().st_size for w in wheels) / 2**20
if total > limit_mib:
    sys.exit(f"wheelhouse: {total:.1f} MiB in {out}/ is over the {limit_mib} MiB limit (the lent machine takes 64 MiB "
             f"with the working tree): drop or shrink the largest wheels above")
print(f"wheelhouse: {len(wheels)} wheels, {total:.1f} MiB (limit {limit_mib} MiB)")
EOF
echo "wheelhouse: done in $((SECONDS - start)) s"
