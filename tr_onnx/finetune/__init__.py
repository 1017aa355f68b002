"""Fine-tuning an exported model: a new classifier head (``head``), what trains and when
(``freeze``), and LoRA adapters (``lora``). Graph surgery on the ModelProto and session
options before training; nothing here imports torch."""

from .freeze import finetune_options, train_only_names
from .head import HeadChoice, replace_head

__all__ = ["HeadChoice", "finetune_options", "replace_head", "train_only_names"]
