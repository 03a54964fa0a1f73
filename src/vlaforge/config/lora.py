"""`components.<c>.lora`: low-rank adapters on a component's linears over a frozen (possibly quantized) base
(techniques/lora.py; docs/lora.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from vlaforge.config.base import Section

# how the frozen base of a LoRA component is stored: "auto" keeps the component's weight dtype (its master dtype)
LoraBase = Literal["auto", "fp32", "bf16", "int8", "nf4"]


class LoraConfig(Section):
    """LoRA (Hu et al. 2021) on a component, with peft's semantics: y = W x + (alpha / rank) B A dropout(x), A
    initialised at random and B at zero, so training starts from the base model exactly. `base = "nf4"` is QLoRA
    (Dettmers et al. 2023): the frozen base held as torchao's NF4 tensor during training."""

    rank: int = Field(16, ge=1, le=4096, description="r: inner width of each adapter (A: r x in, B: out x r)")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: the update is (alpha / rank) B A x "
                                                 "(alpha / sqrt(rank) with rslora)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter path's input")
    targets: Literal["all-linear", "lerobot"] | list[str] = Field(
        "all-linear", description="the linears that get adapters: every nn.Linear of the component (the LLM's "
                                  "output head excepted), 'lerobot' (a LeRobot policy's action head: LeRobot's own "
                                  "default targets, the expert's q_proj / v_proj and the state, action and time "
                                  "projections), or module names inside the component, each matching a module "
                                  "whose name is it or ends in '.' + it (e.g. ['q_proj', 'v_proj'])")
    full: list[str] = Field(
        default_factory=list, description="modules inside the component that train in full beside the adapters "
                                          "(peft's modules_to_save): 'convs' (every convolution), 'norms' (every "
                                          "LayerNorm / RMSNorm / GroupNorm / BatchNorm), or module names as in "
                                          "targets; none may hold an adapted linear. A conv stem has no linears, so "
                                          "adapters alone leave it as pretraining did (docs/lora.md)")
    init: Literal["kaiming", "gaussian"] = Field(
        "kaiming", description="initialisation of A (B starts at zero either way): peft's default (Kaiming-uniform) "
                               "or gaussian with std 1 / rank")
    rslora: bool = Field(False, description="rank-stabilised scaling alpha / sqrt(rank) (Kalajdzievski 2023)")
    base: LoraBase = Field("auto", description="storage of the frozen base linears: auto (the component's weight "
                                               "dtype), fp32, bf16, int8 (torchao int8 weight-only) or nf4 (torchao "
                                               "NF4, QLoRA); adapters keep the component's weight dtype")

    @field_validator("targets")
    @classmethod
    def _names(cls, value):
        if isinstance(value, list) and (not value or any(not v or v != v.strip(". ") for v in value)):
            raise ValueError("targets must be 'all-linear' or a non-empty list of module names (no leading or "
                             "trailing dots), e.g. ['q_proj', 'v_proj']")
        return value

    @field_validator("full")
    @classmethod
    def _full_names(cls, value):
        if any(not v or v != v.strip(". ") for v in value):
            raise ValueError("full must be a list of 'convs', 'norms' or module names (no leading or trailing dots)")
        return value

    @property
    def scaling(self) -> float:
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)


# The folders that give each component pretrained weights: a LeRobot policy folder (`model.lerobot`) gives every
# component its weights; an assembled model's action head has none (only train.init_from).
PRETRAINED_FIELDS = {"vision": ("vision", "vlm", "lerobot"), "projector": ("vlm", "lerobot"),
                     "llm": ("llm", "vlm", "lerobot"), "action_head": ("lerobot",)}


def random_bases(cfg) -> list[str]:
    """The components whose LoRA adapters would train over a randomly initialised base: no train.init_from and none
    of the component's pretrained folders (`model.<source>.pretrained`)."""
    if cfg.train.init_from:
        return []
    return [c for c, fields in PRETRAINED_FIELDS.items() if getattr(cfg.components, c).lora is not None
            and not any(getattr(cfg.model, f).pretrained for f in fields)]


def check_pretrained_base(cfg) -> None:
    """Before training: adapters over a random frozen base learn nothing worth keeping, so a LoRA component needs a
    pretrained base unless train.lora_random_base asks for a random one on purpose.

    Raises:
        VlaforgeError: naming the component and the ways to give it a base.
    """
    from vlaforge.errors import VlaforgeError

    random = random_bases(cfg)
    if random and not cfg.train.lora_random_base:
        c = random[0]
        ways = ["train.init_from = RUN (a trained run or checkpoint)", *(f"model.{f}.pretrained"
                                                                        for f in PRETRAINED_FIELDS[c])]
        raise VlaforgeError(f"components.{c}.lora trains adapters over a frozen {c} that would be random: give it a "
                            f"pretrained base with {' or '.join(ways)}, or set train.lora_random_base = true to "
                            "train over a random base on purpose")
