"""Training, floor 7 (imports `checkpoints` and below; `inference` shares the floor and neither imports the other): the
loop (`trainer.py`), the run's pieces (`run.py`), saving and resuming them (`saving.py`), the step and its executors,
loss weighting, the optimizer, loss scaling, the numerics monitor, metrics, distillation. Evaluation sits above: the
trainer is handed an evaluator, never imports one."""
