"""Training: losses, loss weighting, optimizer, the step, checkpoints, metrics and the loop."""
