"""`build_vla`: the one place that turns a `ModelConfig` into a VLA (real, or fake for planning); the shapes of
one sample (`tokens_per_sample`, `with_seq_len`, `synthetic_batch`)."""

from __future__ import annotations

import contextlib

import torch

from vlaforge import COMPONENTS
from vlaforge.config.flavors import FLAVORS, refuse_policy
from vlaforge.config.loading import deep_merge
from vlaforge.config.model import PretrainedSource
from vlaforge.config.schema import LossConfig, ModelConfig, VLAConfig
from vlaforge.data.batch import Batch
from vlaforge.errors import VlaforgeError
from vlaforge.models.action_heads import ACTION_HEADS
from vlaforge.models.fake import fake_build, fake_mode_active
from vlaforge.models.families import mrope_section
from vlaforge.models.hf_loading import read_config
from vlaforge.models.llm import build_llm
from vlaforge.models.losses import Objective
from vlaforge.models.vision import FUSED, build_vision, native_size, tower_width
from vlaforge.models.vla import VLA, Layout, Projector
from vlaforge.models.vlm import component_configs, load_weights


def objective_from(loss: LossConfig) -> Objective:
    return Objective(weights=dict(loss.weights), action=loss.action, huber_delta=loss.huber_delta,
                     smoothness=loss.smoothness)


DEFAULT_IMAGE_SIZE = 224  # a tower that reads any size (Qwen-VL's) without model.image_size
BACKBONES_FILE = "backbones.json"  # in a checkpoint: the pretrained components' configs (component -> config dict)
# The components built from a `transformers` config - a pretrained folder's (their [model.<name>] section is a
# `PretrainedSource`: model.vision.pretrained, model.llm.pretrained) or the one backbones.json saved - which are the
# ones whose config a checkpoint must keep. Not "the components with blocks" (models/blocks.py asks the built model):
# the projector and the action head are vlaforge's own modules, rebuilt from the flavor and [model].
PRETRAINED_COMPONENTS = tuple(c for c in COMPONENTS if c in ModelConfig.model_fields
                              and issubclass(ModelConfig.model_fields[c].annotation, PretrainedSource))


def backbone_configs(model: VLA, model_cfg: ModelConfig) -> dict[str, dict]:
    """The configs of `model`'s pretrained components, which rebuild them without their folders."""
    if model_cfg.lerobot.pretrained:  # a LeRobot policy: its config.json and what sized it
        return {"lerobot": model.backbones}
    out = {}
    for name in PRETRAINED_COMPONENTS:
        if getattr(model_cfg, name).pretrained or model_cfg.vlm.pretrained:
            config = getattr(model, name).config.to_dict()
            out[name] = {k: v for k, v in config.items() if not k.startswith("_")}
    if model_cfg.vlm.pretrained:  # the VLM's connector shape, not the flavor's
        out["projector"] = dict(model.projector.spec)
    return out


def _lerobot_policy(model_cfg: ModelConfig, loss_cfg: LossConfig | None, fake: bool,
                    backbones: dict[str, dict] | None):
    """A LeRobot policy (models/policies/): the folder `model.lerobot.pretrained` names (or what a checkpoint's
    backbones.json kept of it), else a policy flavor at LeRobot's default sizes (models/policies/defaults.py)."""
    if model_cfg.lerobot.pretrained:
        from vlaforge.models.policies.reader import build_lerobot

        model = build_lerobot(model_cfg, fake=fake, saved=(backbones or {}).get("lerobot"))
    else:
        model = build_policy_flavor(model_cfg.flavor, fake=fake)
    model.objective = objective_from(loss_cfg or LossConfig())
    return model


def local_sources(model_cfg: ModelConfig, config_only: bool = False) -> ModelConfig:
    """`model_cfg` with its pretrained folders local: a Hub id (org/name[@rev]) resolved through the Hugging Face
    cache (`vlaforge.hub`; `config_only`: its config files are enough, as for a fake build)."""
    from vlaforge import hub

    files = hub.MODEL_CONFIG if config_only else hub.PRETRAINED
    local = lambda ref, field: ref if ref is None or not hub.looks_like_id(ref) else \
        str(hub.local_folder(ref, field, files))
    update = {"vision": model_cfg.vision.model_copy(update={
                  "pretrained": local(model_cfg.vision.pretrained, "model.vision.pretrained"),
                  "fused": local(model_cfg.vision.fused, "model.vision.fused")}),
              "llm": model_cfg.llm.model_copy(update={"pretrained": local(model_cfg.llm.pretrained,
                                                                          "model.llm.pretrained")}),
              "vlm": model_cfg.vlm.model_copy(update={"pretrained": local(model_cfg.vlm.pretrained,
                                                                          "model.vlm.pretrained")})}
    return model_cfg.model_copy(update=update)


