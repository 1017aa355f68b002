"""Fine-tuning an exported model: a new classifier head (``head``), what trains and when
(``freeze``), and LoRA adapters (``lora``). Graph surgery on the ModelProto and session
options before training; nothing here imports torch."""

from .freeze import finetune_options, train_only_names
from .head import HeadChoice, replace_head
from .lora import (
    LoraInfo,
    adapter_model,
    add_lora,
    apply_lora,
    load_adapters,
    merge_lora,
    save_adapters,
    write_adapter,
)

__all__ = ["HeadChoice", "LoraInfo", "adapter_model", "add_lora", "apply_lora",
           "finetune_options", "load_adapters", "merge_lora", "replace_head", "save_adapters",
           "train_only_names", "write_adapter"]
