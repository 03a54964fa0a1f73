"""FLOPs of one training step, per component, from the architecture: the matmuls (linear layers, the patch
convolution, the LM head, the contrastive logits) forward, backward and recomputed by checkpointing, plus the
attention cores (QKᵀ and AV), which `torch.utils.flop_counter` does not count for CPU SDPA kernels and which are
kept apart. `tests/test_planner.py` checks the matmul counts against `FlopCounterMode` on the real modules.

Conventions: a matmul of (m, k) x (k, n) is 2mkn FLOPs; backward is 2x forward (input and weight gradients), minus
the gradients nobody needs (the pixels' and the robot state's input gradients, a frozen component's weight
gradients, and input gradients below the first component that trains). Checkpointing recomputes in backward:
`full` the whole block's forward, `selective` the FFN matmuls its policy does not keep, `selective_attn` /
`selective_ffn` that sub-layer's matmuls - each without the region's last matmul, whose output backward does not
need (torch stops recomputing once the tensors backward needs are back). MFU counts forward + backward, not
recomputation (PaLM's convention): recomputation costs time but is not useful work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlaforge.planner.activations import Sequence, llm_shape, vision_shape
from vlaforge.techniques.freezing import trainable_at

EVER = 1 << 62


@dataclass
class StepFlops:
    forward: dict[str, float] = field(default_factory=dict)  # matmul FLOPs per component
    backward: dict[str, float] = field(default_factory=dict)
    recompute: dict[str, float] = field(default_factory=dict)
    attention: dict[str, float] = field(default_factory=dict)  # QKᵀ + AV, forward + backward (+ recompute)
    recompute_attention: dict[str, float] = field(default_factory=dict)  # the part of `attention` recomputed

    @property
    def model_flops(self) -> float:
        """Useful work of the step (forward + backward, attention included): MFU's numerator."""
        attn = sum(self.attention.values()) - sum(self.recompute_attention.values())
        return sum(self.forward.values()) + sum(self.backward.values()) + attn

    @property
    def hardware_flops(self) -> float:
        """Everything executed, recomputation included."""
        return (sum(self.forward.values()) + sum(self.backward.values()) + sum(self.recompute.values())
                + sum(self.attention.values()))


def _recomputed(strategy: str, attn_mm: float, ffn_mm: float, attn_out: float, ffn_out: float
                ) -> tuple[float, bool]:
    """(matmul FLOPs recomputed, whether the attention core is recomputed) for one block's strategy. Torch's
    non-reentrant checkpoint stops recomputing once the last tensor backward needs is back, so a region's final
    matmul (o_proj / out_proj for the attention sub-layer, down / fc2 for the FFN and the block) is not redone."""
    return {"none": (0.0, False), "full": (attn_mm + ffn_mm - ffn_out, True), "selective": (ffn_mm - ffn_out, False),
            "selective_attn": (attn_mm - attn_out, True), "selective_ffn": (ffn_mm - ffn_out, False)}[strategy]


