"""Optimizer and schedule arguments (issue 12, item 6): ``--lr nan`` trained, exited 0 and
exported NaN weights; negative learning rates, betas outside [0, 1), negative eps or weight
decay were accepted. Every argument is checked as ``torch.optim`` checks it -- the oracle is
torch 2.13 itself: where it raises, our message carries its message -- and NaN and infinity are
rejected too, which PyTorch lets through. The error is an ``OptionError`` (a ``TrOnnxError``
and a ``ValueError``) naming the argument and its value; ``tr-onnx train`` exits with status 2
and one line before any step, writing nothing.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import tr_onnx
from tr_onnx.cli import main
from tr_onnx.optim import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    Cosine,
    StepLR,
    Warmup,
    make_optimizer,
    make_schedule,
)

MLP = str(Path(__file__).parent.parent / "model_zoo" / "mlp.onnx")
NAN, INF = math.nan, math.inf
OURS = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW, "Adagrad": Adagrad}
TORCH = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW,
         "Adagrad": torch.optim.Adagrad}


def torch_error(name: str, kwargs: dict) -> str | None:
    """PyTorch's message rejecting these arguments, or None where it takes them."""
    try:
        TORCH[name]([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


def bad(name: str, arg: str, value, **others):
    kwargs = {**others, arg: value}
    shown = value[int(arg[-2])] if arg.startswith("betas[") else value
    return pytest.param(name, arg, kwargs, shown, id=f"{name}-{arg}={value}")


BAD = [
    *(bad(opt, "lr", v) for opt in OURS for v in (-0.1, NAN, INF, -INF)),
    *(bad("SGD", arg, v) for arg in ("momentum", "weight_decay") for v in (-0.5, NAN, INF)),
    *(bad("SGD", "dampening", v) for v in (NAN, INF)),
    bad("SGD", "nesterov", True),  # momentum 0
    bad("SGD", "nesterov", True, momentum=0.9, dampening=0.1),
    *(bad(opt, arg, v) for opt in ("Adam", "AdamW") for arg in ("eps", "weight_decay")
      for v in (-1e-8, NAN, INF)),
    *(bad(opt, f"betas[{i}]", betas) for opt in ("Adam", "AdamW")
      for i, betas in ((0, (1.0, 0.999)), (0, (-0.1, 0.999)), (0, (NAN, 0.999)),
                       (1, (0.9, 1.0)), (1, (0.9, -0.5)), (1, (0.9, INF)))),
    *(bad("Adagrad", arg, v) for arg in ("lr_decay", "weight_decay", "initial_accumulator_value",
                                         "eps") for v in (-0.1, NAN, INF)),
]


def torch_kwargs(kwargs: dict) -> dict:
    return {("betas" if k.startswith("betas[") else k): v for k, v in kwargs.items()}


@pytest.mark.parametrize("name, arg, kwargs, value", BAD)
def test_bad_optimizer_argument_is_an_option_error(name, arg, kwargs, value):
    kwargs = torch_kwargs(kwargs)
    theirs = torch_error(name, kwargs)
    with pytest.raises(tr_onnx.OptionError) as info:
        OURS[name](**kwargs)
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, tr_onnx.TrOnnxError)
    assert msg.startswith(f"{name}: ") and "\n" not in msg
    if arg == "nesterov":
        assert "momentum=" in msg and "dampening=" in msg
    else:
        assert f"{arg} must be" in msg and f": {value} (" in msg
    if theirs is not None:  # PyTorch rejects it too: with the same words
        assert theirs in msg
    elif not (isinstance(value, float) and not math.isfinite(value)):
        pytest.fail(f"torch takes {kwargs} and so would we: only non-finite values go further")


@pytest.mark.parametrize("name, arg, kwargs, value", BAD)
def test_bad_argument_is_rejected_from_a_config_and_by_the_session(name, arg, kwargs, value):
    kwargs = torch_kwargs(kwargs)
    with pytest.raises(tr_onnx.OptionError):
        make_optimizer({"name": name, **kwargs})
    if arg == "lr":
        with pytest.raises(tr_onnx.OptionError, match="Invalid learning rate"):
            tr_onnx.TrainingSession(MLP, optimizer=name.lower(), lr=value, backend="numpy")


# the edges PyTorch takes: zero everywhere, nesterov with momentum and no dampening
GOOD = [
    pytest.param("SGD", {"lr": 0.0, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0},
                 id="SGD-zeros"),
    pytest.param("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, id="SGD-nesterov"),
    pytest.param("SGD", {"lr": 0.1, "momentum": 0.9, "dampening": -0.5}, id="SGD-dampening"),
    pytest.param("Adam", {"lr": 0.0, "betas": (0.0, 0.0), "eps": 0.0, "weight_decay": 0.0},
                 id="Adam-zeros"),
    pytest.param("AdamW", {"lr": 1e-3, "betas": (0.999999, 0.5), "weight_decay": 0.0},
                 id="AdamW-betas"),
    pytest.param("Adagrad", {"lr": 0.0, "lr_decay": 0.0, "weight_decay": 0.0,
                             "initial_accumulator_value": 0.0, "eps": 0.0}, id="Adagrad-zeros"),
]


@pytest.mark.parametrize("name, kwargs", GOOD)
def test_arguments_pytorch_takes_are_taken(name, kwargs):
    assert torch_error(name, kwargs) is None
    opt = OURS[name](**kwargs)
    again = make_optimizer(opt.config())
    assert again == opt


SCHEDULES = [
    pytest.param(StepLR, "step_size", 0, id="StepLR-step_size=0"),
    pytest.param(StepLR, "step_size", -3, id="StepLR-step_size=-3"),
    pytest.param(StepLR, "step_size", 2.5, id="StepLR-step_size=2.5"),
    pytest.param(StepLR, "gamma", -0.1, id="StepLR-gamma=-0.1"),
    pytest.param(StepLR, "gamma", NAN, id="StepLR-gamma=nan"),
    pytest.param(StepLR, "gamma", INF, id="StepLR-gamma=inf"),
    pytest.param(Cosine, "total_steps", 0, id="Cosine-total_steps=0"),
    pytest.param(Cosine, "eta_min_factor", -0.5, id="Cosine-eta_min_factor=-0.5"),
    pytest.param(Cosine, "eta_min_factor", NAN, id="Cosine-eta_min_factor=nan"),
    pytest.param(Warmup, "warmup_steps", -1, id="Warmup-warmup_steps=-1"),
    pytest.param(Warmup, "warmup_steps", NAN, id="Warmup-warmup_steps=nan"),
    pytest.param(Warmup, "after", "cosine", id="Warmup-after=str"),
]


@pytest.mark.parametrize("cls, arg, value", SCHEDULES)
def test_bad_schedule_argument_is_an_option_error(cls, arg, value):
    with pytest.raises(tr_onnx.OptionError) as info:
        cls(**{arg: value})
    msg = str(info.value)
    assert msg.startswith(f"{cls.__name__}: ") and (f"{arg}=" in msg or f"{arg} must" in msg)
    assert repr(value) in msg or str(value) in msg
    if arg != "after":  # a name there is a schedule's name
        with pytest.raises(tr_onnx.OptionError):
            make_schedule({"name": cls.__name__, arg: value})


@pytest.mark.parametrize("cls, kwargs", [
    pytest.param(StepLR, {"step_size": 3, "gamma": 0.5}, id="StepLR"),
    pytest.param(Cosine, {"total_steps": 10, "eta_min_factor": 0.1}, id="Cosine"),
])
def test_valid_schedules_follow_pytorch(cls, kwargs):
    """The checks leave the valid schedules as they were: lr(step) as torch's schedulers (for
    Cosine up to its end, where ours stays at the minimum and torch's rises again)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.2)
    if cls is StepLR:
        sched = torch.optim.lr_scheduler.StepLR(opt, kwargs["step_size"], kwargs["gamma"])
    else:
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, kwargs["total_steps"], eta_min=0.2 * kwargs["eta_min_factor"])
    want = []
    for _ in range(11):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = cls(**kwargs)
    np.testing.assert_allclose([0.2 * ours.factor(s) for s in range(1, 12)], want, rtol=1e-12)


@pytest.mark.parametrize("lr", ["nan", "inf", "-0.001"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_cli_rejects_a_bad_lr_before_training(tmp_path, monkeypatch, capsys, lr, optimizer):
    monkeypatch.chdir(tmp_path)

    def train_step(*args, **kw):
        raise AssertionError("a training step ran")

    monkeypatch.setattr(tr_onnx.TrainingSession, "train_step", train_step)
    rc = main(["train", MLP, "--data", "digits", "--epochs", "1", "--backend", "numpy",
               "--optimizer", optimizer, "--lr", lr, "--out", "out.onnx",
               "--checkpoint-dir", "ckpt", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("tr-onnx: error: ") and err.count("\n") == 1, err
    assert f"Invalid learning rate: {float(lr)}" in err and "lr must be" in err
    assert not (tmp_path / "out.onnx").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("option, value", [
    ("clip_grad_norm", float("nan")), ("clip_grad_norm", float("inf")), ("clip_grad_norm", -1.0),
    ("clip_grad_norm", 0.0), ("clip_grad_norm", "1"), ("max_bad_steps", 0),
    ("max_bad_steps", 2.5), ("tie_shared_initializers", "yes")])
def test_session_options_are_checked_before_anything_runs(option, value):
    """A negative clip norm would flip every gradient (PyTorch's clip coefficient goes
    negative), NaN would zero them: both are refused, like the optimizer's arguments."""
    with pytest.raises(tr_onnx.OptionError, match=option):
        tr_onnx.TrainingSession(MLP, backend="numpy", **{option: value})
