"""bench/gpu.sh's offline set-up (issue 43), on this machine: a folder of wheels (WHEELS=DIR, as `make wheelhouse`
writes wheels/) is installed with bench/install_wheels.sh (`pip install --no-index --no-deps --target` into a temp
folder on PYTHONPATH), each requirement the interpreter lacks is named, and gpu.sh then goes on to its checks (here:
no CUDA, the one-line refusal). The real wheelhouse in a simulated GPU image: test_offline_install.py (heavy)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _wheel(folder: Path, name: str, requires: list[str]) -> Path:
    """A one-module pure wheel NAME 0.1 whose METADATA requires `requires`."""
    folder.mkdir(exist_ok=True)
    info = f"{name}-0.1.dist-info"
    files = {f"{name}.py": "", f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires)}
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    path = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for arcname, text in files.items():
            z.writestr(arcname, text)
    return path


def _gpu_sh(wheels: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PY=sys.executable, WHEELS=str(wheels))
    return subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh")], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)


def test_gpu_sh_installs_wheels_offline_then_refuses_without_cuda(tmp_path):
    """The install's two lines (what went where; a requirement not met), then, with no CUDA here, the refusal and
    exit 1; the temp folder is removed at the end. A wheel pip refuses: the install's failure, in one line."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: gpu.sh would run the real benchmark")
    wheels = tmp_path / "wheels"
    _wheel(wheels, "dstk_probe", ["torch>=2", "not-a-package>=1", "pytest; extra == 'test'"])
    proc = _gpu_sh(wheels)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines[0] == f"== offline install: {wheels}/ onto {sys.executable}"
    assert lines[1].startswith("install_wheels: 1 wheels into ") and lines[1].endswith(" (dstk_probe 0.1)")
    assert lines[2:] == ["install_wheels: unmet: dstk_probe 0.1 needs not-a-package>=1: not installed",
                         f"gpu.sh: cannot run: torch.cuda.is_available() is False (no CUDA device or driver; torch "
                         f"{torch.__version__}, built for CUDA {torch.version.cuda})"]
    assert not Path(lines[1].split(" into ")[1].split(" (")[0]).exists()
    (wheels / "dstk_probe-0.1-py3-none-any.whl").rename(wheels / "x-0.1-cp27-cp27m-win32.whl")
    proc = _gpu_sh(wheels)
    assert proc.returncode == 1 and "is not a supported wheel on this platform" in proc.stderr
    assert proc.stdout.splitlines()[-1].startswith(f"gpu.sh: cannot run: the offline install from {wheels}/ failed "
                                                   "(install_wheels: pip could not install ")
