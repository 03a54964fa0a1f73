"""Vision towers of every family vlaforge reads (models/vision.py `VISION_FAMILIES`: SigLIP, SigLIP2, CLIP, DINOv2,
DINOv2 with registers) as `model.vision.pretrained`: the VLA feeds its projector exactly the tower's last hidden
states at the patch positions as transformers computes them (CLS and register tokens dropped, pooling heads
removed), at the tower's own image size and at another; each trains, checkpoints exactly, and the techniques that
read SigLIP's internals refuse the others in one line."""

import pytest
import torch

from vlaforge.errors import VlaforgeError
from vlaforge.models.build import build_vla

from conftest import fit, make_batch, policy_grads, tiny_config
from families import VISION_FAMILIES, tower_folder

PATCH = 8
LEADING = {"clip": 1, "dinov2": 1, "dinov2_with_registers": 3}  # CLS (+ 2 registers): what the rule drops


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("towers")


def _cfg(root, name, **model):
    return tiny_config(model={"vision": {"pretrained": str(tower_folder(name, root))}, **model})


def _stats(name):
    from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    if name == "clip":
        return OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
    if name.startswith("dinov2"):
        return IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    return (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


def _reference(name, folder, images, stats=None):
    """The tower's patch tokens of uint8 `images` (N, 3, H, W) as transformers computes them, the pixels
    normalized as the family's image processor does (transformers' constants, or `stats`)."""
    import transformers

    tower = getattr(transformers, VISION_FAMILIES[name][0]).from_pretrained(folder).eval()
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (stats or _stats(name)))
    pixels = (images / 255.0 - mean) / std
    side = pixels.shape[-1]
    if name == "siglip2":
        from transformers.models.siglip2.image_processing_pil_siglip2 import convert_image_to_patches

        seq = torch.stack([torch.from_numpy(convert_image_to_patches(image.numpy(), PATCH)) for image in pixels])
        grid = torch.tensor([[side // PATCH, side // PATCH]] * len(pixels))
        out = tower(pixel_values=seq, pixel_attention_mask=torch.ones(seq.shape[:2], dtype=torch.long),
                    spatial_shapes=grid)
    elif name.startswith("dinov2"):
        out = tower(pixel_values=pixels)
    else:
        out = tower(pixel_values=pixels, interpolate_pos_encoding=side != 32)
    return out.last_hidden_state[:, LEADING.get(name, 0):]


@pytest.mark.parametrize("side", [32, 48], ids=["native", "resized"])
@pytest.mark.parametrize("name", sorted(VISION_FAMILIES))
def test_each_tower_feeds_the_patch_tokens_transformers_computes(root, name, side):
    cfg = _cfg(root, name, image_size=side)
    model = build_vla(cfg.model, cfg.loss).eval()
    assert model.layout.patches_per_frame == (side // PATCH) ** 2
    assert model.layout.interpolate_pos == (side != 32)
    assert not any(n.startswith("vision.head") for n, _ in model.named_parameters())
    images = torch.randint(0, 256, (2, 3, side, side)).float()
    seen = {}
    model.projector.register_forward_hook(lambda m, args, out: seen.update(features=args[0]))
    with torch.no_grad():
        model.embed_images((images / 127.5 - 1)[:, None])  # vlaforge's input (data/transforms.py)
        expected = _reference(name, tower_folder(name, root), images)
    torch.testing.assert_close(seen["features"], expected, rtol=1e-5, atol=1e-5)
    if side == 32:
        model.train()
        losses = fit(model, make_batch(cfg, model, size=2), steps=3)
        assert losses[-1] < losses[0], losses
        model.zero_grad(set_to_none=True)
        model.compute_loss(make_batch(cfg, model, size=2))[0].backward()
        idle = [n for n, p in model.vision.named_parameters() if p.grad is None]
        assert not idle, idle  # nothing the patch tokens skip is kept (CLIP's pooled-token norm, SigLIP's head)


def test_a_folders_image_processor_sets_the_normalization_and_the_checkpoint_keeps_it(root, tmp_path):
    """A CLIP folder with a preprocessor_config.json of its own mean / std: the tower sees pixels normalized by them,
    after a checkpoint's rebuild from its saved config too; a damaged one is refused in one line."""
    import json
    import shutil

    from vlaforge.models.build import backbone_configs

    folder = shutil.copytree(tower_folder("clip", root), tmp_path / "clip")
    stats = ([0.4, 0.45, 0.5], [0.2, 0.25, 0.3])
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": stats[0], "image_std": stats[1]}))
    cfg = tiny_config(model={"vision": {"pretrained": str(folder)}})
    model = build_vla(cfg.model, cfg.loss).eval()
    rebuilt = build_vla(cfg.model, cfg.loss, backbones=backbone_configs(model, cfg.model)).eval()
    rebuilt.load_state_dict(model.state_dict())
    images = torch.randint(0, 256, (2, 3, 32, 32)).float()
    expected = _reference("clip", folder, images, stats)
    from vlaforge.models.vision import tower_features

    with torch.no_grad():
        for m in (model, rebuilt):
            torch.testing.assert_close(tower_features(m.vision, images / 127.5 - 1, False), expected,
                                       rtol=1e-5, atol=1e-5)
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5], "image_std": [0, 1, 1]}))
    with pytest.raises(VlaforgeError, match="preprocessor_config.json gives image_mean"):
        build_vla(cfg.model, cfg.loss)