def build_vla(model_cfg: ModelConfig, loss_cfg: LossConfig | None = None, *, fake: bool = False,
              backbones: dict[str, dict] | None = None) -> VLA:
    """Build the VLA described by `model_cfg`.

    Args:
        fake: build under `FakeTensorMode` (no memory allocated, weights not initialized) - for planning and
            summaries of large flavors. Parameters are then FakeTensors; a pretrained component is built from its
            folder's config.json alone (its weights are never read).
        backbones: the pretrained components' configs (`backbone_configs`, a checkpoint's backbones.json): they
            are built from these, and their folders are not read (the checkpoint's weights follow). A whole VLM
            (`model.vlm.pretrained`) is built from the configs its adapter derives, then filled from its files
            (models/vlm.py).
    """
    flavor = FLAVORS.get(model_cfg.flavor)
    if model_cfg.lerobot.pretrained or flavor.policy:
        return _lerobot_policy(model_cfg, loss_cfg, fake or fake_mode_active(), backbones)
    model_cfg = local_sources(model_cfg, config_only=fake or fake_mode_active())
    backbones = dict(backbones or {})
    # under a caller's own fake-tensor mode (`profile --fake`, `plan --measure`) the build is a fake one too: the
    # pretrained components come from their configs (weights read into fake tensors would not be the parameters the
    # forward sees, and a VLM's files have no storage to go to)
    outer = fake_mode_active()
    config_only = fake or outer
    vlm_weights = None  # a whole VLM's folder whose weights fill the components once built
    if model_cfg.vlm.pretrained and not {"vision", "llm", "projector"} <= backbones.keys():
        derived = component_configs(model_cfg.vlm.pretrained)
        backbones.update(vision=derived["vision"], llm=derived["llm"], projector=derived["projector"])
        vlm_weights = None if config_only else model_cfg.vlm.pretrained
    # a flavor of other towers than SigLIP + Llama (Qwen2.5-VL's): built from their configs
    if flavor.vision_type != "siglip_vision_model" and not model_cfg.pretrained_tower:
        backbones.setdefault("vision", {"model_type": flavor.vision_type,
                                        **{k: v for k, v in flavor.vision.items() if k != "image_size"}})
    if flavor.llm_type != "llama" and not model_cfg.text_folder:
        backbones.setdefault("llm", {"model_type": flavor.llm_type, **flavor.llm})
    if config_only:
        for name in PRETRAINED_COMPONENTS:
            folder = getattr(model_cfg, name).pretrained
            if folder and name not in backbones:
                backbones[name] = read_config(folder, f"model.{name}.pretrained")
        if model_cfg.vision.fused and backbones["vision"].get("model_type") != FUSED:
            backbones["vision"] = {"model_type": FUSED, "towers": [
                backbones["vision"], read_config(model_cfg.vision.fused, "model.vision.fused")]}
    ctx = fake_build() if fake and not outer else contextlib.nullcontext()
    with ctx:
        vision = build_vision(flavor, model_cfg.image_size, model_cfg.vision.pretrained, model_cfg.patch_size,
                              model_cfg.vision_stem, config=backbones.get("vision"),
                              attn=model_cfg.attn_implementation, fused=model_cfg.vision.fused)
        llm = build_llm(flavor, model_cfg.llm.pretrained, config=backbones.get("llm"),
                        attn=model_cfg.attn_implementation)
        if config_only:
            llm.tie_weights()  # NOTE: no_init_weights also skips tying (e.g. small's tied embeddings)
        v_dim, l_dim = tower_width(vision), llm.config.hidden_size
        shape = {**flavor.projector, **backbones.get("projector", {})}  # a VLM's connector, or the flavor's
        shape["hidden"] = shape.get("hidden") or flavor.projector_hidden  # (a one-linear connector saves None)
        merge = shape.get("merge", 1)
        projector = Projector(v_dim, l_dim, **shape)
        head_cfg = model_cfg.action_head
        action_head = ACTION_HEADS.get(head_cfg.kind)(
            llm_dim=l_dim, action_dim=model_cfg.action_dim, state_dim=model_cfg.state_dim,
            chunk=model_cfg.action_chunk, hidden=head_cfg.hidden or flavor.action_hidden,
            flow_steps=head_cfg.flow_steps, layers=head_cfg.layers, state_dropout=head_cfg.state_dropout,
            env_state_dim=model_cfg.env_state_dim)
    if vlm_weights is not None:
        load_weights(vlm_weights, {"vision": vision, "projector": projector, "llm": llm},
                     new={"projector": {"logit_scale"}})
    native = native_size(vision)
    image_size = model_cfg.image_size or native or flavor.vision.get("image_size") or DEFAULT_IMAGE_SIZE
    patch = vision.config.patch_size
    if merge > 1 and image_size % (patch * merge):
        raise VlaforgeError(f"model.image_size = {image_size} is not a multiple of the tower's {patch}-pixel patches x "
                            f"its connector's {merge} x {merge} merge; use a multiple of {patch * merge}")
    layout = Layout(frames=model_cfg.frames_per_sample, image_size=image_size,
                    # CLS / registers dropped; a merging connector's merged tokens
                    patches_per_frame=(image_size // patch // merge) ** 2,
                    interpolate_pos=native is not None and image_size != native,
                    mrope=mrope_section(llm.config) is not None)
    return VLA(vision, projector, llm, action_head, layout, objective_from(loss_cfg or LossConfig()))


def build_policy_flavor(name: str, fake: bool) -> torch.nn.Module:
    """The `PolicyVLA` flavor `name` is (LeRobot's config.json defaults), under fake tensors.

    Raises:
        VlaforgeError: not `fake`: the policy's weights come from its folder, not from random values.
    """
    from vlaforge.models.policies.defaults import build_default_policy

    if not fake:
        refuse_policy(name, "vlaforge builds it with weights from a LeRobot folder only (random, it has no "
                            "tokenizer or normalization to train or run with)",
                      "set model.lerobot.pretrained to a folder lerobot-train or save_pretrained wrote, or train "
                      "its VLM's shapes with vlaforge's action head as model.flavor = '{vlm}'")
    with fake_build() if not fake_mode_active() else contextlib.nullcontext():
        model = build_default_policy(FLAVORS.get(name).policy, fake=True)
        model.llm.tie_weights()  # NOTE: no_init_weights also skips tying (pi0's Gemma embeddings and LM head)
    return model


def tokens_per_sample(model: VLA, instruction_tokens: int, text_tokens: int = 0) -> int:
    """Length of the LLM sequence for one sample."""
    lay = model.layout
    return lay.frames * lay.patches_per_frame + instruction_tokens + model.action_head.chunk + text_tokens


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Parameters per component (shared tensors counted once), plus 'total'."""
    counts = {name: sum(p.numel() for p in child.parameters()) for name, child in model.named_children()}
    counts["total"] = sum(p.numel() for p in model.parameters())
    return counts


def with_seq_len(cfg: VLAConfig, seq_len: int | None) -> VLAConfig:
    """`cfg` whose instruction length makes the LLM sequence `seq_len` tokens long."""
    if seq_len is None:
        return cfg
    m = cfg.model
    flavor = FLAVORS.get(m.flavor)
    image = m.image_size or flavor.vision["image_size"]
    patch = m.patch_size or flavor.vision["patch_size"]
    fixed = m.frames_per_sample * flavor.tokens_per_frame(image, patch) + m.action_chunk + cfg.data.max_text_tokens
    if seq_len <= fixed:
        raise VlaforgeError(f"--seq-len {seq_len} leaves no room for instruction tokens: images, action queries and "
                            f"text targets take {fixed} tokens; use a longer --seq-len")
    return VLAConfig.model_validate(deep_merge(cfg.model_dump(), {"data": {"max_instruction_tokens":
                                                                            seq_len - fixed}}))


def synthetic_batch(cfg: VLAConfig, model: torch.nn.Module, size: int, padded: bool = True) -> Batch:
    """A batch of the config's shapes (random values; fake tensors under FakeTensorMode). Every position is a token;
    `padded` says how the model is to attend: as to a dataset's batch, whose instructions are padded (the mask
    given, as `vlaforge plan` plans by default), or, `padded=False`, as to a batch known to hold no padding
    (`Batch.full`: no mask, SDPA's is_causal kernels; a benchmark's full-length batches, `PlanModel(padded=False)`)."""
    m, d = cfg.model, cfg.data
    lay = model.layout
    vocab = model.llm.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(1, vocab, (size, n), generator=g)
    text = d.max_text_tokens
    return Batch(images=torch.randn(size, lay.frames, 3, lay.image_size, lay.image_size, generator=g),
                 state=torch.randn(size, m.state_dim, generator=g),
                 instruction_ids=ids(d.max_instruction_tokens),
                 instruction_mask=torch.ones(size, d.max_instruction_tokens, dtype=torch.long),
                 actions=torch.randn(size, m.action_chunk, m.action_dim, generator=g),
                 action_mask=torch.ones(size, m.action_chunk, dtype=torch.bool),
                 text_ids=ids(text) if text else None,
                 text_mask=torch.ones(size, text, dtype=torch.long) if text else None, full=not padded)
