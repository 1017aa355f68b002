"""Fine-tuning an exported model: a new classifier head (``head``), and LoRA adapters
(``lora``). Graph surgery on the ModelProto before training; nothing here imports torch."""

from .head import HeadChoice, replace_head

__all__ = ["HeadChoice", "replace_head"]
