"""``tr-onnx inspect`` with the fine-tuning flags (issue 33): the training plan of a LoRA or
new-head model holds gradients and optimizer state for the trainable tensors only. The
oracle is PyTorch (and peft): the parameters it trains, their bytes each rounded up to the
MemoryPlan's 256-byte slots, against the GRAD and OPT_STATE regions ``inspect --json``
reports, for the fine-tuning plan and for full fine-tuning."""

from __future__ import annotations

import json

import pytest
import real_exports as rx
import torch

from tr_onnx.cli import main
from tr_onnx.memory import ALIGN

peft = pytest.importorskip("peft")

RANK = 8
SHAPES = ["--batch", str(rx.BATCH), "--shape", f"input_ids={rx.BATCH},{rx.SEQ}",
          "--shape", f"attention_mask={rx.BATCH},{rx.SEQ}"]
ADAMW_MOMENTS = 2  # exp_avg and exp_avg_sq per trainable tensor (the default optimizer)


def slots(params) -> int:
    """The bytes of float32 tensors each in its own 256-byte-aligned slot."""
    return sum(-(-4 * p.numel() // ALIGN) * ALIGN for p in params)


def inspect_json(capsys, *args: str) -> dict:
    assert main(["inspect", *args, *SHAPES, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("inspect") / "llama.onnx"
    return rx.export(rx.build("llama", "dynamo"), "llama", "dynamo", path)


def test_lora_plans_gradients_and_adamw_state_for_the_adapters_only(llama, capsys):
    cost = inspect_json(capsys, str(llama), "--lora", f"rank={RANK},targets=q_proj|v_proj"
                        )["finetune_cost"]
    module = peft.inject_adapter_in_model(peft.LoraConfig(
        r=RANK, lora_alpha=16, target_modules=["q_proj", "v_proj"]), rx.build("llama", "dynamo"))
    adapters = [p for p in module.parameters() if p.requires_grad]
    assert cost["trainable"] == len(adapters) == 4 * rx.LAYERS
    assert cost["trainable_elements"] == sum(p.numel() for p in adapters)
    assert cost["grad_bytes"] == slots(adapters)
    assert cost["opt_state_bytes"] == ADAMW_MOMENTS * slots(adapters)
    base = list(rx.build("llama", "dynamo").parameters())
    full = cost["full"]
    assert cost["frozen"] == full["trainable"] == len(base)
    assert cost["frozen_elements"] == full["trainable_elements"] == sum(p.numel() for p in base)
    assert full["grad_bytes"] == slots(base)
    assert full["opt_state_bytes"] == ADAMW_MOMENTS * slots(base)
    assert cost["arena_bytes"] < full["arena_bytes"]


def test_new_head_trained_alone_plans_gradients_for_the_head_only(tmp_path, capsys):
    path = rx.export(rx.build("bert", "classic"), "bert", "classic", tmp_path / "bert.onnx")
    cost = inspect_json(capsys, str(path), "--num-classes", "3", "--train-only", "head"
                        )["finetune_cost"]
    head = list(torch.nn.Linear(rx.HIDDEN, 3).parameters())  # what --num-classes 3 puts there
    assert cost["trainable"] == len(head)
    assert cost["grad_bytes"] == slots(head)
    assert cost["opt_state_bytes"] == ADAMW_MOMENTS * slots(head)
    assert cost["full"]["grad_bytes"] > 10 * cost["grad_bytes"]


def test_inspect_prints_the_cost_beside_full_fine_tuning(llama, capsys):
    assert main(["inspect", str(llama), "--lora", "rank=2", *SHAPES]) == 0
    out = capsys.readouterr().out
    assert "full fine-tuning" in out
    assert "GRAD and OPT_STATE hold the" in out


def test_inspect_refuses_what_train_refuses(llama, capsys):
    assert main(["inspect", str(llama), "--head", "node_linear", *SHAPES]) == 2  # usage
    assert "--head needs --num-classes" in capsys.readouterr().err
