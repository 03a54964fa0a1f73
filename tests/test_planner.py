"""Planner foundations: the GPU catalog (built-in, overridden and extended from TOML), and model-state bytes per
component that equal the real tensors' after an optimizer step and the real FSDP2 x TP shards of an 8-rank
layout (fake process group)."""

from dataclasses import replace

import pytest
import torch

from vlaforge import COMPONENTS
from vlaforge.errors import VlaforgeError
from vlaforge.planner.activations import sequence_of
from vlaforge.planner.hardware import CATALOG, get_gpu, load_catalog
from vlaforge.planner.memory import model_state, per_gpu

from conftest import make_batch, tiny_config


def test_catalog_covers_the_issue_gpus_with_consistent_figures():
    for name in ("a100-40", "a100-80", "h100-80", "h100-pcie", "h200-141", "b200", "l40s", "rtx-4090"):
        g = CATALOG[name]
        assert g.memory_gb > 0 and g.bf16_tflops > 0 and g.hbm_gbps > 0 and g.inter_node_gbps > 0
    assert get_gpu("H100") is CATALOG["h100-80"] and get_gpu("h200").memory_gb == 141
    assert CATALOG["h200-141"].bf16_tflops == CATALOG["h100-80"].bf16_tflops  # same Hopper die, more/faster HBM
    with pytest.raises(VlaforgeError, match="a100-80 has no fp8 tensor cores"):  # refused, not costed at bf16
        CATALOG["a100-80"].tflops("fp8")
    assert CATALOG["h100-80"].launch_us > 0 and CATALOG["cpu"].launch_us == 0  # the launch floor: CUDA entries
    with pytest.raises(VlaforgeError, match="'v100' is not in the catalog"):
        get_gpu("v100")


def test_catalog_toml_overrides_and_adds(tmp_path):
    path = tmp_path / "gpus.toml"
    path.write_text('[gpu.h100-80]\ninter_node_gbps = 25\n\n[gpu.mi300x]\nmemory_gb = 192\nbf16_tflops = 1307\n'
                    'fp16_tflops = 1307\nfp8_tflops = 2615\nhbm_gbps = 5300\nintra_node_gbps = 448\n'
                    'inter_node_gbps = 50\npcie_gbps = 64\n')
    catalog = load_catalog(path)
    assert catalog["h100-80"].inter_node_gbps == 25 and catalog["h100-80"].memory_gb == 80
    assert get_gpu("mi300x", catalog).memory_gb == 192
    path.write_text("[gpu.new]\nmemory_gb = 10\n")
    with pytest.raises(VlaforgeError, match=r"new GPU \[gpu.new\] lacks"):
        load_catalog(path)
    path.write_text("[gpu.h100-80]\nmemroy_gb = 10\n")
    with pytest.raises(VlaforgeError, match="unknown fields"):
        load_catalog(path)


def _real_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("sections", [
    {},
    {"components": {"llm": {"precision": "bf16"}, "vision": {"precision": "fp32", "trainable": False}},
     "train": {"precision_master": "bf16"}},
], ids=["fp32", "bf16-master-frozen-vision"])
def test_state_bytes_equal_the_real_tensors_after_a_step(sections):
    from vlaforge.techniques.freezing import apply_freezing
    from vlaforge.training.optim import build_optimizer, build_scheduler
    from vlaforge.training.step import train_step
    from vlaforge.training.trainer import build_loss_weighting, build_model

    cfg = tiny_config(**sections)
    policies = dict(cfg.components.items())
    model, _ = build_model(cfg, torch.device("cpu"))
    apply_freezing(model, policies, 0)
    weighting = build_loss_weighting(cfg, model, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg)
    train_step(model, [make_batch(cfg, model)], optimizer, build_scheduler(optimizer, cfg.train), weighting, 1.0)
    planned = model_state(model, policies, cfg.train.precision_master)
    for comp in COMPONENTS:
        params = list(getattr(model, comp).parameters())
        state = [v for p in params for v in optimizer.state.get(p, {}).values()]
        got = planned.by_component[comp]
        assert (got.params, got.grads, got.optimizer) == (
            _real_bytes(params), _real_bytes(p.grad for p in params), _real_bytes(state)), comp
    if sections:
        assert planned.by_component["vision"].grads == 0 and planned.by_component["vision"].optimizer == 0
        llm = planned.by_component["llm"]
        assert llm.total == 8 * llm.numel + 4 * llm.tensors  # bf16 master: 2 weight + 2 grad + 4 moments
    else:
        total = planned.total
        assert total.total == 16 * total.numel + 4 * total.tensors  # fp32 master + AdamW: 16 bytes/parameter


