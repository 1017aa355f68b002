"""Learning rates by group (issue 33, item 2: discriminative fine-tuning,
``TrainingSession(lr_groups={pattern: multiplier})``).

Oracle: ``torch.optim`` with parameter groups of those learning rates, training the module
that was exported (classic exporter), 3 steps of SGD (momentum, weight decay) and AdamW.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
import torch

import tr_onnx
from tr_onnx.errors import OptionError

LR, MULT, STEPS = 0.05, 0.1, 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(),
                                            torch.nn.Conv2d(4, 6, 3), torch.nn.ReLU())
        self.fc = torch.nn.Linear(6, 5)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


def _export(module) -> onnx.ModelProto:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 3, 8, 8),), buf, dynamo=False,
                          input_names=["x"], output_names=["logits"], opset_version=17,
                          dynamic_axes={"x": {0: "n"}}, do_constant_folding=False)
    return onnx.load_from_string(buf.getvalue())


def _batch(k: int):
    rng = np.random.default_rng(k)
    return rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 5, 4)


OPTIMIZERS = {  # id: (tr_onnx optimizer, torch optimizer class, its kwargs)
    "sgd": (tr_onnx.optim.SGD(lr=LR, momentum=0.9, weight_decay=1e-2), torch.optim.SGD,
            {"momentum": 0.9, "weight_decay": 1e-2}),
    "adamw": (tr_onnx.optim.AdamW(lr=LR, weight_decay=1e-2), torch.optim.AdamW,
              {"weight_decay": 1e-2}),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_lr_groups_train_as_torch_parameter_groups(name):
    ours_opt, torch_cls, kwargs = OPTIMIZERS[name]
    module = Net()
    session = tr_onnx.TrainingSession(_export(module), optimizer=ours_opt, backend="numpy",
                                      lr_groups={"features.*": MULT})
    features = [p for n, p in module.named_parameters() if n.startswith("features.")]
    opt = torch_cls([{"params": features, "lr": LR * MULT},
                     {"params": module.fc.parameters()}], lr=LR, **kwargs)
    for k in range(STEPS):
        x, y = _batch(k)
        session.train_step({"x": x}, y)
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)),
                                                 torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = session.parameters()
    moved = 0.0
    for n, p in module.named_parameters():
        want = p.detach().numpy()
        np.testing.assert_allclose(params[n], want, rtol=0, atol=1e-6, err_msg=n)
        moved = max(moved, float(np.abs(want - Net().state_dict()[n].numpy()).max()))
    assert moved > 1e-3  # the steps moved the weights far past the tolerance
    updates = [n for n in session._state.active.graph.nodes if n.op_type == ours_opt.op]
    assert len(updates) == 2


def test_lr_groups_are_checked():
    model = _export(Net())
    with pytest.raises(OptionError, match="lr_groups"):
        tr_onnx.TrainingSession(model, backend="numpy", lr_groups={"features.*": -1})


def _parse(*argv: str):
    import argparse

    from tr_onnx import cli_finetune

    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=None)
    cli_finetune.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_lr_groups_and_option_errors(tmp_path):
    from tr_onnx.cli_finetune import apply
    from tr_onnx.errors import TrOnnxError

    path = tmp_path / "net.onnx"
    onnx.save(_export(Net()), path)
    model, kwargs, _, _ = apply(_parse("--lr-group", "features.*=0.1", "--lr-group", "fc.*=2"),
                                str(path))
    assert model == str(path) and kwargs == {"lr_groups": {"features.*": 0.1, "fc.*": 2.0}}
    model, kwargs, notes, _ = apply(_parse("--num-classes", "3", "--train-only", "head"),
                                    str(path))
    assert kwargs["trainable"] == ["fc.weight", "fc.bias"] and "new head" in notes[0]
    assert model.graph.output[0].type.tensor_type.shape.dim[1].dim_value == 3
    for argv, match in ((["--head", "/fc/Gemm"], "--head needs --num-classes"),
                        (["--train-only", "head"], "--train-only head needs --num-classes"),
                        (["--unfreeze-after", "1"], "--unfreeze-after needs --train-only"),
                        (["--num-classes", "3", "--head", "nope"], "candidates: .*/fc/Gemm")):
        with pytest.raises(TrOnnxError, match=match):
            apply(_parse(*argv), str(path))
    with pytest.raises(SystemExit):
        _parse("--lr-group", "features.*")


UNFREEZE_OPTIMIZERS = {
    "sgd-dampening": (tr_onnx.optim.SGD(lr=LR, momentum=0.9, dampening=0.5), torch.optim.SGD,
                      {"momentum": 0.9, "dampening": 0.5}),
    "adamw": (tr_onnx.optim.AdamW(lr=LR, weight_decay=1e-2), torch.optim.AdamW,
              {"weight_decay": 1e-2}),
}


@pytest.mark.parametrize("name", list(UNFREEZE_OPTIMIZERS))
def test_unfrozen_parameters_start_their_optimizer_state_as_torch_add_param_group(name):
    """The head trains 2 steps, then everything 2 more: torch's ``add_param_group`` gives the
    added parameters fresh state (step 0: Adam's bias correction, SGD's first momentum
    buffer); with the head's lr group at 2x on the way."""
    ours_opt, torch_cls, kwargs = UNFREEZE_OPTIMIZERS[name]
    module = Net()
    session = tr_onnx.TrainingSession(_export(module), optimizer=ours_opt, backend="numpy",
                                      trainable=["fc.*"], lr_groups={"fc.*": 2.0})
    opt = torch_cls([{"params": module.fc.parameters(), "lr": 2 * LR}], lr=LR, **kwargs)

    def steps(ks):
        for k in ks:
            x, y = _batch(k)
            session.train_step({"x": x}, y)
            loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)),
                                                     torch.from_numpy(y))
            opt.zero_grad()
            loss.backward()
            opt.step()

    steps(range(2))
    session.unfreeze()
    opt.add_param_group({"params": list(module.features.parameters())})
    steps(range(2, 4))
    params = session.parameters()
    for n, p in module.named_parameters():
        np.testing.assert_allclose(params[n], p.detach().numpy(), rtol=0, atol=1e-6, err_msg=n)


def test_a_checkpoint_after_unfreezing_resumes_the_same_steps(tmp_path):
    """Groups, the unfrozen set and each parameter's step offset come back from a checkpoint:
    the resumed session takes the same steps, bit for bit, as the one that kept going."""
    opt = tr_onnx.optim.AdamW(lr=LR)
    session = tr_onnx.TrainingSession(_export(Net()), optimizer=opt, backend="numpy",
                                      trainable=["fc.*"], lr_groups={"features.*": MULT})
    session.train_step({"x": _batch(0)[0]}, _batch(0)[1])
    session.unfreeze()
    session.train_step({"x": _batch(1)[0]}, _batch(1)[1])
    path = session.save_checkpoint(tmp_path / "c.ckpt.npz")
    resumed = tr_onnx.TrainingSession.from_checkpoint(path)
    for s in (session, resumed):
        s.train_step({"x": _batch(2)[0]}, _batch(2)[1])
    ours, theirs = session.parameters(), resumed.parameters()
    assert resumed.options.step_offsets["features.0.weight"] == 1
    for n in ours:
        np.testing.assert_array_equal(ours[n], theirs[n], err_msg=n)
