"""Closed-loop evaluation, floor 7 (imports `training` and below: checkpoints): a trained policy in Meta-World,
success per task with Wilson intervals, and the evaluator `vlaforge train` hands the trainer."""
