"""Kernel launches per micro-batch and the host time they take: the floor under a step's time. A training step's
host thread runs Python, the dispatcher and autograd for every kernel it launches while the GPU works through the
queue; when the GPU finishes its kernels faster than the host launches them, the host sets the pace. The first H100
run (2026-12-06, `small`, bf16, `train.compile`) was there at micro-batch 4 x 512 tokens: a profile gave ~2,900
kernel launches and ~22 ms of kernel time in a 97 ms step (83 ms unprofiled).

Launches counted per block, forward + backward, from the real modules on CPU (torch 2.13, transformers 5.25):
eager, the aten compute ops a dispatch mode sees (views and metadata queries are no kernels) - a Llama block (GQA,
no mask) 48 + 88 = 136, a SigLIP block 28 + 45 = 73; compiled, the kernel calls in inductor's generated code for
one block's forward and backward graphs (fused kernels, the matmuls, SDPA) - Llama 17 + 25 = 42, SigLIP 14 + 22 =
36. Outside the blocks `small` dispatches 149 forward and 172 backward ops (embeddings, projector, heads, losses);
the step adds the gradient norms, clipping and fused AdamW (~20 ops; fused AdamW is one op per parameter group).
A torchao fp8 linear adds, per linear, 62 (tensorwise) or 80 (rowwise) ops eager (amax, scale and cast of input,
weight and gradient, forward and backward) and 3 kernels compiled (inductor fuses each amax with its cast).
Qwen2.5-VL's tower is counted as Llama's block (RMSNorm, SwiGLU, rotary), unmeasured. Parallelism, counted the same
way on rank 0 of a fake 8-rank process group (tiny): FSDP2 adds 10 ops per sharded unit (its two all-gathers with
their copy-in and split, the reduce-scatter with its chunk-cat, copies), tensor parallel 7 all-reduces per LLM
block; on 2 and 4 gloo ranks, one causal attention call forward + backward is 5 ops as plain SDPA, 77 / 159 as ring
attention (31 + 41 per extra rank beyond plain), 26 / 24 as Ulysses and 25 as all-gather (20 beyond plain).

The host seconds per launch are the catalog's `launch_us`: for the CUDA entries 43.5 us, fitted to the H100 run's
83 ms step at 4 x 512 tokens - less the 5.6 ms the planner gives its optimizer step, which runs after the last
launch - over the 1,781 launches this count gives for that configuration. That run's foreach AdamW and its graph
breaks at every decoder layer (since removed) cost host time the count does not see, so the figure is high for a
run without them. CUDA's own launch latency is a few microseconds of it; the rest is Python and framework overhead.
"""

from __future__ import annotations

from vlaforge.techniques.freezing import ever_trains

# (block kind, compiled) -> (forward, backward) kernel launches of one block
BLOCK_KERNELS = {("llama", False): (48, 88), ("llama", True): (17, 25), ("siglip", False): (28, 45),
                 ("siglip", True): (14, 22), ("qwen_vit", False): (48, 88), ("qwen_vit", True): (17, 25)}
OUTSIDE_BLOCKS = 149 + 172  # small's ops outside the blocks, forward + backward
STEP_OPS = 20  # gradient norms, clipping, fused AdamW: once per optimizer step
# train.step_in_backward: per trained parameter tensor, its norm, the finiteness check and its own fused AdamW step
# (the step counter's add and subtract, the kernel) - 11.6 ops per tensor over the plain step's, counted by a
# dispatch mode on the tiny flavor (bench/step_in_backward.py)
IN_BACKWARD_OPS = 12
FP8_EXTRA = {(False, "tensorwise"): 62, (False, "rowwise"): 80, (True, "tensorwise"): 3, (True, "rowwise"): 3}
LINEARS_PER_BLOCK = 7  # a Llama block's q, k, v, o, gate, up, down (what torchao's fp8 converts in the LLM)
FSDP_UNIT = 10  # FSDP2's launches per sharded unit (a block, the root)
TP_BLOCK = 7  # tensor parallel's all-reduces per LLM block
CP_ATTENTION = {"ring": (31, 41), "ulysses": (20, 0), "allgather": (20, 0)}  # (beyond SDPA, per extra rank)
FP8_LINEAR_S = 3.8e-6  # fixed device seconds of one fp8 linear's casts, forward + backward (fp8_linear_seconds)


def block_launches(kind: str, compiled: bool, strategy: str) -> float:
    """One block's launches per micro-batch, its recomputation included (`full` reruns the forward, the selective
    strategies about half of it)."""
    fwd, bwd = BLOCK_KERNELS[(kind if (kind, compiled) in BLOCK_KERNELS else "llama", compiled)]
    again = {"none": 0.0, "full": 1.0}.get(strategy, 0.5)
    return fwd * (1 + again) + bwd


