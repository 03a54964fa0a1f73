"""Training, floor 6 (imports `distributed` and below): the loop (`trainer.py`), the step and its executors, loss
weighting, the optimizer, loss scaling, the numerics monitor, checkpoints, metrics. Evaluation sits above: the
trainer is handed an evaluator, never imports one."""