def step_flops(model, seq: Sequence, policies, contrastive: bool = True) -> StepFlops:
    """FLOPs of one micro-batch's forward and backward (times `grad_accum` for a step)."""
    vis, llm = model.vision.config, model.llm.config
    b, s = seq.batch, seq.llm_tokens
    images, tv, t = b * seq.frames, b * seq.frames * seq.patches, b * s
    trains = {c: trainable_at(policies[c], EVER) for c in ("vision", "projector", "llm", "action_head")}
    out = StepFlops()

    # vision: patch convolution, blocks (q, k, v, o; fc1, fc2), attention core over each image's patches
    vs = vision_shape(vis)
    patch = vis.patch_size
    conv = 2.0 * tv * 3 * patch * patch * vs.hidden
    v_out = 2.0 * tv * vs.hidden * vs.hidden  # out_proj
    v_attn_mm = 4 * v_out
    v_fc2 = 2.0 * tv * vs.ffn * vs.hidden
    v_ffn_mm = 2 * v_fc2
    v_blocks = vis.num_hidden_layers * (v_attn_mm + v_ffn_mm)
    v_core = vis.num_hidden_layers * 4.0 * images * seq.patches ** 2 * vs.hidden
    out.forward["vision"] = conv + v_blocks
    out.backward["vision"] = (conv + 2 * v_blocks) if trains["vision"] else 0.0
    rec, core_again = _recomputed(policies["vision"].checkpointing, v_attn_mm, v_ffn_mm, v_out, v_fc2)
    out.recompute["vision"] = vis.num_hidden_layers * rec if trains["vision"] else 0.0
    out.recompute_attention["vision"] = v_core if core_again and trains["vision"] else 0.0
    out.attention["vision"] = v_core + (2 * v_core if trains["vision"] else 0.0) + out.recompute_attention["vision"]

    # projector: two linears over the vision tokens
    hp = model.projector.mlp[0].out_features
    fc1, fc2 = 2.0 * tv * vs.hidden * hp, 2.0 * tv * hp * llm.hidden_size
    proj = fc1 + fc2
    out.forward["projector"] = proj
    # weight gradients when it trains; fc2's input gradient to reach fc1's weights or the vision tower, fc1's only
    # for the vision tower
    out.backward["projector"] = (proj * trains["projector"] + fc2 * (trains["projector"] or trains["vision"])
                                 + fc1 * trains["vision"])
    out.recompute["projector"] = proj if policies["projector"].checkpointing == "full" and (
        trains["projector"] or trains["vision"]) else 0.0

    # llm: blocks (q, k, v, o; gate, up, down), LM head over the text positions (+1), causal attention core
    ls = llm_shape(llm)
    D, hd = ls.hidden, ls.heads * ls.head_dim
    l_out = 2.0 * t * hd * D  # o_proj
    l_attn_mm = 2.0 * t * (D * hd + 2 * D * ls.kv_heads * ls.head_dim) + l_out
    l_down = 2.0 * t * ls.ffn * D
    l_ffn_mm = 3 * l_down
    l_blocks = llm.num_hidden_layers * (l_attn_mm + l_ffn_mm)
    head = 2.0 * b * (seq.text + 1) * D * llm.vocab_size
    l_core = llm.num_hidden_layers * 4.0 * b * s * s * hd
    upstream = trains["vision"] or trains["projector"]
    out.forward["llm"] = l_blocks + head
    out.backward["llm"] = (l_blocks + head) * (trains["llm"] + (trains["llm"] or upstream))
    needs_backward = trains["llm"] or upstream
    rec, core_again = _recomputed(policies["llm"].checkpointing, l_attn_mm, l_ffn_mm, l_out, l_down)
    out.recompute["llm"] = llm.num_hidden_layers * rec if needs_backward else 0.0
    out.recompute_attention["llm"] = l_core if core_again and needs_backward else 0.0
    out.attention["llm"] = l_core + (2 * l_core if needs_backward else 0.0) + out.recompute_attention["llm"]

    # action head (regression): in_proj and state_proj, then an MLP of two linears
    ah = model.action_head
    ha, chunk = ah.in_proj.out_features, seq.chunk
    body = 2.0 * b * chunk * (D * ha + ha * ha + ha * seq.action_dim)
    state = 2.0 * b * seq.state_dim * ha
    out.forward["action_head"] = body + state
    out.backward["action_head"] = body * (trains["action_head"] + 1) + state * trains["action_head"]
    out.recompute["action_head"] = (body + state) if policies["action_head"].checkpointing == "full" else 0.0

    out.forward["other"] = 2.0 * b * b * D if contrastive else 0.0  # contrastive logits (B x B)
    out.backward["other"] = 2 * out.forward["other"]
    return out


def mfu(flops: StepFlops, steps_per_s: float, gpus: int, peak_tflops: float) -> float:
    """Model FLOPs utilization: useful FLOPs per second over the GPUs' dense peak."""
    return flops.model_flops * steps_per_s / (gpus * peak_tflops * 1e12)
