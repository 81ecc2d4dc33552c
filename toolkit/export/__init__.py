"""A dstk checkpoint -> a HF directory that HF tools read.

    directory.py   `dstk export`: the entry point; full models, LoRA merges and PEFT adapters
    stream.py      sharded safetensors written about one layer at a time
    lora_merge.py  LoRA adapters merged into the base one tensor at a time
"""
