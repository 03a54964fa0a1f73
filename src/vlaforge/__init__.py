"""vlaforge: train Vision-Language-Action models efficiently, from one GPU to many nodes."""

__version__ = "0.1.0"

COMPONENTS = ("vision", "projector", "llm", "action_head")
"""The four children of every VLA; the vocabulary of configs, param groups, policies and metrics."""


def _quiet_optional_kernels() -> None:
    """torchao (imported by transformers when installed) logs a warning for each optional CUDA kernel library its
    CPU install cannot load and for a missing triton, and torch logs a deprecation per enum torchao registers;
    none is actionable. Filters on the parent loggers do not see child records, so the children are named."""
    import logging

    noise = ("Failed to load", "is an Enum subclass and is now natively supported", "Detected no triton")

    def keep(record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in noise)

    for name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree"):
        logging.getLogger(name).addFilter(keep)


_quiet_optional_kernels()