def test_per_gpu_shares_match_fsdp2_and_tp_shards_on_eight_fake_ranks():
    """dp_shard = 4 x tp = 2 on a fake process group: each component's local parameter bytes on rank 0 equal the
    planner's share (FSDP2 pads dim 0 to the shard count: a 1-element tensor holds 1 element per rank)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vlaforge.distributed.parallel_dims import ParallelDims
    from vlaforge.distributed.parallelize import parallelize
    from vlaforge.training.trainer import build_model

    cfg = tiny_config(parallel={"tp": 2})
    policies = dict(cfg.components.items())
    model, _ = build_model(cfg, torch.device("cpu"))
    state = model_state(model, policies)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        dims = ParallelDims.build(cfg.parallel, 8)
        assert (dims.dp_shard, dims.tp) == (4, 2)
        parallelize(model, dims, dims.build_mesh("cpu"), policies)
        for comp in COMPONENTS:
            params = getattr(model, comp).parameters()
            local = _real_bytes((p.to_local() if isinstance(p, DTensor) else p) for p in params)
            want = per_gpu(state.by_component[comp], shard=4, tp=2).params
            assert abs(local - want) <= 4 * state.by_component[comp].tensors, comp  # < one padded row each
        assert per_gpu(state.by_component["llm"], shard=4, tp=2).params < state.by_component["llm"].params / 4
    finally:
        dist.destroy_process_group()


# NOTE: the block counts and FLOPs are exact per block and the planner multiplies a block by the model's own depth
# (`model.llm.config`, the tower's), so a deep flavor's count is checked at its shapes (widths, heads and GQA, patch
# size, vocabulary, connector) with SHALLOW blocks per stack: a fake forward costs ~1 ms per op on this CPU, and
# vla-70b's 140 blocks took 11 s per strategy. tiny keeps its 2 + 2 blocks; the whole-model criterion keeps `small`
# with one frame at its full depth (24 + 12).
SHALLOW = 3


def shallow(monkeypatch, flavor: str, depth: int = SHALLOW) -> None:
    """Flavor `flavor` with `depth` vision and LLM blocks for this test (its other shapes unchanged)."""
    from vlaforge.config.flavors import FLAVORS

    f = FLAVORS.get(flavor)
    monkeypatch.setitem(FLAVORS._items, flavor, replace(f, vision={**f.vision, "num_hidden_layers": depth},
                                                        llm={**f.llm, "num_hidden_layers": depth}))


def _measured_blocks(flavor: str, seq: int | None, precision: str, strategy: str, frames: int = 1,
                     full: bool = False, fake: bool = True):
    """The model, its accounting of one forward and the LLM's tokens per sample, under fake tensors (or real ones:
    `fake` False); `full`: the batch is marked as holding no padding (`Batch.full`: the model passes the LLM no
    mask and no positions)."""
    import contextlib

    from vlaforge.models.build import synthetic_batch, tokens_per_sample, with_seq_len
    from vlaforge.models.fake import fake_build
    from vlaforge.techniques import accounting as memory
    from vlaforge.training.trainer import build_model

    comps = {c: {"precision": precision} for c in COMPONENTS}
    for c in ("vision", "llm"):
        comps[c]["checkpointing"] = strategy
    model_cfg = {"flavor": flavor, "frames": frames} | ({} if flavor == "tiny" else {"image_size": None})
    cfg = with_seq_len(tiny_config(model=model_cfg, components=comps), seq)
    with fake_build() if fake else contextlib.nullcontext():
        model, _ = build_model(cfg, torch.device("cpu"))
        batch = synthetic_batch(cfg, model, 2)
        batch = replace(batch, full=True) if full else batch
        with memory.count_saved(model) as acc:
            model.compute_loss(batch)
        acc.sequence, acc.policies = sequence_of(model, batch), dict(cfg.components.items())
    text = 0 if batch.text_ids is None else batch.text_ids.shape[1]
    return model, acc, tokens_per_sample(model, batch.instruction_ids.shape[1], text)


@pytest.mark.parametrize("flavor, seq, precision", [("tiny", None, "fp32"), ("tiny", None, "bf16"),
                                                    ("small", 1024, "bf16")])
@pytest.mark.parametrize("strategy", ["none", "full", "selective", "selective_attn", "selective_ffn"])
def test_block_activation_bytes_equal_the_fake_tensor_accounting(flavor, seq, precision, strategy, monkeypatch):
    """Every LLM and vision block's saved bytes, derived from the architecture, equal what autograd keeps on the
    real modules (fake tensors), byte for byte; the first LLM block also holds the once-per-model tensors (small:
    SHALLOW blocks per stack, a first, a middle and a last)."""
    from vlaforge.planner.activations import block_bytes, llm_shape, once_bytes, vision_shape

    if flavor == "small":
        shallow(monkeypatch, flavor)
    model, acc, tokens = _measured_blocks(flavor, seq, precision, strategy)
    lay = model.layout
    for comp, shape, batch, length in (("llm", llm_shape(model.llm.config), 2, tokens),
                                       ("vision", vision_shape(model.vision), 2 * lay.frames,
                                        lay.patches_per_frame)):
        got = acc.per_block(comp)
        want = block_bytes(shape, batch, length, precision, strategy)
        assert all(got[str(i)] == want for i in range(1, len(got) - 1)), (comp, got, want)
        assert got["0"] == want + once_bytes(shape, batch, length, strategy), comp


@pytest.mark.parametrize("flavor, seq, precision, fake", [("tiny", None, "fp32", True), ("tiny", None, "bf16", True),
                                                          ("small", 1024, "bf16", True), ("tiny", None, "bf16", False)],
                         ids=["tiny-fp32", "tiny-bf16", "small-bf16", "tiny-bf16-real"])
@pytest.mark.parametrize("strategy", ["none", "full", "selective", "selective_attn", "selective_ffn"])
def test_unpadded_block_bytes_equal_the_accounting(flavor, seq, precision, fake, strategy, monkeypatch):
    """A batch known to hold no padding (`Batch.full`): the VLA passes the LLM no mask and no positions, SDPA runs
    `is_causal` and takes K and V at their own heads (`enable_gqa`; GQA 4/2 in tiny, 14/2 in small): the unpadded rows
    - no B x S x S mask, K/V at Hk heads, one row of rotary tables - equal what autograd keeps, block by block, and
    the LLM component whole; the padded rows are larger by the mask and the repeated K/V. Under fake tensors
    transformers 5.25 would still build a mask that a real run does not (it treats the fake default positions and
    `cache_position` offset as traced, so it cannot see that they hold one sequence per row and no cache): the fake
    runs take the real run's decisions; the `-real` case, on real tensors and unpatched, is the same count."""
    import transformers.masking_utils

    from vlaforge.planner.activations import block_bytes, llm_shape, model_activation_bytes, once_bytes, vision_shape

    if fake:  # one sequence per row (no packing), no padding mask, no cache: no mask, as on real tensors
        monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
        monkeypatch.setattr(transformers.masking_utils, "_ignore_causal_mask_sdpa",
                            lambda padding_mask, q_length, kv_length, *a, **k: padding_mask is None)
    if flavor == "small":  # SHALLOW blocks per stack: a first, a middle and a last
        shallow(monkeypatch, flavor)
    model, acc, tokens = _measured_blocks(flavor, seq, precision, strategy, full=True, fake=fake)
    assert not acc.sequence.padded
    lay = model.layout
    for comp, shape, batch, length, kv in (("llm", llm_shape(model.llm.config), 2, tokens, 0),
                                           ("vision", vision_shape(model.vision), 2 * lay.frames,
                                            lay.patches_per_frame, None)):
        got = acc.per_block(comp)
        want = block_bytes(shape, batch, length, precision, strategy, kv_seq=kv)
        assert all(got[str(i)] == want for i in range(1, len(got) - 1)), (comp, got, want)
        assert got["0"] == want + once_bytes(shape, batch, length, strategy, kv_seq=kv, shared_positions=True), comp
    whole = model_activation_bytes(model, acc.sequence, acc.policies, model.objective.active("contrastive"))
    assert acc.per_component()["llm"] == whole["llm"]
    padded = model_activation_bytes(model, replace(acc.sequence, padded=True), acc.policies)
    assert padded["llm"] > whole["llm"]


