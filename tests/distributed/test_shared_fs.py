"""Several nodes need one --out (and prefer one data cache). Two ranks of one machine play two nodes; for
the case of a node with its own disk, rank 1 runs in a mount namespace of its own (unshare -m, as root)
with a fresh tmpfs over the folder: a real file system that rank 0 does not share."""

import shutil
from pathlib import Path

import pytest

from tests.configs import run_config, write_config
from tests.distributed.launch import COMMON
from tests.ranks import run_ranks

pytestmark = pytest.mark.distributed

OWN_DISK = """
import os, sys
if os.environ["RANK"] == "1":  # this "node" sees its own, empty, disk at the folder
    os.execvp("unshare", ["unshare", "-m", "sh", "-c", 'mount -t tmpfs none "$0" && exec "$@"', sys.argv[1],
                          sys.executable, "-m", "toolkit.train", *sys.argv[2:]])
import runpy
sys.argv = ["toolkit.train", *sys.argv[2:]]
runpy.run_module("toolkit.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux) and root")
def test_an_out_folder_that_is_each_nodes_own_disk_is_refused(tmp_path):
    folder = tmp_path / "node"
    folder.mkdir()
    script = tmp_path / "own_disk.py"
    script.write_text(OWN_DISK)
    cfg = write_config(tmp_path / "ds.json", run_config(mbs=2, gas=2, pp=1))
    rc, log = run_ranks([script, folder, "--config", cfg, *COMMON, "--steps", "1", "--out", folder / "run"], 2,
                        timeout=120)
    assert rc == 1 and "Traceback" not in log, log[-3000:]
    assert log.count("is not one folder for every node") == 1, log[-3000:]  # once, by rank 0
    assert "rank(s) [1]" in log and "put --out on a file system every node mounts" in log


ONE_CACHE = """
import os, sys
os.environ["LOCAL_RANK"] = "0"  # two nodes of one rank each: each is its node's local rank 0
from toolkit.distributed import process_group
from toolkit import data
from toolkit.train import hf
process_group.init(cpu=True)
tokenizer = hf.byte_tokenizer()
calls = []


class Counted:  # the tokenizers.Tokenizer behind it, its batched calls counted
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode_batch_fast(self, *args, **kwargs):
        calls.append(1)
        return self.inner.encode_batch_fast(*args, **kwargs)


tokenizer._tokenizer = Counted(tokenizer._tokenizer)
prepared = data.prepare_once_per_node(data.DataOptions(path=sys.argv[1], seq_len=32, cache_dir=sys.argv[2]), tokenizer)
print(f"rank {process_group.env_rank()} tokenized {len(calls)} rows {len(prepared.train)}", flush=True)
process_group.shutdown()
"""


def test_nodes_sharing_the_data_cache_tokenize_once(tmp_path):
    """Both "nodes" see one cache folder: global rank 0 tokenizes, the other reads its cache (each node's
    local rank 0 used to build the same cache files at the same time)."""
    script = tmp_path / "one_cache.py"
    script.write_text(ONE_CACHE)
    corpus = Path(__file__).parents[2] / "toolkit" / "corpus" / "corpus.txt"
    rc, log = run_ranks([script, corpus, tmp_path / "cache"], 2, timeout=120)
    assert rc == 0, log[-3000:]
    lines = sorted(line.split() for line in log.splitlines() if line.startswith("rank "))
    assert [int(line[3]) > 0 for line in lines] == [True, False], lines  # rank 0 tokenized, rank 1 did not
    assert lines[0][-1] == lines[1][-1]  # the same rows
