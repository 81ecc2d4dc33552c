"""The shipped presets in ds_configs/: each one is the output of a recorded generate-config command.

ds_configs/presets.txt names each preset file and the `dstk generate-config` arguments that make it;
`python -m toolkit.cli.generate` (what `make presets` runs) writes every file from its command again.
"""

import shlex
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
