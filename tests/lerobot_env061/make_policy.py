"""Writes a tiny LeRobot 0.6.1 policy folder, fully offline, by LeRobot's own `save_pretrained` of the policy and of
its pre/post processor pipelines (the policy's `make_*_pre_post_processors` with seeded dataset stats).

usage: PYTHONPATH=.venv/lerobot061:tests/lerobot_env061 python tests/lerobot_env061/make_policy.py KIND OUT
KIND: smolvla | smolvla_half (an expert layer every other VLM layer; self-attention every 4th) | pi0 | pi05 (pi0.5)
      | pi05_empty (pi05 with empty_cameras=1) | pi0_base | pi05_base (every config field at LeRobot's default)

OUT/policy/     config.json, model.safetensors, policy_preprocessor.json, policy_postprocessor.json + state files
OUT/vlm/        (smolvla*) the tiny SmolVLM (config, random weights, tokenizer, processor) SmolVLA builds from
OUT/tokenizer/  (pi0*) the tiny tokenizer the saved preprocessor's tokenizer step names (instead of PaliGemma's);
                *_base: the step names PaliGemma's Hub id as LeRobot's real folders do, and this folder is what a
                test caches under that id (tests/lerobot061.py `hub_cache`)
OUT/sizes.json  (pi0*) the sizes tiny_pi0.py builds the `gemma_2b` / `gemma_300m` variants and SigLIP at
OUT/info.json   kind, versions, parameter count
Features: cameras observation.images.top / .wrist (3, 24, 32), observation.state (6,), action (6,); chunk 5.
Every parameter is perturbed with seeded noise before saving (LeRobot zero-inits some norms, and pi0.5's adaRMS
`dense` layers): same folder every run.
pi05 keeps LeRobot's default normalization (QUANTILES for state and action) and writes the discretized state into
the prompt ("Task: ..., State: 12 200 ...;\nAction: "), tokenized to PI05_TOKENIZER_MAX_LENGTH tokens.
pi0_base / pi05_base: the tiny sizes, but every config field at LeRobot 0.6.1's default for the type (chunk 50,
max_state_dim / max_action_dim 32, 10 denoising steps, image_resolution 224 - SigLIP in patches of 28, 64 tokens a
camera -, tokenizer_max_length 48 / 200, normalization MEAN_STD / QUANTILES) but device cpu and push_to_hub false, so
that `lerobot-train --policy.type=pi0 --policy.pretrained_path=OUT/policy` (a config from the type's defaults, the
weights from the folder) loads them; both share one tokenizer (spaces as tokens), as the real pi0 and pi0.5 share
PaliGemma's.
"""

from __future__ import annotations

import json
import os
import string
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

KINDS = ("smolvla", "smolvla_half", "pi0", "pi05", "pi05_empty", "pi0_base", "pi05_base")
CAMERAS = ("observation.images.top", "observation.images.wrist")
IMAGE_SHAPE = (3, 24, 32)  # not square: resize-with-padding pads
STATE_DIM = ACTION_DIM = 6
CHUNK = 5
COMMON = dict(chunk_size=CHUNK, n_action_steps=CHUNK, max_state_dim=8, max_action_dim=8, tokenizer_max_length=12,
              train_expert_only=False, freeze_vision_encoder=False, device="cpu", push_to_hub=False)
# smolvla_half: an expert layer at VLM layers 0 and 2 (num_expert_layers=2). LeRobot 0.6.1 runs that only when
# every self-attention VLM layer has an expert layer and expert layer j is built for the attention VLM layer 2j
# runs: self-attention every 2nd layer fails in training (expert 1 is built for cross-attention, VLM layer 2
# self-attends: "mat1 and mat2 shapes cannot be multiplied (10x48 and 32x32)"), every 3rd in sampling (VLM layer 3
# self-attends without an expert: "torch.cat(): expected a non-empty list of Tensors"). Every 4th: expert 0
# self-attends at VLM layer 0, expert 1 cross-attends at layer 2, layers 1 and 3 cross-attend without an expert.
SMOLVLA_LAYERS = {"smolvla": dict(num_expert_layers=-1, self_attn_every_n_layers=2),
                  "smolvla_half": dict(num_expert_layers=2, self_attn_every_n_layers=4)}
