"""Scale-out on torch.distributed: the layout (`ParallelDims`), meshes and parallelization of the VLA."""
