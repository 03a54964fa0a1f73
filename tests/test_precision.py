import torch
from torch import nn

from vlaforge import COMPONENTS
from vlaforge.models.build import build_vla
from vlaforge.techniques.precision import apply_precision

from conftest import make_batch, tiny_config

MIX = {"vision": "bf16", "projector": "fp32", "llm": "bf16", "action_head": "fp32"}


def test_per_component_autocast_regions_seen_by_hooks(tmp_path):
    cfg = tiny_config(tmp_path, components={c: {"precision": p} for c, p in MIX.items()})
    model = build_vla(cfg.model, cfg.loss)
    used = apply_precision(model, dict(cfg.components.items()), torch.device("cpu"))
    assert used == MIX
    seen: dict[str, set] = {c: set() for c in COMPONENTS}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            component = name.split(".")[0]
            module.register_forward_hook(lambda m, a, out, c=component: seen[c].add(out.dtype))
    loss, _ = model.compute_loss(make_batch(cfg, model))
    loss.backward()
    assert seen["vision"] == {torch.bfloat16} and seen["llm"] == {torch.bfloat16}
    assert seen["projector"] == {torch.float32} and seen["action_head"] == {torch.float32}
    # Master weights and their gradients stay fp32 in every component.
    for p in model.parameters():
        assert p.dtype == torch.float32
        assert p.grad is None or p.grad.dtype == torch.float32
    assert loss.dtype == torch.float32


def test_fp32_everywhere_matches_unwrapped_model(tmp_path):
    cfg = tiny_config(tmp_path)
    torch.manual_seed(0)
    plain = build_vla(cfg.model, cfg.loss)
    torch.manual_seed(0)
    wrapped = build_vla(cfg.model, cfg.loss)
    apply_precision(wrapped, dict(cfg.components.items()), torch.device("cpu"))
    batch = make_batch(cfg, plain)
    a, _ = wrapped.compute_loss(batch)
    b, _ = plain.compute_loss(batch)
    assert torch.equal(a, b)
    ids = batch.instruction_ids
    with torch.autocast("cpu", dtype=torch.bfloat16):  # an outer region must not leak into fp32 components
        inside = wrapped.llm(input_ids=ids).logits
    assert inside.dtype == torch.float32
    assert torch.equal(inside, plain.llm(input_ids=ids).logits)
