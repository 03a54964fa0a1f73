"""`[components.*]`: the per-component policy - precision, checkpointing, offload, QAT, optimizer settings
(learning rate, weight decay, 8-bit moments, stochastic rounding), freezing and LoRA - of `vision`, `projector`,
`llm` and `action_head`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vlaforge import COMPONENTS
from vlaforge.config.base import Section
from vlaforge.config.lora import LoraConfig

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
Checkpointing = Literal["none", "full", "selective", "selective_attn", "selective_ffn", "every_nth"]
Offload = Literal["none", "cpu", "nvme"]


# The components the config knows to have no transformer blocks today: selective checkpointing and the per-block
# settings are refused on them (config/unused.py). NOTE: a config cannot ask the model (`models.blocks.blocks_of`);
# the pretrained policies' action expert will take action_head off this list.
BLOCKLESS = ("projector", "action_head")


class ComponentConfig(Section):
    """Per-component policy: precision, memory techniques, optimizer settings, freezing."""

    precision: Precision = Field("fp32", description="compute dtype: fp32 | bf16 | fp16 (with loss scaling) | fp8 "
                                                     "(torchao float8 linears, bf16 elsewhere)")
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field("rowwise", description="torchao float8 scaling "
                                                         "(precision = 'fp8')")
    checkpointing: Checkpointing = Field("none", description="activation checkpointing per block: none | full | "
                                         "selective (keep attention, recompute FFN) | selective_attn | "
                                         "selective_ffn | every_nth")
    checkpoint_every_n: int = Field(2, ge=1, description="every_nth: checkpoint blocks 0, N, 2N, ...")
    offload: Offload = Field("none", description="move tensors saved for backward to cpu (pinned) or nvme files")
    offload_min_bytes: int = Field(1 << 20, ge=0, description="offload only saved tensors at least this large")
    offload_fraction: float = Field(1.0, gt=0, le=1, description="share of blocks offloaded, earliest first "
                                                                 "(non-block parts only at 1.0)")
    offload_path: str | None = Field(None, description="nvme: folder for the files (None: the system temp dir)")
    qat: Literal["none", "int4", "int3", "int2"] = Field(
        "none", description="quantization-aware training: torchao fake quantization of the component's linears (and "
                            "the LLM's token embedding) at this width; `vlaforge quantize` converts the trained "
                            "weights to exactly that forward")
    qat_group_size: int = Field(32, ge=2, description="qat: weights per scale (a power of two)")
    optim_state: Literal["master", "8bit", "cpu"] = Field(
        "master", description="AdamW moments: master (in the weights' master dtype, fused torch AdamW) | 8bit "
                              "(torchao's blockwise 8-bit moments, blocks of 256; tensors under 4096 values or not a "
                              "multiple of 256 keep master-dtype moments) | cpu (fp32 master weights, both moments "
                              "and the step on the host, the device keeping its weights and gradients; one process)")
    stochastic_rounding: bool = Field(False, description="update the bf16 master weights with stochastic rounding "
                                                         "(torchao; unbiased small updates): needs precision other "
                                                         "than fp32 and train.precision_master = 'bf16'")
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    trainable: bool = True
    unfreeze_at_step: int | None = Field(None, ge=0, description="a frozen component starts training here")
    unfreeze_last_blocks: int | None = Field(None, ge=1, description="at unfreeze_at_step, train only the last K "
                                                                      "blocks (and what follows them)")
    lora: LoraConfig | None = Field(None, description="low-rank adapters over the frozen base (techniques/lora.py): "
                                                      "the adapters are the component's trainable parameters")

    @model_validator(mode="after")
    def _qat_fits(self) -> "ComponentConfig":
        if self.qat_group_size & (self.qat_group_size - 1):
            raise ValueError(f"qat_group_size = {self.qat_group_size} must be a power of two (e.g. 32)")
        if self.qat != "none" and self.precision == "fp8":
            raise ValueError(f"qat = {self.qat!r} with precision = 'fp8': both replace the linears; train with "
                             "precision = 'bf16' and qat")
        if self.lora is not None and self.precision == "fp8":
            raise ValueError("lora with precision = 'fp8': fp8 linears and adapters both replace the linears; train "
                             "the adapters with precision = 'bf16' (lora.base = 'nf4' shrinks the base further)")
        if self.lora is not None and self.qat != "none":
            raise ValueError(f"lora with qat = {self.qat!r}: fake quantization and adapters both replace the "
                             "linears; train the adapters over a quantized base instead (lora.base = 'int8' | 'nf4')")
        if self.lora is not None and self.lora.base == "bf16" and self.precision == "fp32":
            raise ValueError("lora.base = 'bf16' on a component with precision = 'fp32': its linears would mix bf16 "
                             "weights with fp32 inputs; set precision = 'bf16' (or lora.base = 'nf4' / 'int8', which "
                             "dequantize to the input's dtype)")
        return self

    @model_validator(mode="after")
    def _freeze_schedule(self) -> "ComponentConfig":
        if self.unfreeze_at_step is not None and self.trainable:
            raise ValueError("unfreeze_at_step needs trainable = false (the component is frozen until then)")
        if self.unfreeze_last_blocks is not None and self.unfreeze_at_step is None:
            raise ValueError("unfreeze_last_blocks needs unfreeze_at_step")
        if self.lora is not None and not self.trainable and self.unfreeze_at_step is None:
            raise ValueError("lora on a component with trainable = false: its adapters would never train; drop "
                             "lora, or set unfreeze_at_step for when the adapters start training")
        chosen = [f for f, on in ((f"optim_state = '{self.optim_state}'", self.optim_state != "master"),
                                  ("stochastic_rounding", self.stochastic_rounding)) if on]
        if self.optim_state == "cpu" and self.stochastic_rounding:
            raise ValueError("stochastic_rounding with optim_state = 'cpu': the host keeps fp32 master weights, so "
                             "nothing rounds stochastically; drop one of them")
        if chosen and not self.trainable and self.unfreeze_at_step is None:
            raise ValueError(f"{' and '.join(chosen)} on a component with trainable = false: it never steps, so "
                             "it has no optimizer state to keep; drop it, or set unfreeze_at_step")
        return self


class ComponentsConfig(Section):
    vision: ComponentConfig = Field(default_factory=lambda: ComponentConfig(lr=1e-5))
    projector: ComponentConfig = Field(default_factory=lambda: ComponentConfig(lr=1e-4))
    llm: ComponentConfig = Field(default_factory=lambda: ComponentConfig(lr=1e-4, weight_decay=0.1))
    action_head: ComponentConfig = Field(default_factory=lambda: ComponentConfig(lr=5e-4, weight_decay=0.01))
    allow_fp8_vision: bool = Field(False, description="permit vision.precision = 'fp8' (off: its small gradients "
                                                      "and patch-embedding statistics lose accuracy in fp8)")

    @model_validator(mode="after")
    def _fp8_placement(self) -> "ComponentsConfig":
        if self.vision.precision == "fp8" and not self.allow_fp8_vision:
            raise ValueError("vision.precision = 'fp8' is refused: vision gradients are 10-100x smaller than the "
                             "LLM's and fp8 (e5m2 gradients, 2-3 mantissa bits) loses them; use 'bf16', or set "
                             "components.allow_fp8_vision = true to accept it")
        for name in BLOCKLESS:
            strategy = getattr(self, name).checkpointing
            if strategy not in ("none", "full"):
                raise ValueError(f"{name}.checkpointing = {strategy!r}: the {name} has no transformer blocks to "
                                 "checkpoint selectively; use 'none' or 'full'")
        if self.action_head.precision == "fp8":
            raise ValueError("action_head.precision = 'fp8' is refused: the head regresses continuous actions "
                             "from small layers where fp8 costs accuracy and saves nothing; use 'bf16' or 'fp32'")
        return self

    def items(self) -> list[tuple[str, ComponentConfig]]:
        return [(name, getattr(self, name)) for name in COMPONENTS]