@pytest.mark.parametrize("kind", ["llama", "siglip"])
def test_eager_block_launches_are_the_planner_s_count(kind):
    """The launch floor's eager count per block (planner/launches.py): the aten compute ops one block's forward and
    backward dispatch (views and metadata queries excluded), on tiny's real blocks under bf16 autocast, no mask."""
    from vlaforge.planner.launches import BLOCK_KERNELS

    block, call = _tiny_block(kind, padded=False)
    fwd, bwd = _OpCount(), _OpCount()
    h = call.input()
    with fwd, torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(block, h)
    grad = torch.ones_like(out)
    with bwd:
        out.backward(grad)
    assert (fwd.n, bwd.n) == BLOCK_KERNELS[(kind, False)]


@pytest.mark.slow
@pytest.mark.parametrize("kind, precision, padded", [("llama", "bf16", False), ("llama", "fp32", False),
                                                     ("llama", "bf16", True), ("siglip", "bf16", False)])
def test_compiled_blocks_save_what_the_planner_counts(kind, precision, padded):
    """`train.compile`: one block compiled with torch.compile (inductor) saves for backward what `block_bytes(...,
    compiled=True)` counts, byte for byte: its compiled autograd.Function's saved tensors, seen through
    `saved_tensors_hooks`, less the parameters, the rotary cos / sin and the mask input, with the weight casts apart
    (they are planned as autocast casts, `PlanModel.cast_numel`)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from vlaforge.planner.activations import block_bytes, llm_shape

    # NOTE: a graph an earlier test of this process compiled for another shape of the same block class would make
    # torch.compile recompile with dynamic shapes, which saves other tensors: start from a clean cache
    torch._dynamo.reset()
    block, call = _tiny_block(kind, padded)
    params = {StorageWeakRef(p.untyped_storage()) for p in block.parameters()}
    shapes = {tuple(p.shape[::d]) for p in block.parameters() for d in (1, -1) if p.dim() == 2}
    inputs = {StorageWeakRef(t.untyped_storage()) for t in call.keep}
    compiled = torch.compile(block)
    c = torch.bfloat16 if precision == "bf16" else torch.float32

    def saved() -> tuple[int, int]:
        acts, casts, seen = 0, 0, set()

        def pack(t):
            key = StorageWeakRef(t.untyped_storage())
            if key not in seen and key not in params and key not in inputs:
                seen.add(key)
                if tuple(t.shape) in shapes and t.dtype == c:
                    nonlocal casts
                    casts += t.untyped_storage().nbytes()
                else:
                    nonlocal acts
                    acts += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = call(compiled)
        out.float().sum().backward()
        return acts, casts

    saved()  # compiles
    acts, casts = saved()
    shape = llm_shape(block.self_attn.config) if kind == "llama" else vision_shape_of(block)
    want = block_bytes(shape, call.batch, call.seq, precision, "none", kv_seq=None if padded else 0, compiled=True)
    assert acts == want, (acts, want)
    assert casts == (2 * sum(p.numel() for p in block.parameters() if p.dim() == 2) if precision == "bf16" else 0)
    if kind == "llama" and not padded:
        eager = block_bytes(shape, call.batch, call.seq, precision, "none", kv_seq=0)
        assert acts < 0.8 * eager  # what the partitioner recomputes instead of saving


def vision_shape_of(block):
    from vlaforge.planner.activations import BlockShape

    cfg = block.self_attn.config
    heads = cfg.num_attention_heads
    return BlockShape("siglip", cfg.hidden_size, cfg.intermediate_size, heads, heads, cfg.hidden_size // heads)


class _OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Aten compute ops dispatched (a kernel each on a GPU); views, allocations and metadata queries excluded."""

    FREE = {"detach", "view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "slice",
            "select", "split", "split_with_sizes", "alias", "as_strided", "reshape", "_reshape_alias", "unbind",
            "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "sym_size",
            "sym_numel", "sym_stride", "is_same_size", "device", "_local_scalar_dense", "resolve_conj", "resolve_neg",
            "result_type", "size", "stride", "dim"}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in self.FREE:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _tiny_block(kind: str, padded: bool):
    """A block of tiny's shapes (real tensors, seeded) and a call of it on an input that needs a gradient: (block,
    call(module) -> output), the call carrying `batch`, `seq` and the inputs it keeps (`keep`: rotary, mask)."""
    from transformers import LlamaConfig, SiglipVisionConfig
    from transformers.masking_utils import sdpa_mask
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from transformers.models.siglip.modeling_siglip import SiglipEncoderLayer

    from vlaforge.config.flavors import FLAVORS

    torch.manual_seed(0)
    tiny = FLAVORS.get("tiny")
    batch, seq = 3, 40  # 120 tokens: no activation is shaped like a weight
    if kind == "llama":
        cfg = LlamaConfig(**tiny.llm)
        cfg._attn_implementation = "sdpa"
        block = LlamaDecoderLayer(cfg, 0)
        x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)
        rope = tuple(t.detach() for t in LlamaRotaryEmbedding(cfg)(x, torch.arange(seq)[None].expand(batch, seq)))
        mask = None
        if padded:
            keep = torch.ones(batch, seq, dtype=torch.bool)
            keep[:, seq // 2] = False
            mask = sdpa_mask(batch_size=batch, q_length=seq, kv_length=seq, attention_mask=keep,
                             allow_is_causal_skip=False)

        def call(module, h):
            out = module(h, attention_mask=mask, position_embeddings=rope)
            return out[0] if isinstance(out, tuple) else out
        kept = [*rope] + ([mask] if mask is not None else [])
    else:
        cfg = SiglipVisionConfig(**{k: v for k, v in tiny.vision.items() if k not in ("image_size", "patch_size")})
        cfg._attn_implementation = "sdpa"
        block = SiglipEncoderLayer(cfg)
        x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)

        def call(module, h):
            out = module(h, attention_mask=None)
            return out[0] if isinstance(out, tuple) else out
        kept = []
    return block, _Call(call, x, batch, seq, kept)


