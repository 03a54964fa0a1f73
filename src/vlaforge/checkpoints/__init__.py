"""Checkpoints, floor 6 (imports `distributed` and below): every checkpoint kind vlaforge writes and reads - full,
sharded (DCP), LoRA adapters over a rebuilt base, quantized, a teacher's - and the one resolver that turns a run
folder, `latest` or a checkpoints/step_* folder into the checkpoint and its config. It sits below `training` and
`inference`, so the runtime, export and serving load checkpoints without importing the trainer's floor."""
