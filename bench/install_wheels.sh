#!/usr/bin/env bash
# Install a wheelhouse (make wheelhouse: wheels/) on top of a Python's own packages, with no package registry:
#   bash bench/install_wheels.sh PYTHON WHEELS TARGET      then: export PYTHONPATH=TARGET
# `pip install --no-index --no-deps --target TARGET`: nothing is fetched and nothing of PYTHON's own changes (the
# GPU image's torch, transformers, ... stay as they are). TARGET on PYTHONPATH comes before site-packages and is
# inherited by launch.sh, the deepspeed launcher and every rank it starts. Not a venv with
# --system-site-packages: the image's python3 is itself a venv (/opt/torch/.venv), and a venv made from a venv
# sees the base interpreter's site-packages, not the image's torch.
# Then each installed wheel's requirements (Requires-Dist, extras aside) are checked against what PYTHON now
# imports: one line per requirement that is missing or at another version, on stdout, and the install still
# counts as done (exit 0: the run says whether it matters). Exit 1 when pip fails: a wheel built for another
# Python or platform, two versions of one package, no wheels.
set -uo pipefail
python=${1:?usage: bash bench/install_wheels.sh PYTHON WHEELS TARGET}
wheels=${2:?usage: bash bench/install_wheels.sh PYTHON WHEELS TARGET}
target=${3:?usage: bash bench/install_wheels.sh PYTHON WHEELS TARGET}
shopt -s nullglob
files=("$wheels"/*.whl)
[ ${#files[@]} -gt 0 ] || { echo "install_wheels: no wheels in $wheels/ (make wheelhouse writes them)"; exit 1; }
"$python" -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$target" \
    "${files[@]}" || { echo "install_wheels: pip could not install $wheels/*.whl into $target with $python" \
                            "($("$python" -V 2>&1)); its message is above"; exit 1; }
PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" "$python" - "$target" <<'EOF'
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

target = Path(sys.argv[1])
installed = list(metadata.distributions(path=[str(target)]))
unmet = []
for dist in installed:
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{dist.name} {dist.version} needs {req}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{dist.name} {dist.version} needs {req}: this Python has {have}")
versions = ", ".join(sorted(f"{d.name} {d.version}" for d in installed))
print(f"install_wheels: {len(installed)} wheels into {target} ({versions})")
for line in unmet:
    print(f"install_wheels: unmet: {line}")
EOF