@pytest.mark.parametrize("name", ["siglip2", "clip", "dinov2_with_registers"])
def test_checkpointing_each_tower_gives_the_plain_gradients(root, name):
    """Full and selective checkpointing find each family's blocks (DINOv2's `encoder.layer`) and attention
    sub-layer (DINOv2's `attention`)."""
    ref = policy_grads(_cfg(root, name))
    assert any(n.startswith("vision.") for n in ref)
    for strategy in ("full", "selective"):
        got = policy_grads(tiny_config(model=_cfg(root, name).model.model_dump(),
                                 components={"vision": {"checkpointing": strategy}}))
        assert got.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-6, msg=f"{strategy}: {n}")


def test_the_planner_counts_siglip_towers_by_formula_and_measures_the_others(root):
    """SigLIP's blocks are counted by formula; a DINOv2 tower's are measured (tests/test_planner_families.py)."""
    from vlaforge.planner.types import PlanModel

    assert PlanModel(_cfg(root, "dinov2")).measured_components == ("vision",)
    whole_llm = tiny_config(model={"vision": {"pretrained": str(tower_folder("siglip", root))}})
    assert PlanModel(whole_llm).seq.patches == 16  # a SigLIP folder plans, from its config alone


def test_a_fused_tower_concatenates_each_towers_penultimate_patch_tokens(root):
    """OpenVLA's Prismatic: DINOv2 (with registers) + SigLIP on the same frames, each read at the output of its
    penultimate block before its final norm (transformers' `hidden_states[-2]`), its own leading tokens dropped and
    its own pixel normalization; [DINOv2, SigLIP] per patch. It trains, and rebuilds from its saved config."""
    import transformers

    from vlaforge.models.build import backbone_configs
    from vlaforge.models.vision import tower_features, vision_blocks

    dino, siglip = tower_folder("dinov2_with_registers", root), tower_folder("siglip", root)
    cfg = tiny_config(model={"vision": {"pretrained": str(dino), "fused": str(siglip)}})
    model = build_vla(cfg.model, cfg.loss).eval()
    assert len(vision_blocks(model.vision)) == 2  # each 2-block tower read at its first block's output
    assert model.layout.patches_per_frame == 16 and model.projector.mlp[0].in_features == 64
    images = torch.randint(0, 256, (2, 3, 32, 32)).float()
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in _stats("dinov2"))
    with torch.no_grad():
        ref_dino = transformers.Dinov2WithRegistersModel.from_pretrained(dino).eval()
        ref_siglip = transformers.SiglipVisionModel.from_pretrained(siglip).eval()
        want = torch.cat([
            ref_dino(pixel_values=(images / 255 - mean) / std, output_hidden_states=True).hidden_states[-2][:, 3:],
            ref_siglip(pixel_values=images / 127.5 - 1, output_hidden_states=True).hidden_states[-2]], -1)
        torch.testing.assert_close(tower_features(model.vision, images / 127.5 - 1, False), want, rtol=1e-5,
                                   atol=1e-5)
        rebuilt = build_vla(cfg.model, cfg.loss, backbones=backbone_configs(model, cfg.model)).eval()
        rebuilt.load_state_dict(model.state_dict())
        torch.testing.assert_close(tower_features(rebuilt.vision, images / 127.5 - 1, False), want, rtol=1e-5,
                                   atol=1e-5)
    model.train()
    losses = fit(model, make_batch(cfg, model, size=2), steps=3)
    assert losses[-1] < losses[0], losses
    with pytest.raises(VlaforgeError, match="model.vision.fused is the second tower of a fused pair"):
        tiny_config(model={"vision": {"fused": str(siglip)}})
    from families import family_folder

    fused = lambda folder: tiny_config(model={"vision": {"pretrained": str(dino), "fused": str(folder)}})
    with pytest.raises(VlaforgeError, match="model.vision.fused: .* is a 'llama' folder, not a vision tower"):
        build_vla(fused(family_folder("llama", root)).model)
    small = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=4))
    small.save_pretrained(root / "siglip_patch4")
    with pytest.raises(VlaforgeError, match=r"patches \[8, 4\] px\) do not give one patch grid"):
        build_vla(fused(root / "siglip_patch4").model)