class _Call:
    """A block's call on its fixed inputs: `batch` sequences of `seq` tokens from `x` (a leaf that needs a gradient;
    the block gets a non-leaf copy, as block i gets block i - 1's output), keeping `keep` (rotary, mask) alive."""

    def __init__(self, fn, x, batch, seq, keep):
        self.fn, self.x, self.batch, self.seq, self.keep = fn, x, batch, seq, keep

    def input(self) -> torch.Tensor:
        return self.x * 1.0

    def __call__(self, module, h: torch.Tensor | None = None):
        return self.fn(module, self.input() if h is None else h)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_conv_stem_s_activation_bytes_equal_the_accounting(precision):
    """model.vision_stem = 'conv': the planner's vision bytes (the stem's stages included) equal what autograd keeps
    on the real modules (fake tensors), byte for byte."""
    from vlaforge.models.build import synthetic_batch
    from vlaforge.models.fake import fake_build
    from vlaforge.planner.activations import model_activation_bytes
    from vlaforge.techniques import accounting as memory
    from vlaforge.training.trainer import build_model

    comps = {c: {"precision": precision} for c in COMPONENTS}
    got = {}
    for stem in ("patch", "conv"):
        cfg = tiny_config(model={"vision_stem": stem}, components=comps)
        with fake_build():
            model, _ = build_model(cfg, torch.device("cpu"))
            batch = synthetic_batch(cfg, model, 2)
            with memory.count_saved(model) as acc:
                model.compute_loss(batch)
        want = model_activation_bytes(model, sequence_of(model, batch), dict(cfg.components.items()),
                                      model.objective.active("contrastive"))
        got[stem] = acc.per_component()["vision"]
        assert got[stem] == want["vision"], stem
    assert got["conv"] > got["patch"]  # the stem's feature maps