def micro_launches(pm, case, stage: int) -> float:
    """Kernel launches of one micro-batch's forward and backward on a GPU of pipeline stage `stage`."""
    from vlaforge.planner.activations import vision_shape

    compiled = case.cfg.train.compile
    a, b = case.bounds[stage]
    llm = case.policies["llm"]
    n = (b - a) * block_launches("llama", compiled, llm.checkpointing)
    if llm.precision == "fp8":
        n += (b - a) * LINEARS_PER_BLOCK * FP8_EXTRA[(compiled, llm.fp8_recipe)]
    units = b - a
    if stage == 0:
        vis = case.policies["vision"]
        layers = pm.model.vision.config.num_hidden_layers
        n += layers * block_launches(vision_shape(pm.model.vision).kind, compiled, vis.checkpointing)
        units += layers + 1
    if case.fsdp:
        n += FSDP_UNIT * units
    if case.tp > 1:
        n += TP_BLOCK * (b - a)
    if case.cp > 1:
        base, per_rank = CP_ATTENTION.get(case.method, CP_ATTENTION["ring"])
        n += (b - a) * (base + per_rank * (case.cp - 1))
    return n + OUTSIDE_BLOCKS / case.pp


def step_launches(case) -> float:
    """The optimizer step's launches: a few for the whole step, or with the step inside backward
    (`train.step_in_backward`) `IN_BACKWARD_OPS` for every trained parameter tensor."""
    if not case.cfg.train.step_in_backward:
        return STEP_OPS
    return IN_BACKWARD_OPS * sum(s.tensors for c, s in case.state.by_component.items()
                                 if ever_trains(case.policies[c]))


def host_seconds(pm, case, gpu, stage: int) -> float:
    """Host seconds of one micro-batch's launches on `stage`'s GPU (the optimizer step's ops are counted with the
    first micro-batch: they run against its HBM-bound kernels, or inside the last one's backward)."""
    return (micro_launches(pm, case, stage) + step_launches(case) / case.accum) * gpu.launch_us * 1e-6


def fp8_linear_seconds(m: float, k: float, n: float, gpu, assume, weight_bytes: int = 4,
                       recipe: str = "tensorwise") -> tuple[float, float]:
    """(fp8 seconds, bf16 seconds) of one linear's three GEMMs (forward, input and weight gradients) over `m` tokens,
    `k` in and `n` out features, its weight stored in `weight_bytes` (the master dtype). The model is torchao's own
    account of when float8 pays (torchao/float8/README.md, "Derivation": bf16 GEMM time against fp8 GEMM time plus the
    casts' overhead): the GEMMs at `fp8_efficiency` of the fp8 peak, plus the casts at the HBM bandwidth, plus
    `FP8_LINEAR_S` of fixed device time per linear (the cast kernels' own). Casts: tensorwise reads each tensor (the
    input m x k and output gradient m x n in bf16, the weight) once for its amax and once to write it in fp8 in both
    layouts the GEMMs read (6 bytes per bf16 element); rowwise scales each along both of its axes, one per GEMM that
    reads it (two amax passes and two casts: 10 bytes per bf16 element). `fp8_efficiency` 0.47 and `FP8_LINEAR_S`
    3.8 us are fitted to the two points of torchao's H100 table its README quotes (tensorwise, bf16 weights: 0.80x
    bf16's speed at M, K, N = 1024, 2048, 1024 and 1.39x at 4096, 8192, 16384). Where fp8 does not pay, this costs
    more than bf16's time, and the search ranks it below."""
    flops = 3 * 2 * m * k * n
    bf16 = flops / (gpu.bf16_tflops * 1e12 * assume.matmul_efficiency)
    if recipe == "rowwise":
        casts = 10 * m * k + (4 * weight_bytes + 2) * k * n + 10 * m * n
    else:
        casts = 6 * m * k + (2 * weight_bytes + 2) * k * n + 6 * m * n
    fp8 = flops / (gpu.fp8_tflops * 1e12 * assume.fp8_efficiency) + casts / (gpu.hbm_gbps * 1e9) + FP8_LINEAR_S
    return fp8, bf16


def fp8_block_seconds(pm, case, gpu, assume, tokens: float) -> tuple[float, float]:
    """(fp8 seconds, bf16 seconds) of one LLM block's seven linears over `tokens` (its tp shares)."""
    dims, tp = pm.llm_dims, case.tp
    D, F, d = dims.hidden, dims.ffn // tp, dims.head_dim
    q, kv = dims.heads * d // tp, max(1, dims.kv_heads // tp) * d
    master = compute_master_bytes(case)
    shapes = ((D, q), (D, kv), (D, kv), (q, D), (D, F), (D, F), (F, D))
    recipe = case.policies["llm"].fp8_recipe
    both = [fp8_linear_seconds(tokens, k, n, gpu, assume, master, recipe) for k, n in shapes]
    return sum(f for f, _ in both), sum(b for _, b in both)


def compute_master_bytes(case) -> int:
    return 4 if case.cfg.train.precision_master == "fp32" else 2
