"""The lent GPU machine simulated on CPU (issue 43): a clean venv holding only the packages of the GPU image that
dstk uses, at the image's versions where they install here, and none of what the image lacks; the wheelhouse
(`make wheelhouse`, for this venv's Python) installed on top with `--no-index --no-deps` by bench/install_wheels.sh
(gpu.sh's own install); then `bench/gpu.sh` (it refuses: no CUDA), `bench/gpu_finetune.py --dry-run` and a 2-step
`dstk train` from the dstk wheel's console script. Each exits as it should, so nothing beyond the image and the
wheelhouse is needed.

Where this venv is not the image, and why:
- Python 3.11, not 3.12.3: the only CPU torch here is a cp311 wheel (PyPI's Linux torch is a CUDA build of several
  GB). The wheelhouse is built for 3.11 the same way (`make wheelhouse WHEEL_PY=3.11`): the same versions, cp311
  builds of its binary wheels (pydantic-core, rpds-py) and multiprocess's py311 wheel; the cp312 set is checked for
  its tags and size only.
- torch 2.13.0+cpu, not 2.11.0+cu130 (no CPU torch 2.11 installs here: PyPI's is the CUDA build), and numpy 2.4.6,
  not 2.5.2 (numpy 2.5 needs Python >= 3.12).
- Versions the image's package list does not give are the newest released by late September 2026, the date of the image's newest
  packages (huggingface_hub 1.33.0, transformers 5.17.0): pyarrow 25.0.1, fsspec 2026.9.0, pandas 3.0.6, peft 0.21.1,
  matplotlib 3.11.2, tensorboard 2.21.0; typing-extensions 4.15.0 is one release older than pydantic 2.14 needs
  (the wheelhouse carries 4.16.0).
- pydantic comes here with typer (huggingface_hub's CLI); the image has typer but no pydantic: removed after.
The venv is built once (~3 min: torch from the disk, the rest from the registry) and kept in
~/.cache/dstk-tests/ under a key of its contents; the wheels go to a fresh --target folder, the venv stays clean.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import child_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.heavy

# The image's packages that dstk, deepspeed, datasets or the wheelhouse's wheels import: name -> version (None:
# whatever the resolver picks). torch goes first, alone (bench/wheelhouse.txt names the image's versions).
IMAGE = {"transformers": "5.17.0", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "safetensors": "0.8.0",
         "accelerate": "1.15.0", "peft": "0.21.1", "numpy": "2.4.6", "pyarrow": "25.0.1", "pandas": "3.0.6",
         "fsspec": "2026.9.0", "typing-extensions": "4.15.0", "matplotlib": "3.11.2", "tensorboard": "2.21.0",
         "click": None, "jinja2": None, "msgpack": None, "psutil": None, "ninja": None, "py-cpuinfo": None,
         "einops": None, "tqdm": None, "pyyaml": None, "packaging": None, "filelock": None, "xxhash": None,
         "requests": None, "attrs": None}
TORCH = "torch==2.13.0"
# What the image lacks: the wheelhouse brings each (as the distribution name pip lists)
LACKS = ["deepspeed", "datasets", "dill", "multiprocess", "hjson", "jsonschema", "jsonschema-specifications",
         "referencing", "rpds-py", "pydantic", "pydantic-core", "annotated-types", "typing-inspection"]
MIB = 2**20


def _run(cmd: list, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)


def _make_wheelhouse(py: str, out: Path) -> subprocess.CompletedProcess:
    """`make wheelhouse` with this test's interpreter's environment as the set-up venv (deepspeed's build needs torch);
    only where `make setup` made it: the target would set up any other environment first."""
    if not (Path(sys.prefix) / ".dstk-installed").exists():
        pytest.skip(f"{sys.prefix} is not a venv `make setup` made (no .dstk-installed): run under .venv/bin/python")
    return _run(["make", "-s", "wheelhouse", f"VENV={sys.prefix}", f"WHEEL_PY={py}", f"WHEELS={out}"], 600, cwd=ROOT)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels311")
    proc = _make_wheelhouse(f"{sys.version_info.major}.{sys.version_info.minor}", out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dstk-tests"


@pytest.fixture(scope="module")
def image() -> Path:
    """The simulated image's venv (its python: VENV/bin/python), built on first use and cached by its contents."""
    pip_install = ["-m", "pip", "install", "-q", "--disable-pip-version-check"]  # byte-compiled: each rank imports it
    spec = json.dumps([sys.version, TORCH, IMAGE, LACKS, pip_install], sort_keys=True)
    venv = _cache() / f"image-venv-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    if (venv / "ready").exists():
        return venv
    shutil.rmtree(venv, ignore_errors=True)  # a build cut short
    venv.parent.mkdir(parents=True, exist_ok=True)
    pins = venv.parent / f"{venv.name}.constraints.txt"
    pins.write_text("".join(f"{name}=={v}\n" for name, v in IMAGE.items() if v))
    python = venv / "bin" / "python"
    pip = [python, *pip_install]
    for step in ([sys.executable, "-m", "venv", venv], [*pip, TORCH], [*pip, "-c", pins, *IMAGE],
                 [python, "-m", "pip", "uninstall", "-y", "-q", *LACKS]):
        proc = _run(step, 900)
        assert proc.returncode == 0, f"{step}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    (venv / "ready").write_text(spec)
    return venv


def _env(site: Path | None, **extra) -> dict:
    """This environment for the image's python: no PYTHONPATH of ours (the wheels' --target folder only), CPU."""
    env = {k: v for k, v in child_env().items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return env


@pytest.fixture(scope="module")
def site(image, wheels, tmp_path_factory) -> Path:
    """The wheelhouse installed with bench/install_wheels.sh (pip --no-index --no-deps --target), as gpu.sh does."""
    python = image / "bin" / "python"
    probe = "import importlib.util as u, sys; sys.exit(sum(u.find_spec(m) is not None for m in sys.argv[1:]))"
    modules = ["deepspeed", "datasets", "dill", "multiprocess", "hjson", "jsonschema", "pydantic", "pydantic_core"]
    proc = _run([python, "-c", probe, *modules], 60, env=_env(None))
    assert proc.returncode == 0, f"{proc.returncode} of {modules} importable before the install: not the image"
    target = tmp_path_factory.mktemp("site")
    proc = _run(["bash", ROOT / "bench" / "install_wheels.sh", python, wheels, target], 300, env=_env(None))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("install_wheels: 15 wheels into ") and "unmet" not in proc.stdout, proc.stdout
    return target


def test_the_wheelhouse_for_the_image_fits_and_has_one_wheel_per_pin(tmp_path, wheels):
    """`make wheelhouse` (Python 3.12, the image's): each pin of bench/wheelhouse.txt plus dstk, once; binary
    wheels cp312 manylinux x86_64, the rest pure; at most 60 MiB; the same versions as the 3.11 set."""
    proc = _make_wheelhouse("3.12", tmp_path / "wheels")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "wheelhouse: 15 wheels, " in proc.stdout
    found = sorted((tmp_path / "wheels").glob("*.whl"))
    assert sum(w.stat().st_size for w in found) <= 60 * MIB
    pins = [line.split("#")[0].split()[0] for line in (ROOT / "bench" / "wheelhouse.txt").read_text().splitlines()
            if line.split("#")[0].strip()]
    versions = {w.name.split("-")[0].lower().replace("_", "-"): w.name.split("-")[1] for w in found}
    assert versions.pop("dstk") and versions == {p.split("==")[0].lower(): p.split("==")[1] for p in pins}
    for w in found:
        python_tag, abi, platform = w.stem.split("-")[-3:]
        assert (python_tag, abi, platform) in {("py3", "none", "any"), ("py312", "none", "any")} or (
            python_tag == abi == "cp312" and platform.startswith("manylinux") and platform.endswith("x86_64")), w.name
    assert {w.name.split("-")[:2][0] for w in found} == {w.name.split("-")[:2][0] for w in wheels.glob("*.whl")}
    with zipfile.ZipFile(next(w for w in found if w.name.startswith("deepspeed-"))) as z:
        assert not [n for n in z.namelist() if n.endswith(".so")]  # DS_BUILD_OPS=0: no op built in


def test_gpu_sh_installs_from_the_wheels_and_refuses_without_cuda(image, wheels):
    """gpu.sh's offline path in the simulated image: the install, nothing unmet, then the one-line refusal."""
    proc = _run(["bash", ROOT / "bench" / "gpu.sh"], 300, cwd=ROOT, env=_env(None, PY=str(image / "bin" / "python"),
                                                                          WHEELS=str(wheels)))
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert lines[0] == f"== offline install: {wheels}/ onto {image / 'bin' / 'python'}" and "unmet" not in proc.stdout
    assert lines[-1].startswith("gpu.sh: cannot run: torch.cuda.is_available() is False"), proc.stdout


def test_gpu_finetune_dry_run_in_the_image(image, site, tmp_path):
    """The bench's own path (launch.sh, the deepspeed launcher, toolkit.train on a CPU rank) with the image's
    packages and the wheels alone: pp1-zero1, the first case the lent machine (one GPU) runs, and pp1-zero1-hf, the
    same under HF Trainer (transformers 5.17's Trainer with the wheelhouse's deepspeed and datasets); two cases, as
    each launch costs ~1 min here (LoRA: test_dstk_train_from_the_wheel_in_the_image)."""
    cmd = [image / "bin" / "python", ROOT / "bench" / "gpu_finetune.py", "--dry-run", "--cases", "pp1-zero1",
           "pp1-zero1-hf", "--out-dir", tmp_path / "out", "--work-dir", tmp_path / "work"]
    proc = _run(cmd, 900, cwd=ROOT, env=_env(site))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    cases = {c["name"]: c for c in json.loads((tmp_path / "out" / "gpu.json").read_text())["cases"]}
    assert {n: c["status"] for n, c in cases.items()} == {"pp1-zero1": "ok", "pp1-zero1-hf": "ok"}
    versions = json.loads((tmp_path / "out" / "gpu.json").read_text())["machine"]["versions"]
    assert versions["deepspeed"] == "0.19.8" and versions["torch"].startswith("2.13.0")


def test_dstk_train_from_the_wheel_in_the_image(image, site, tmp_path):
    """`dstk train`, the dstk wheel's console script outside this tree (its schema and corpus from the wheel):
    generate-config, then 2 LoRA steps (peft) of a tiny Llama saved with save_pretrained, one process, pp 1, and
    the export (the merged model and the adapter)."""
    save = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import gpu_inputs; "
            "gpu_inputs.save_model('tiny-llama', Path(sys.argv[2]))")
    proc = _run([image / "bin" / "python", "-c", save, ROOT / "bench", tmp_path], 300, cwd=tmp_path, env=_env(site))
    assert proc.returncode == 0, proc.stderr[-3000:]
    dstk = site / "bin" / "dstk"
    proc = _run([dstk, "generate-config", "--world-size", "1", "--mbs", "2", "--gas", "1", "--zero", "1", "--cpu",
                 "-o", tmp_path / "ds.json"], 120, cwd=tmp_path, env=_env(site))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _run([dstk, "train", "--config", tmp_path / "ds.json", "--model", tmp_path / "tiny-llama", "--data",
                 ROOT / "toolkit" / "corpus" / "corpus.txt", "--seq-len", "64", "--steps", "2", "--eval-fraction", "0",
                 "--lora", "--out", tmp_path / "run"], 600, cwd=tmp_path, env=_env(site))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and 0 < summary["last_loss"] < 10, summary  # byte-level vocab: ln 257 = 5.5
    assert summary["loss_png"] and (tmp_path / "run" / "hf" / "config.json").is_file()
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    where = _run([image / "bin" / "python", "-c", "import toolkit; print(toolkit.__file__)"], 60, cwd=tmp_path,
                 env=_env(site))
    assert where.stdout.startswith(str(site)), where  # the wheel's code ran: neither cwd nor PYTHONPATH holds the tree