# pi0.5's prompt "Task: {task}, State: {bins};\nAction: " holds the 6 state values' bin indices (np.digitize into 256
# bins of [-1, 1] minus 1: -1 ... 255, -1 and 255 for states outside [q01, q99]); with the tiny pi05 tokenizer (digits,
# spaces, punctuation single tokens) the 4 standard tasks take 42 to 65 tokens (<bos> included; 65: "open the top
# drawer and then close it" with six 3-digit bins), so 80 never truncates them (the step pads to max_length)
PI05_TOKENIZER_MAX_LENGTH = 80
HUB_TOKENIZER = "google/paligemma-3b-pt-224"  # the tokenizer LeRobot's pi0 / pi0.5 pipelines name
# config fields of the pi kinds beyond the features (a *_base kind: LeRobot's defaults, but where it runs and uploads)
_TINY = dict(image_resolution=(32, 32), num_inference_steps=3)
PI_CONFIG = {"pi0": {**COMMON, **_TINY},
             "pi05": {**COMMON, **_TINY, "tokenizer_max_length": PI05_TOKENIZER_MAX_LENGTH},
             "pi05_empty": {**COMMON, **_TINY, "tokenizer_max_length": PI05_TOKENIZER_MAX_LENGTH, "empty_cameras": 1},
             "pi0_base": dict(device="cpu", push_to_hub=False),
             "pi05_base": dict(device="cpu", push_to_hub=False)}
BASE_PATCH = 28  # SigLIP's patch at the default 224 px: 8 x 8 tokens a camera
# a BPE over these words and every printable character (so any task tokenizes without <unk>)
WORDS = ("open close the door drawer press button reach goal pick place put move push pull left right up down red "
         "green blue cube block top wrist and then a of to").split()
STAT_KEYS = ("min", "q01", "q10", "q50", "q90", "q99", "max")
STAT_Z = (-2.6, -2.33, -1.28, 0.0, 1.28, 2.33, 2.6)  # normal quantiles of the keys above (min/max a bit beyond)


