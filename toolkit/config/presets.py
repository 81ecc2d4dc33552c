"""The shipped presets in ds_configs/: each one is the output of a recorded generate-config command.

    python -m toolkit.config.presets          # regenerate every preset (what `make presets` runs)
"""

import shlex
import sys
from pathlib import Path

PRESET_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
MANIFEST = PRESET_DIR / "presets.txt"


def load_presets(manifest: Path = MANIFEST) -> dict[str, list[str]]:
    """File name -> generate-config arguments, from the manifest."""
    presets = {}
    for line in manifest.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, args = line.split(":", 1)
            presets[name.strip()] = shlex.split(args)
    return presets


def render(args: list[str]) -> str:
    """The JSON text `dstk generate-config ARGS` prints."""
    from click.testing import CliRunner

    from toolkit.cli.generate import generate_config

    result = CliRunner().invoke(generate_config, args, catch_exceptions=False)
    if result.exit_code:
        raise SystemExit(f"generate-config {shlex.join(args)} failed: {result.output}")
    return result.output


def main() -> None:
    for name, args in load_presets().items():
        (PRESET_DIR / name).write_text(render(args))
        print(f"wrote ds_configs/{name}: dstk generate-config {shlex.join(args)}", file=sys.stderr)


if __name__ == "__main__":
    main()
