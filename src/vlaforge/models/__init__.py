"""The VLA, floor 3 (imports `config`, `data` and below): the four components and their composition, the loss
terms the model computes (`losses.py`: the model's `compute_loss` owns them), model structure (`blocks.py`), action
heads, Hugging Face loading (towers and LMs per family: `vision.py`, `families.py`; whole VLMs: `vlm.py`) and
`build_vla`. Knows nothing of parallelism, precision or memory techniques."""
