"""Closed-loop evaluation, floor 8 (imports `inference` and below: the policy runtime): a trained policy in Meta-World,
success per task with Wilson intervals, and the evaluator `vlaforge train` hands the trainer."""
