"""Scale-out, floor 5 (imports `techniques` and below): the layout (`ParallelDims`) and its rules
(`check_layout`), process groups and meshes, tensor / context / pipeline / data parallel, DeepSpeed, full and
sharded state dicts, and `apply.apply_techniques`, the one function that applies every technique in order."""