def bpe_tokenizer(special: list[str], bos: str | None = None, spaces: bool = False, **tokens):
    """A small BPE `PreTrainedTokenizerFast`; `bos`: a token the tokenizer prepends (Gemma's tokenizers do);
    `spaces`: every space is a token too (else spaces only separate words)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # words, punctuation and newlines (the pipelines' newline steps end every task with "\n": it is a token, as in
    # the real tokenizers, so a reader that forgets the step differs); other whitespace separates, or with `spaces`
    # each space is a token as well (pi0.5's prompt "State: 12 200;\nAction: ": digits are single tokens, so only
    # the spaces tell "1 22" from "12 2", and a missing space in the prompt changes the tokens)
    pattern, alphabet = r"\w+|[^\w\s]+|\n", string.ascii_letters + string.digits + string.punctuation + "\n"
    if spaces:
        pattern, alphabet = pattern + "| ", alphabet + " "
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="removed", invert=True)
    alphabet = list(alphabet)
    tok.train_from_iterator([" ".join(WORDS) + "\n"] * 4, trainers.BpeTrainer(vocab_size=256, special_tokens=special,
                                                                        initial_alphabet=alphabet, show_progress=False))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **tokens)


def smolvlm_tokenizer():
    """A small BPE with SmolVLM's special tokens (its processor reads them)."""
    return bpe_tokenizer(
        ["<pad>", "<s>", "</s>", "<unk>", "<fake_token_around_image>", "<image>", "<global-img>",
         "<end_of_utterance>"],
        pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        extra_special_tokens={"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                              "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"})


def build_smolvlm(out: Path) -> Path:
    """The tiny SmolVLM SmolVLA builds from (`vlm_model_name` = this folder, `load_vlm_weights=False`: only its
    config, processor and tokenizer are read): SigLIP-shaped tower 32 wide, 2 layers, patch 8 on 32 px, a 2 x 2
    pixel shuffle, a Llama of width 64, 4 layers, 4 heads (2 KV) of 16."""
    from transformers import (
        LlamaConfig,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessor,
        SmolVLMProcessor,
        SmolVLMVideoProcessor,
        SmolVLMVisionConfig,
    )

    tokenizer = smolvlm_tokenizer()
    vocab = len(tokenizer)
    vision = SmolVLMVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 patch_size=8, image_size=32)
    text = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=vocab, max_position_embeddings=256,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    config = SmolVLMConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=2,
                           image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                           pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = SmolVLMForConditionalGeneration(config)
    model.save_pretrained(out)
    size = {"longest_edge": 32}
    processor = SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(size=size, max_image_size=size, do_image_splitting=False),
        tokenizer=tokenizer, video_processor=SmolVLMVideoProcessor(size=size, max_image_size=size),
        image_seq_len=(32 // 8) ** 2 // 2 ** 2)
    processor.save_pretrained(out)
    return out


def dataset_stats(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Non-degenerate seeded stats of state and action: mean, std and ordered quantiles (every key LeRobot's
    normalizer reads: MEAN_STD, MIN_MAX, QUANTILES, QUANTILE10 all work)."""
    g = torch.Generator().manual_seed(seed)
    stats = {}
    for key, dim in (("observation.state", STATE_DIM), ("action", ACTION_DIM)):
        mean = torch.randn(dim, generator=g) * 0.5
        std = 0.3 + torch.rand(dim, generator=g)
        entry = {"mean": mean, "std": std}
        for name, z in zip(STAT_KEYS, STAT_Z, strict=True):
            entry[name] = mean + z * std
        entry["count"] = torch.tensor([1000])
        stats[key] = entry
    return stats


def features():
    from lerobot.configs import FeatureType, PolicyFeature

    inputs = {cam: PolicyFeature(type=FeatureType.VISUAL, shape=IMAGE_SHAPE) for cam in CAMERAS}
    inputs["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(STATE_DIM,))
    return dict(input_features=inputs,
                output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(ACTION_DIM,))})


def perturb(policy, seed: int = 1, check: bool = True) -> None:
    """Seeded noise on every parameter (frozen ones included): norms by 0.1 (LeRobot/HF init them at 1 or 0), the
    rest by 0.02, so parity checks compare non-trivial weights. `check`: no parameter left with a zero (at published
    sizes a sum of two floats is exactly zero somewhere by chance: bench_policy.py turns it off)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            scale = 0.1 if "norm" in name else 0.02
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
            assert not check or p.count_nonzero() == p.numel(), f"{name} still has zeros"


def pi_tokenizer(kind: str, out: Path, sizes_of) -> Path:
    """OUT/tokenizer (a small BPE in place of PaliGemma's) and OUT/sizes.json (`sizes_of(vocabulary size)`), applied to
    LeRobot's pi0 / pi0.5 in this process (tiny_pi0.apply); the tokenizer's folder. Spaces are tokens but for pi0 (the
    *_base kinds share pi0.5's tokenizer, so one Hub cache entry serves both)."""
    import tiny_pi0

    tokenizer = bpe_tokenizer(["<pad>", "<bos>", "<eos>", "<unk>"], bos="<bos>", spaces=kind != "pi0",
                              pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    tokenizer_dir = (out / "tokenizer").resolve()
    tokenizer.save_pretrained(tokenizer_dir)
    sizes = sizes_of(len(tokenizer))
    (out / "sizes.json").write_text(json.dumps(sizes, indent=1) + "\n")
    tiny_pi0.apply(sizes)
    return tokenizer_dir


def pi_classes(kind: str):
    """(processor module, config class, policy class, make_pre_post_processors) of LeRobot's pi0 or pi0.5 (a kind
    pi0* or pi05*)."""
    if kind.split("_")[0] == "pi0":
        from lerobot.policies.pi0 import processor_pi0 as processor
        from lerobot.policies.pi0.configuration_pi0 import PI0Config as Config
        from lerobot.policies.pi0.modeling_pi0 import PI0Policy as Policy

        return processor, Config, Policy, processor.make_pi0_pre_post_processors
    from lerobot.policies.pi05 import processor_pi05 as processor
    from lerobot.policies.pi05.configuration_pi05 import PI05Config as Config
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy as Policy

    return processor, Config, Policy, processor.make_pi05_pre_post_processors


def paligemma_config(sizes: dict, folder: Path) -> None:
    """FOLDER/config.json: PaliGemma's config at the tiny sizes, as google/paligemma-3b-pt-224 holds one beside its
    tokenizer (transformers' AutoTokenizer reads a Hub id's config.json first, and fails offline without it)."""
    from transformers import PaliGemmaConfig

    v = sizes["variants"]["gemma_2b"]
    text = dict(model_type="gemma", hidden_size=v["width"], intermediate_size=v["mlp_dim"],
                num_hidden_layers=v["depth"], num_attention_heads=v["num_heads"], num_key_value_heads=v["num_kv_heads"],
                head_dim=v["head_dim"], vocab_size=sizes["vocab_size"])
    vision = dict(model_type="siglip_vision_model", **sizes["vision"])
    PaliGemmaConfig(text_config=text, vision_config=vision, projection_dim=sizes["projection_dim"]).save_pretrained(
        folder)


def build_pi(kind: str, out: Path, stats: dict):
    """(config, policy, preprocessor, postprocessor) of a pi0* / pi05* kind at tiny_pi0's sizes (a *_base kind:
    SigLIP at the default 224 px in patches of BASE_PATCH), its pipelines' tokenizer step naming OUT/tokenizer
    (a *_base kind: HUB_TOKENIZER, as LeRobot's real folders)."""
    import tiny_pi0

    base = kind.endswith("_base")
    processor, Config, Policy, make_processors = pi_classes(kind)
    side = Config().image_resolution[0] if base else 32
    tokenizer_dir = pi_tokenizer(kind, out, lambda vocab: tiny_pi0.sizes(vocab, side, BASE_PATCH if base else 8))
    config = Config(**PI_CONFIG[kind], **features())
    torch.manual_seed(0)
    policy = Policy(config)
    # the pipeline's tokenizer step names google/paligemma-3b-pt-224 (a hub download): built with the local one
    real_step = processor.TokenizerProcessorStep

    def local_tokenizer_step(**kwargs):
        assert kwargs.pop("tokenizer_name") == HUB_TOKENIZER
        return real_step(tokenizer_name=str(tokenizer_dir), **kwargs)

    processor.TokenizerProcessorStep = local_tokenizer_step
    try:
        pre, post = make_processors(config, dataset_stats=stats)
    finally:
        processor.TokenizerProcessorStep = real_step
    if base:  # saved as LeRobot's real folders name it (the step keeps the tokenizer it loaded)
        next(step for step in pre.steps if isinstance(step, real_step)).tokenizer_name = HUB_TOKENIZER
        paligemma_config(json.loads((out / "sizes.json").read_text()), tokenizer_dir)
    return config, policy, pre, post


def check_default_load(kind: str, folder: Path) -> None:
    """A *_base folder's weights load into the policy of the type's default config (lerobot-train's
    `--policy.type=... --policy.pretrained_path=FOLDER`: the config from the defaults and the flags, only the weights
    from the folder) with every tensor taken as saved (pi0's loader swallows mismatches, so compared here)."""
    from safetensors.torch import load_file

    _, Config, Policy, _ = pi_classes(kind)
    config = Config(device="cpu", push_to_hub=False, **features())
    config.pretrained_path = str(folder)
    state = Policy.from_pretrained(folder, config=config).state_dict()
    saved = load_file(folder / "model.safetensors")
    wrong = [k for k, v in saved.items() if k not in state or not torch.equal(state[k], v.to(state[k].dtype))]
    assert not wrong, f"the default {kind} config does not load {folder}: {wrong[:3]}"


def build(kind: str, out: Path) -> dict:
    import lerobot
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    stats = dataset_stats()
    if kind.startswith("smolvla"):
        from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
        from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
        from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

        vlm = build_smolvlm(out / "vlm").resolve()
        config = SmolVLAConfig(**COMMON, **features(), vlm_model_name=str(vlm), load_vlm_weights=False,
                               num_vlm_layers=4, expert_width_multiplier=0.75, **SMOLVLA_LAYERS[kind],
                               resize_imgs_with_padding=(32, 32), num_steps=3)
        torch.manual_seed(0)
        policy = SmolVLAPolicy(config)
        pre, post = make_smolvla_pre_post_processors(config, dataset_stats=stats)
    else:
        config, policy, pre, post = build_pi(kind, out, stats)
    perturb(policy)
    policy.save_pretrained(out / "policy")
    pre.save_pretrained(out / "policy")
    post.save_pretrained(out / "policy")
    if kind.endswith("_base"):
        check_default_load(kind, out / "policy")
    params = {id(p): p.numel() for p in policy.parameters()}
    info = {"kind": kind, "policy_type": config.type, "lerobot": lerobot.__version__,
            "transformers": transformers.__version__, "torch": torch.__version__,
            "parameters": sum(params.values()),
            "trainable_parameters": sum(p.numel() for p in policy.parameters() if p.requires_grad)}
    (out / "info.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in KINDS:
        sys.exit(__doc__)
    torch.set_num_threads(1)
    print(json.dumps(build(sys.argv[1], Path(sys.argv[2]))))
