"""Closed-loop evaluation, floor 9 (imports `serving` and below: the policy runtime, in process or through a
server): a trained policy in Meta-World, success per task with Wilson intervals, and the evaluator `vlaforge train`
hands the trainer."""
