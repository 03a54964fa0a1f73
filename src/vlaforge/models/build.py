"""`build_vla`: the one place that turns a `ModelConfig` into a VLA (real, or fake for planning)."""

from __future__ import annotations

import contextlib

import torch

from vlaforge.config.schema import LossConfig, ModelConfig
from vlaforge.models.action_heads import ACTION_HEADS
from vlaforge.models.flavors import FLAVORS
from vlaforge.models.llm import build_llm
from vlaforge.models.vision import build_vision
from vlaforge.models.vla import VLA, Layout, Projector
from vlaforge.training.losses import Objective


def objective_from(loss: LossConfig) -> Objective:
    return Objective(weights=dict(loss.weights), action=loss.action, huber_delta=loss.huber_delta,
                     smoothness=loss.smoothness)


def build_vla(model_cfg: ModelConfig, loss_cfg: LossConfig | None = None, *, fake: bool = False) -> VLA:
    """Build the VLA described by `model_cfg`.

    Args:
        fake: build under `FakeTensorMode` (no memory allocated, weights not initialized) - for planning and
            summaries of large flavors. Parameters are then FakeTensors.
    """
    flavor = FLAVORS.get(model_cfg.flavor)
    ctx = fake_build() if fake else contextlib.nullcontext()
    with ctx:
        vision = build_vision(flavor, model_cfg.image_size, model_cfg.vision.pretrained, model_cfg.patch_size)
        llm = build_llm(flavor, model_cfg.llm.pretrained)
        if fake:
            llm.tie_weights()  # NOTE: no_init_weights also skips tying (e.g. small's tied embeddings)
        v_dim, l_dim = vision.config.hidden_size, llm.config.hidden_size
        projector = Projector(v_dim, l_dim, flavor.projector_hidden)
        head_cfg = model_cfg.action_head
        action_head = ACTION_HEADS.get(head_cfg.kind)(
            llm_dim=l_dim, action_dim=model_cfg.action_dim, state_dim=model_cfg.state_dim,
            chunk=model_cfg.action_chunk, hidden=head_cfg.hidden or flavor.action_hidden,
            flow_steps=head_cfg.flow_steps, layers=head_cfg.layers)
    image_size = model_cfg.image_size or vision.config.image_size
    layout = Layout(frames=model_cfg.frames_per_sample, image_size=image_size,
                    patches_per_frame=(image_size // vision.config.patch_size) ** 2,
                    interpolate_pos=image_size != vision.config.image_size)
    return VLA(vision, projector, llm, action_head, layout, objective_from(loss_cfg or LossConfig()))


@contextlib.contextmanager
def fake_build():
    """FakeTensorMode plus transformers' no_init_weights (random inits read data, which fake tensors lack)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.initialization import no_init_weights

    with FakeTensorMode(allow_non_fake_inputs=True), no_init_weights():
        yield


def tokens_per_sample(model: VLA, instruction_tokens: int, text_tokens: int = 0) -> int:
    """Length of the LLM sequence for one sample."""
    lay = model.layout
    return lay.frames * lay.patches_per_frame + instruction_tokens + model.action_head.chunk + text_tokens


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """Parameters per component (shared tensors counted once), plus 'total'."""
    counts = {name: sum(p.numel() for p in child.parameters()) for name, child in model.named_children()}
    counts["total"] = sum(p.numel() for p in model.parameters())
    return counts


def token_summary(cfg) -> str:
    """TOML comment lines: the LLM sequence of one sample, part by part, and each context-parallel rank's share
    (built under fake tensors: seconds even for 70B flavors)."""
    if not cfg.model.shapes_known():
        return "# tokens per sample: known once the dataset's cameras are read (model.cameras = 'auto'; no dataset " \
               f"at data.path {cfg.data.path})\n"
    with fake_build():
        model = build_vla(cfg.model, cfg.loss)
    lay, d = model.layout, cfg.data
    total = tokens_per_sample(model, d.max_instruction_tokens, d.max_text_tokens)
    lines = [f"# tokens per sample: {lay.frames} frames x {lay.patches_per_frame} patches + "
             f"{d.max_instruction_tokens} instruction + {model.action_head.chunk} action queries + "
             f"{d.max_text_tokens} text = {total}"]
    cp = cfg.parallel.cp
    lines.append(f"# tokens per rank: {total}" if cp == 1 else
                 f"# tokens per rank with parallel.cp = {cp}: {-(-total // cp)}")
    if cp > 1:
        from vlaforge.distributed.sequence_parallel import cp_method_for

        method, why = cp_method_for(cfg.parallel, total, model.llm.config.num_attention_heads)
        lines.append(f"# context-parallel method: {method} ({why})")
    return "\n".join(lines) + "\n"
