"""Model flavors: named shapes for the four components, looked up by name.

Only plain data lives here (no torch import) so configs can validate a flavor name cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from vlaforge.errors import VlaforgeError
from vlaforge.registry import Registry


@dataclass(frozen=True)
class Flavor:
    """Architecture of one VLA size.

    Args:
        vision: keyword arguments of `transformers.SiglipVisionConfig`.
        llm: keyword arguments of `transformers.LlamaConfig`.
        projector_hidden: width of the projector MLP's hidden layer.
        action_hidden: width of the action head's MLP / flow network.
        nominal_params: the published size of each pretrained component this flavor mirrors.
        projector: the connector's shape when it is not vlaforge's two-layer MLP (`models.vla.Projector`'s
            arguments: SmolVLM's pixel shuffle + one bias-free linear is {"layers": 1, "merge": 4, "bias": False}).
        vision_type, llm_type: the transformers `model_type`s the towers are built as when not SigLIP + Llama
            (Qwen2.5-VL's tower and M-RoPE text model); `vision["image_size"]` is then the frames' side only.
        policy: the LeRobot policy type this flavor is (LeRobot's architecture at its default sizes,
            models/policies/defaults.py, built under fake tensors only); `vision` / `llm` are then its VLM's shapes,
            which the config's checks read.
        vlm_flavor: for a policy, the flavor of its VLM's shapes with vlaforge's action head: what the planner,
            `vlaforge profile` and training without weights take instead.
    """

    description: str
    vision: dict[str, Any]
    llm: dict[str, Any]
    projector_hidden: int
    action_hidden: int
    nominal_params: dict[str, float] = field(default_factory=dict)
    projector: dict[str, Any] = field(default_factory=dict)
    vision_type: str = "siglip_vision_model"
    llm_type: str = "llama"
    policy: str | None = None
    vlm_flavor: str | None = None

    def tokens_per_frame(self, image_size: int, patch_size: int) -> int:
        """LLM tokens of one image: its patch grid, merged by the connector."""
        return (image_size // patch_size // self.projector.get("merge", 1)) ** 2


FLAVORS: Registry[Flavor] = Registry("model flavor")

FLAVORS.add("tiny", Flavor(
    description="trains on CPU in minutes; for tests, the demo and quick starts",
    vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                image_size=64, patch_size=16),
    llm=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024),
    projector_hidden=128,
    action_hidden=128,
))

# The distillation teacher that trains on CPU (recipes/distill_teacher.toml): twice tiny's width, 2-3x its depth,
# the same vocabulary (so the teacher's and a tiny student's language logits compare).
FLAVORS.add("mini", Flavor(
    description="~5M-parameter LLM; trains on CPU within an hour; the distillation teacher of tiny students",
    vision=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                image_size=64, patch_size=16),
    llm=dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=1024, max_position_embeddings=1024),
    projector_hidden=256,
    action_hidden=256,
))

# SigLIP-base/16 at 224 px + a Qwen2-0.5B-shaped Llama (GQA 14/2, tied embeddings).
FLAVORS.add("small", Flavor(
    description="~0.5B LLM; real-GPU experiments and benchmarks",
    vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                image_size=224, patch_size=16),
    llm=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
             max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    projector_hidden=2048,
    action_hidden=512,
    nominal_params={"vision": 86e6, "llm": 494e6},
))

# OpenVLA-like: SigLIP-so400m/14 at 224 px + Llama-2-7B.
FLAVORS.add("vla-7b", Flavor(
    description="SigLIP-so400m + Llama-2-7B shapes (OpenVLA-like)",
    vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                image_size=224, patch_size=14),
    llm=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=32000, max_position_embeddings=32768),
    projector_hidden=4096,
    action_hidden=1024,
    nominal_params={"vision": 0.413e9, "llm": 6.74e9}  # so400m without its pooling head,
))

# ~1.1B ViT (ViT-g-like) + a 30B Llama with GQA 48/8.
FLAVORS.add("vla-30b", Flavor(
    description="~1.1B ViT + ~30B Llama-family LLM",
    vision=dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=40, num_attention_heads=16,
                image_size=224, patch_size=14),
    llm=dict(hidden_size=6144, intermediate_size=22016, num_hidden_layers=60, num_attention_heads=48,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768),
    projector_hidden=6144,
    action_hidden=1024,
    nominal_params={"vision": 1.13e9, "llm": 30e9},
))

# ~3B ViT + Llama-2-70B.
FLAVORS.add("vla-70b", Flavor(
    description="~3B ViT + Llama-2-70B shapes",
    vision=dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=60, num_attention_heads=16,
                image_size=224, patch_size=14),
    llm=dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768),
    projector_hidden=8192,
    action_hidden=1024,
    nominal_params={"vision": 3e9, "llm": 69e9},
))

# Real VLAs' shapes for planning (`vlaforge plan`, docs/whitepaper.md), each as the towers the planner counts:
# SigLIP + a Llama-shaped LLM (+ connector), or Qwen2.5-VL's own. Qwen3-VL has no flavor (its DeepStack is not
# mapped, docs/families.md).

# Qwen2.5-VL-3B (StarVLA's and Qwen-VLA's backbone family): its windowed 32-block ViT (1280 wide, 14-px patches at
# 224 px: 256 patches, 64 tokens after the 2 x 2 merger; full attention in blocks 7, 15, 23, 31), the RMSNorm + MLP
# patch merger, Qwen2.5-3B's text model with M-RoPE and tied embeddings.
FLAVORS.add("qwen2.5-vl-3b", Flavor(
    description="Qwen2.5-VL-3B's shapes: its windowed ViT + patch merger, Qwen2.5-3B with multimodal RoPE",
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
                temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], out_hidden_size=2048,
                image_size=224),
    llm=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
             num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6,
             max_position_embeddings=128000,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
    projector_hidden=5120,
    action_hidden=1024,
    projector={"layers": 2, "merge": 2, "norm": "rms", "order": "units"},
    nominal_params={"llm": 3.09e9},  # Qwen2.5-3B's published size (its ViT + merger: 0.67B, measured 0.669B)
    vision_type="qwen2_5_vl_vision",
    llm_type="qwen2_5_vl_text",
))

# SmolVLA's VLM: SmolVLM2-500M (SigLIP-B/16 at 512 px, whose Idefics3-shaped tower is SigLIP's; a 4 x 4 pixel shuffle
# into one bias-free linear: 64 tokens per image) with the first 16 of SmolLM2-360M's 32 layers, as SmolVLA keeps
# them. Not mirrored: SmolVLA's ~100M action expert; the action head is vlaforge's. No nominal sizes: SmolVLA
# publishes its total (~450M), not the truncated components'. (The LLM's tied embeddings are this flavor's: the real
# VLM has its own LM head, which the `smolvla` policy keeps.)
SMOLVLA_VLM = Flavor(
    description="SmolVLA's VLM shapes (SmolVLM2-500M's SigLIP-B/16 + pixel shuffle, SmolLM2-360M's first 16 layers) "
                "with vlaforge's action head, not SmolVLA's expert",
    vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                image_size=512, patch_size=16),
    llm=dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=16, num_attention_heads=15,
             num_key_value_heads=5, vocab_size=49280, tie_word_embeddings=True, rope_theta=100000.0,
             max_position_embeddings=8192),
    projector_hidden=960,
    action_hidden=720,
    projector={"layers": 1, "merge": 4, "bias": False},
)
FLAVORS.add("smolvla_vlm", SMOLVLA_VLM)

# pi0's VLM: PaliGemma-3B (SigLIP-so400m/14 at 224 px + Gemma-2B: MQA 8/1, head dim 256, tied embeddings, 257k
# vocabulary). Not mirrored: pi0's ~300M action expert (an 18-layer Gemma of width 1024 beside the VLM); the action
# head is vlaforge's at width 1024 (model.action_head.kind = "flow_matching" for pi0's objective).
PI0_VLM = Flavor(
    description="pi0's VLM shapes (PaliGemma-3B: SigLIP-so400m + Gemma-2B) with vlaforge's action head, not pi0's "
                "expert",
    vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                image_size=224, patch_size=14),
    llm=dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
             num_key_value_heads=1, head_dim=256, vocab_size=257152, tie_word_embeddings=True,
             max_position_embeddings=8192),
    projector_hidden=2048,
    action_hidden=1024,
    nominal_params={"vision": 0.413e9, "llm": 2.51e9},
)
FLAVORS.add("pi0_vlm", PI0_VLM)

# LeRobot's policies themselves at their default sizes (models/policies/defaults.py: the config.json lerobot-train
# writes; SmolVLA's VLM config): the VLM and its action expert in joint layers. Built under fake tensors (`vlaforge
# model summary`, `vlaforge config show`); a policy with weights comes from its folder (model.lerobot.pretrained).
FLAVORS.add("smolvla", replace(
    SMOLVLA_VLM, policy="smolvla", vlm_flavor="smolvla_vlm",
    description="LeRobot's SmolVLA (~450M): SmolVLM2-500M's first 16 layers + a 0.75-wide action expert"))
FLAVORS.add("pi0", replace(
    PI0_VLM, policy="pi0", vlm_flavor="pi0_vlm",
    description="LeRobot's pi0 (3.24B; 3.50B in LeRobot with the expert's unused LM head): PaliGemma-3B + a "
                "Gemma-300M action expert"))
FLAVORS.add("pi05", replace(
    PI0_VLM, policy="pi05", vlm_flavor="pi0_vlm",
    description="LeRobot's pi0.5 (3.35B; 3.62B in LeRobot with the expert's unused LM head): PaliGemma-3B + a "
                "Gemma-300M action expert with time-conditioned (adaRMS) norms"))

# OpenVLA-7B: Prismatic's fused DINOv2-L/14 (with 4 registers) + SigLIP-so400m/14 at 224 px, each read at its
# penultimate block (their last blocks are not built), features concatenated per patch (1024 + 1152 = 2176 wide),
# + Llama-2-7B with the 256 action tokens added to its vocabulary. The towers are built as the fused tower itself
# (models/vision.py `FusedTower`), from the two towers' configs.
SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=224,
              patch_size=14)
FLAVORS.add("openvla-7b", Flavor(
    description="OpenVLA-7B's shapes: the fused DINOv2-L + SigLIP-so400m tower, Llama-2-7B",
    vision=dict(image_size=224, patch_size=14, towers=[
        dict(model_type="dinov2_with_registers", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
             mlp_ratio=4, patch_size=14, image_size=224, num_register_tokens=4),
        dict(model_type="siglip_vision_model", **SO400M)]),
    llm=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=32064, max_position_embeddings=4096),
    projector_hidden=8704,
    action_hidden=1024,
    nominal_params={"llm": 6.74e9},
    vision_type="vlaforge_fused",
))

# A Gemma3-4B-based VLA: SigLIP-so400m at 224 px (256 tokens, as many as Gemma3's pooled 896-px image) + Gemma3-4B's
# text model (34 blocks of 2560, 8 heads of 256 over 4 KV heads, five sliding-window blocks of 1024 tokens to one
# global, four norms per block, q/k norms).
FLAVORS.add("gemma3-4b-vla", Flavor(
    description="SigLIP-so400m + Gemma3-4B's text model (a Gemma3-based VLA)",
    vision=dict(SO400M),
    llm=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
             num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024,
             query_pre_attn_scalar=256, max_position_embeddings=131072),
    projector_hidden=2560,
    action_hidden=1024,
    llm_type="gemma3_text",
))

# A Qwen3-MoE-based VLA: SigLIP-so400m at 224 px + Qwen3-30B-A3B (48 blocks of 2048, 32 heads of 128 over 4 KV
# heads, 128 experts of 768 per block, 8 routed per token: 30.5B parameters, 3.3B active).
FLAVORS.add("qwen3-moe-vla", Flavor(
    description="SigLIP-so400m + Qwen3-30B-A3B (a Qwen3-MoE-based VLA)",
    vision=dict(SO400M),
    llm=dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
             num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
             norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960),
    projector_hidden=2048,
    action_hidden=1024,
    nominal_params={"llm": 30.5e9},  # Qwen3-30B-A3B's published total
    llm_type="qwen3_moe",
))


def refuse_policy(name: str, doing: str, instead: str) -> None:
    """Refuse flavor `name` when it is a LeRobot policy, which `doing` cannot handle.

    Args:
        doing: what cannot handle it, e.g. "profile checkpoints vlaforge's components".
        instead: how to use its VLM's shapes; "{vlm}" stands for that flavor's name.

    Raises:
        VlaforgeError: "model.flavor = 'pi0' is LeRobot's pi0 policy; DOING: INSTEAD".
    """
    flavor = FLAVORS.get(name)
    if flavor.policy:
        raise VlaforgeError(f"model.flavor = '{name}' is LeRobot's {flavor.policy} policy; {doing}: "
                            + instead.format(vlm=flavor.vlm_flavor))