@pytest.mark.slow
@pytest.mark.parametrize("flavor", ["tiny", "small", "vla-7b", "vla-30b", "vla-70b", "smolvla_vlm"])
@pytest.mark.parametrize("frames", [1, 4])
def test_whole_model_activation_bytes_within_5_percent_of_fake_measurement(flavor, frames, monkeypatch):
    """The issue's criterion: every flavor x strategy (none, full, selective) x frames (1, 4) at 8k tokens (tiny:
    its own length) - the analytic total within 5 % of the fake-tensor count (it is within 0.3 %: the blocks and
    every component are exact, the loss terms' small tensors are approximated). tiny at its depth, small at its
    full depth with one frame; the others at their shapes with SHALLOW blocks per stack."""
    from vlaforge.planner.activations import model_activation_bytes

    if flavor != "tiny" and (flavor, frames) != ("small", 1):
        shallow(monkeypatch, flavor)
    for strategy in ("none", "full", "selective"):
        model, acc, tokens = _measured_blocks(flavor, None if flavor == "tiny" else 8192, "bf16", strategy,
                                              frames=frames)
        seq = acc.sequence
        assert seq.llm_tokens == tokens
        policies = {c: acc.policies[c] for c in COMPONENTS}
        want = model_activation_bytes(model, seq, policies, model.objective.active("contrastive"))
        got = acc.per_component()
        for comp in ("vision", "projector", "llm", "action_head"):
            assert got[comp] == want[comp], (strategy, comp)
        assert sum(want.values()) == pytest.approx(sum(got.values()), rel=0.05), strategy


