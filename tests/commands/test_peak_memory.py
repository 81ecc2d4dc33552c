"""`dstk export`'s peak resident memory, measured on child processes (getrusage through a small wrapper):
streaming a 200M-parameter pipeline checkpoint stays near one layer above the baseline. The export's
tensors and refusals: tests/unit/test_export_stream.py."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.unit.test_export_stream import fabricate_pipeline_checkpoint, gpt2

WRAPPER = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def peak_rss_mib(argv: list) -> float:
    """Run argv; its peak resident set in MiB. Measured by a small wrapper process (getrusage of its
    one child): a child forked from this big pytest process would carry our resident set into its
    ru_maxrss (Linux keeps the pre-exec high-water mark)."""
    result = subprocess.run([sys.executable, "-c", WRAPPER, *map(str, argv)], capture_output=True, text=True,
                            env={**os.environ, "DS_ACCELERATOR": "cpu"}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return int(result.stdout.split()[-1]) / 1024  # Linux: KiB


def dstk_export(*args):
    return [sys.executable, "-m", "toolkit.cli", "export", *map(str, args)]


@pytest.mark.heavy  # ~30 s: a 200M-parameter pipeline checkpoint written and exported
def test_streaming_export_of_a_200m_pipeline_checkpoint_peaks_near_one_layer(tmp_path):
    """A 202M-parameter GPT-2 (16 blocks of 1024, byte vocabulary: 808 MB in fp32) at pp = 2.

    bound = baseline + 3 x largest layer, where baseline is the peak RSS of the same `dstk export`
    on a 2-block, 64-wide GPT-2 checkpoint (the interpreter with torch, transformers, safetensors
    and dstk imported, the tokenizer and config written: everything but the weights) and the
    largest layer is the largest layer file's tensor bytes (one block: 50.4 MB). The whole-model
    export of the same checkpoint must pass the bound (it holds the state dict and the model);
    the streamed shards must load with from_pretrained and give the whole export's logits exactly."""
    from transformers import AutoModelForCausalLM

    from toolkit.train import hf

    tok = hf.byte_tokenizer()
    fabricate_pipeline_checkpoint(gpt2(64, 2, tok), tok, tmp_path / "tiny" / "checkpoints", pp=2)
    model = gpt2(1024, 16, tok)
    n_params = sum(p.numel() for p in model.parameters())
    fabricate_pipeline_checkpoint(model, tok, tmp_path / "big" / "checkpoints", pp=2)
    del model
    layer_files = sorted((tmp_path / "big" / "checkpoints" / "global_step1").glob("layer_*-model_states.pt"))
    largest = max(sum(t.numel() * t.element_size() for t in torch.load(f, mmap=True).values()) for f in layer_files)

    imports = peak_rss_mib([sys.executable, "-c", "import torch, transformers, safetensors"])
    baseline = peak_rss_mib(dstk_export(tmp_path / "tiny", tmp_path / "tiny_hf"))
    streamed = peak_rss_mib(dstk_export(tmp_path / "big", tmp_path / "streamed", "--max-shard-size", "200MB"))
    whole = peak_rss_mib([sys.executable, "-c", "from toolkit.export.directory import export; "
                          f"export({str(tmp_path / 'big')!r}, {str(tmp_path / 'whole')!r}, stream=False)"])
    bound = baseline + 3 * largest / 2**20
    report = (f"{n_params / 1e6:.0f}M params, largest layer {largest / 2**20:.1f} MiB; peak RSS MiB: imports "
              f"{imports:.0f}, baseline {baseline:.0f}, streamed {streamed:.0f}, bound {bound:.0f}, whole {whole:.0f}")
    print(report)
    assert 190e6 < n_params < 210e6 and streamed < bound < whole, report

    index = json.loads((tmp_path / "streamed" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and index["metadata"]["total_size"] == n_params * 4
    assert all((tmp_path / "streamed" / f).stat().st_size < 200e6 + 2**16 for f in shards)  # + the header
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed")(ids).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "whole")(ids).logits
    assert torch.equal(a, b)


@pytest.mark.heavy  # three exports of a 386 MiB model: minutes
def test_streamed_lora_merge_peaks_near_one_layer(tmp_path, monkeypatch):
    """A LoRA run of a 6-block Llama (hidden 1024, MLP 4096: 64 MiB per block in fp32, 386 MiB in all)
    whose base is a --model directory: `dstk export` merges the adapters into it tensor by tensor.

    bound = baseline + 3 x one block, baseline being the peak RSS of the same export of a 2-block,
    64-wide run (everything but the weights). The whole-model export (stream=False: the base loaded
    by from_pretrained, wrapped by peft, merged) must pass the bound; both write the same tensors.
    glibc's malloc keeps freed tensors below its dynamic mmap threshold (which rises to 32 MiB) in
    its heap, some 3 blocks more at the peak here whatever export holds: the exports run with the
    threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_), so the peak measures what export holds."""
    from tests.unit.test_export_lora import fabricate_lora_checkpoint
    from tests.unit.test_export_stream import read_weights
    from toolkit.train import hf

    tok = hf.byte_tokenizer()
    small = hf.builtin_model("tiny-llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    fabricate_lora_checkpoint(small, tok, tmp_path / "tiny", tmp_path / "tiny_base")
    model = hf.builtin_model("tiny-llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=6,
                             num_attention_heads=16, num_key_value_heads=16)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    block = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    fabricate_lora_checkpoint(model, tok, tmp_path / "big", tmp_path / "big_base")
    del model

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(2**20))
    baseline = peak_rss_mib(dstk_export(tmp_path / "tiny", tmp_path / "tiny_hf"))
    streamed = peak_rss_mib(dstk_export(tmp_path / "big", tmp_path / "streamed", "--max-shard-size", "100MB"))
    whole = peak_rss_mib([sys.executable, "-c", "from toolkit.export.directory import export; "
                          f"export({str(tmp_path / 'big')!r}, {str(tmp_path / 'whole')!r}, stream=False)"])
    bound = baseline + 3 * block / 2**20
    report = (f"model {total / 2**20:.0f} MiB, block {block / 2**20:.1f} MiB; peak RSS MiB: baseline {baseline:.0f}, "
              f"streamed {streamed:.0f}, bound {bound:.0f}, whole {whole:.0f}")
    print(report)
    assert streamed < bound < whole, report
    a, b = read_weights(tmp_path / "streamed"), read_weights(tmp_path / "whole")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
