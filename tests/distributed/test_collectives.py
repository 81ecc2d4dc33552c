"""Every tensor dstk hands a collective lives on the engine's device (NCCL takes only tensors on the
current GPU; gloo, which these CPU runs use, takes CPU tensors too and hides the mistake). The runs
watch torch.distributed's collectives (scripts/watch_collectives.py) through training, mid-run and final
evaluation, checkpoints and the summary: every tensor is on the engine's device, and each collective dstk
calls itself goes through the helpers that make its tensors there (toolkit.distributed.process_group.all_reduce_sum,
all_gather_rows).
Object collectives (all_gather_object, ...) place their tensors on the current device themselves."""

import json
from pathlib import Path

import pytest

from tests.configs import SHORT_EVAL, run_config, write_config
from tests.distributed.launch import COMMON
from tests.ranks import run_ranks

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "scripts" / "watch_collectives.py"
HELPER = "toolkit/distributed/process_group.py"


@pytest.mark.parametrize("pp", [1, 2])
def test_every_collective_tensor_is_on_the_engines_device(tmp_path, pp):
    cfg = write_config(tmp_path / "ds.json", run_config(mbs=2, gas=2, pp=pp))
    args = ["--config", cfg, *COMMON, "--steps", "2", "--eval-every", "1", "--eval-fraction", SHORT_EVAL, "--no-export",
            "--out", tmp_path / "run"]
    rc, log = run_ranks([SCRIPT, tmp_path, *args], 2)
    assert rc == 0, log[-3000:]
    calls = [c for r in range(2) for c in json.loads((tmp_path / f"rank{r}.json").read_text())]
    off_device = [c for c in calls if any(d != c["engine"] for d in c["devices"])]
    assert not off_device, off_device[:5]
    ours = [c for c in calls if c["caller"].startswith(("toolkit/", "models/")) and not c["object"]]
    assert ours, "no collective of dstk's own was seen: the run evaluated nothing?"
    bypassing = [c for c in ours if not c["caller"].startswith(HELPER)]
    assert not bypassing, f"collectives called around {HELPER}'s all_reduce_sum: {bypassing[:5]}"
    # on each rank the helpers served the eval sums (at step 1 and the final eval), each step's gathered measures
    # (report.step_stats) and, at pp 1, each step's loss mean; at pp 2 (fp32, no clipping) each step's gradient norm;
    # and once the ranks' hosts and process ids (toolkit.distributed.resilience.know_peers)
    per_rank = 2 + 2 + 2 + 1
    assert sum(c["caller"].startswith(HELPER) for c in ours) == 2 * per_rank, [c["caller"] for c in ours]
    assert any(c["caller"].startswith("deepspeed/") for c in calls)  # the engine's own were watched too


WAIT = """
import datetime, sys, time
import torch.distributed as dist
from toolkit.distributed import process_group
process_group.init(cpu=True, timeout=datetime.timedelta(seconds=2))
group = process_group.patient_group() if sys.argv[1] == "patient" else None
if dist.get_rank() == 0:
    time.sleep(4)  # rank 0's long work (tokenizing, clearing a run folder): twice the group's timeout
dist.barrier(group=group)
print(f"rank {dist.get_rank()} waited", flush=True)
process_group.shutdown()
"""


@pytest.mark.parametrize("group", ["patient", "world"])
def test_ranks_waiting_for_rank_0_outlast_the_process_groups_timeout_in_the_patient_group(tmp_path, group):
    """toolkit.distributed.process_group.patient_group (where ranks wait for data preparation, a cleared run folder, a staged
    checkpoint, checkpoint files): rank 0 works for twice the world's timeout and nobody fails; the
    world group's own barrier does fail there (what the patient group is for)."""
    script = tmp_path / "wait.py"
    script.write_text(WAIT)
    rc, log = run_ranks([script, group], 2, timeout=60)
    if group == "patient":
        assert rc == 0 and sorted(log.split()).count("waited") == 2, log[-3000:]
    else:
        assert rc != 0 and "rank 1 waited" not in log, log[-3000:]  # rank 1 timed out in the world's barrier


SLOW_DATA = """
import datetime, sys, time
import torch.distributed as dist
from toolkit.distributed import process_group
from toolkit import data
from toolkit.train import hf
process_group.init(cpu=True, timeout=datetime.timedelta(seconds=2))
tokenizer = hf.byte_tokenizer()


class Slow:  # the tokenizers.Tokenizer behind it, slower than the group's timeout: 4 s at its first batch
    slept = False

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode_batch_fast(self, *args, **kwargs):
        if not Slow.slept:
            Slow.slept = True
            print(f"rank {dist.get_rank()} tokenizing slowly", flush=True)
            time.sleep(4)
        return self.inner.encode_batch_fast(*args, **kwargs)


tokenizer._tokenizer = Slow(tokenizer._tokenizer)
opts = data.DataOptions(path=sys.argv[1], seq_len=32, cache_dir=sys.argv[2])
prepared = data.prepare_once_per_node(opts, tokenizer)
print(f"rank {dist.get_rank()} rows {len(prepared.train)}", flush=True)
process_group.shutdown()
"""


def test_ranks_wait_for_a_slow_tokenizer_past_the_groups_timeout(tmp_path):
    """Local rank 0 tokenizes --data (4 s, twice the 2 s timeout of this world) while rank 1 waits for it in
    toolkit.data's exchange: nobody times out, rank 1 reads the same rows from the cache (it never tokenizes),
    and the preparing rank alone says what it did (toolkit.data.tokens.Progress)."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_DATA)
    rc, log = run_ranks([script, Path(__file__).parents[2] / "toolkit" / "corpus" / "corpus.txt", tmp_path / "cache"], 2,
                        timeout=120)
    assert rc == 0, log[-3000:]
    rows = sorted(line for line in log.splitlines() if line.startswith("rank ") and " rows " in line)
    assert len(rows) == 2 and rows[0].split()[-1] == rows[1].split()[-1], log[-3000:]
    assert log.count("tokenizing slowly") == 1 and "rank 0 tokenizing slowly" in log, log[-3000:]
    assert log.count("preparing --data: tokenizing corpus.txt: 700 rows, ") == 1, log[-3000:]