def _counted_flops(flavor: str, seq: int | None, components: dict):
    from torch.utils.flop_counter import FlopCounterMode

    from vlaforge.models.build import synthetic_batch, with_seq_len
    from vlaforge.models.fake import fake_build
    from vlaforge.techniques.freezing import apply_freezing
    from vlaforge.training.trainer import build_model

    model_cfg = {"flavor": flavor} | ({} if flavor == "tiny" else {"image_size": None})
    comps = {c: {"precision": "bf16"} | components.get(c, {}) for c in COMPONENTS}
    cfg = with_seq_len(tiny_config(model=model_cfg, components=comps), seq)
    with fake_build():
        model, _ = build_model(cfg, torch.device("cpu"))
        apply_freezing(model, dict(cfg.components.items()), 0)
        batch = synthetic_batch(cfg, model, 2)
        with FlopCounterMode(display=False) as forward:
            loss, _ = model.compute_loss(batch)
        with FlopCounterMode(display=False) as backward:
            loss.backward()
    return (model, sequence_of(model, batch), dict(cfg.components.items()), forward.get_total_flops(),
            backward.get_total_flops())


@pytest.mark.parametrize("flavor, seq, components", [
    *[("tiny", None, {"vision": {"checkpointing": s}, "llm": {"checkpointing": s}})
      for s in ("none", "full", "selective", "selective_attn", "selective_ffn")],
    ("tiny", None, {"vision": {"trainable": False, "checkpointing": "full"}, "llm": {"checkpointing": "selective"}}),
    ("vla-7b", 4096, {"llm": {"checkpointing": "full"}}),
    # SmolVLA's pixel shuffle + one linear: 1024 tower patches per image, 64 LLM tokens; frozen tower: the linear's
    # input gradient is not computed
    ("smolvla_vlm", 1024, {"vision": {"checkpointing": "full"}}),
    ("smolvla_vlm", 1024, {"vision": {"trainable": False}}),
], ids=["none", "full", "selective", "selective_attn", "selective_ffn", "frozen-vision", "vla-7b-full", "smolvla-full",
        "smolvla-frozen-vision"])
