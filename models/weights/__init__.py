"""Where a model's weights come from, and how they are read.

    source.py      a live model or a directory read per pipeline stage; the one check that a path is a HF model folder
    conversion.py  the files' tensor names <-> the model's (transformers' conversion mapping; MoE experts per expert)
    loading.py     an HF model built or loaded in the dtype the run trains it in
    hub.py         a hub id (org/name) -> its snapshot folder in huggingface_hub's cache
"""