def test_step_flops_equal_the_flop_counter(flavor, seq, components, monkeypatch):
    """Matmul FLOPs forward and backward (recomputation included) equal torch's FlopCounterMode on the real modules:
    checkpointing recomputes a region without its last matmul, frozen components skip their gradients (vla-7b and
    SmolVLA's VLM at their shapes, SHALLOW blocks per stack)."""
    from vlaforge.planner.throughput import step_flops

    if flavor != "tiny":
        shallow(monkeypatch, flavor)
    model, sequence, policies, forward, backward = _counted_flops(flavor, seq, components)
    flops = step_flops(model, sequence, policies, model.objective.active("contrastive"))
    assert sum(flops.forward.values()) == forward
    assert sum(flops.backward.values()) + sum(flops.recompute.values()) == backward


def test_model_flops_agree_with_the_6n_rule_for_an_llm_dominated_model():
    """vla-7b at 4096 tokens: the step's matmul FLOPs are within 2 % of 6 x LLM-block parameters x tokens (the rest
    is the vision tower, projector, heads), and the LLM's attention cores add PaLM's 12 x layers x B x S^2 x hidden
    (17 % more at this length: why the 6N rule undercounts long sequences); MFU follows from a step time."""
    from vlaforge.models.build import synthetic_batch, with_seq_len
    from vlaforge.models.fake import fake_build
    from vlaforge.planner.hardware import get_gpu
    from vlaforge.planner.throughput import mfu, step_flops
    from vlaforge.training.trainer import build_model

    # the planner's arithmetic on the whole vla-7b (its 32 LLM blocks: the rule is about their share); that it equals
    # the FLOP counter is test_step_flops_equal_the_flop_counter's, so no forward runs here
    cfg = with_seq_len(tiny_config(model={"flavor": "vla-7b", "image_size": None},
                                   components={c: {"precision": "bf16"} for c in COMPONENTS}), 4096)
    with fake_build():
        model, _ = build_model(cfg, torch.device("cpu"))
        sequence, policies = sequence_of(model, synthetic_batch(cfg, model, 2)), dict(cfg.components.items())
    flops = step_flops(model, sequence, policies)
    params = sum(p.numel() for p in model.llm.model.layers.parameters())
    rule = 6 * params * sequence.batch * sequence.llm_tokens
    attention = sum(flops.attention.values())
    assert flops.model_flops - attention == pytest.approx(rule, rel=0.02)
    cfg = model.llm.config
    palm = 12 * cfg.num_hidden_layers * sequence.batch * sequence.llm_tokens ** 2 * cfg.hidden_size
    assert flops.attention["llm"] == palm and attention / rule > 0.15
    h100 = get_gpu("h100-80")
    assert mfu(flops, steps_per_s=1.0, gpus=8, peak_tflops=h100.bf16_tflops) == pytest.approx(
        flops.model_flops / (8 * 989e12))



def test_measure_puts_analytic_and_fake_measurement_side_by_side():
    from vlaforge.planner.measure import side_by_side

    cfg = tiny_config(components={"llm": {"precision": "bf16", "checkpointing": "selective"}})
    report = side_by_side(cfg, batch_size=2)
    rows = report["by_component"]
    assert all(rows[c]["analytic"] == rows[c]["measured"] for c in COMPONENTS)  # components exact
    assert report["activations"]["ratio"] == pytest.approx(1.0, abs=0.01)
    assert report["weight_casts_measured"] > 0  # the bf16 LLM's weight copies, measured (not yet modeled)
    assert report["state"] == sum(r["state"] for r in rows.values())
