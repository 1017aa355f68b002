"""Losses with torch's options and losses written in PyTorch: cross_entropy's label_smoothing,
class weights, ignore_index and reduction against ``torch.nn.functional.cross_entropy`` (value
and gradient), ``tr_onnx.losses.from_torch`` trained against PyTorch's autograd, and a loss
model of the wrong arity named as such."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.cli import main
from tr_onnx.optim import SGD

torch = pytest.importorskip("torch")
F = torch.nn.functional

ZOO = Path(__file__).parent.parent / "model_zoo"
MLP, LENET = str(ZOO / "mlp.onnx"), str(ZOO / "lenet.onnx")


def test_a_model_given_as_the_loss_is_an_input_error_naming_its_inputs(tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.chdir(tmp_path)
    args = ["train", MLP, "--data", "digits", "--loss", LENET, "--epochs", "1", "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("tr-onnx: error: ") and err.count("\n") == 1, err
    assert "lenet.onnx" in err and "1 input(s) ('input'" in err and "1 output(s)" in err


# ---- cross_entropy's options against torch.nn.functional.cross_entropy ------------------------

class Tokens(torch.nn.Module):
    """[N, T, 6] -> token logits [N, T, 5] (classes last: class_axis=-1)."""

    def __init__(self):
        super().__init__()  # parameters the export keeps by name (a Linear's weight is
        self.w = torch.nn.Parameter(torch.randn(6, 5) / 3)  # folded into a transposed copy)
        self.b = torch.nn.Parameter(torch.randn(5) / 3)

    def forward(self, x):
        return x @ self.w + self.b


SHAPES = {  # module, input shape, labels shape, class_axis
    "classifier": (lambda: torch.nn.Linear(6, 5), (8, 6), (8,), 1),
    "per-position": (lambda: torch.nn.Conv1d(3, 5, 1), (4, 3, 7), (4, 7), 1),
    "tokens": (Tokens, (4, 7, 6), (4, 7), -1),
}
WEIGHTS = (0.5, 1.0, 1.5, 2.0, 0.25)
OPTIONS = [
    pytest.param("classifier", {}, id="mean"),
    pytest.param("classifier", {"reduction": "sum"}, id="sum"),
    pytest.param("classifier", {"weights": WEIGHTS}, id="weights"),
    pytest.param("classifier", {"ignore_index": -100}, id="ignore_index"),
    pytest.param("classifier", {"label_smoothing": 0.1}, id="smoothing"),
    pytest.param("classifier", {"label_smoothing": 0.2, "reduction": "sum"}, id="smoothing-sum"),
    pytest.param("classifier", {"label_smoothing": 0.1, "weights": WEIGHTS},
                 id="smoothing-weights"),
    pytest.param("classifier", {"label_smoothing": 0.3, "weights": WEIGHTS,
                                "ignore_index": -100}, id="smoothing-weights-ignore"),
    pytest.param("classifier", {"label_smoothing": 0.1, "ignore_index": 3, "reduction": "sum"},
                 id="smoothing-ignore-sum"),
    pytest.param("per-position", {"label_smoothing": 0.1, "weights": WEIGHTS,
                                  "ignore_index": -100}, id="per-position-all"),
    pytest.param("tokens", {"label_smoothing": 0.1, "ignore_index": -100}, id="tokens-smoothing"),
    pytest.param("tokens", {"label_smoothing": 0.1, "weights": WEIGHTS, "ignore_index": -100,
                            "reduction": "sum"}, id="tokens-all-sum"),
]


def export(module: torch.nn.Module, shape, path: Path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.zeros(shape),), str(path), dynamo=False,
                          input_names=["x"], output_names=["logits"])
    return str(path)


@pytest.mark.parametrize("shape, options", OPTIONS)
def test_cross_entropy_options_equal_torch_in_value_and_gradient(tmp_path, shape, options):
    check_against_torch(tmp_path, shape, options, backend="numpy")


def test_label_smoothing_on_the_cuda_backend_equals_torch(tmp_path, tmp_path_factory):
    """The smoothing term's ops (LogSoftmax, Equal, Not, Cast, Where, Gather, ReduceSum) on
    the cuda backend's kernels, run by the host emulator."""
    from tr_onnx.testing.host_emulator import build_host_library, host_emulator

    device = host_emulator(build_host_library(tmp_path_factory.mktemp("host_kernels")))
    check_against_torch(tmp_path, "per-position", {"label_smoothing": 0.1, "weights": WEIGHTS,
                                                   "ignore_index": -100},
                        backend=CudaBackend(device=device))


def check_against_torch(tmp_path, shape, options, **session_kw):
    """One SGD step (lr 1) of the model ``SHAPES[shape]`` with cross_entropy ``options``: the
    loss and the step equal torch's loss and gradient, the validation loss its loss."""
    make, x_shape, y_shape, class_axis = SHAPES[shape]
    torch.manual_seed(0)
    module = make()
    rng = np.random.default_rng(1)
    x = rng.standard_normal(x_shape).astype(np.float32)
    y = rng.integers(0, 5, y_shape)
    y.reshape(-1)[[1, 4]] = options.get("ignore_index", y.reshape(-1)[1])  # two ignored
    spec = tr_onnx.LossSpec("cross_entropy", class_axis=class_axis, **options)
    session = tr_onnx.TrainingSession(export(module, x_shape, tmp_path / "m.onnx"), loss=spec,
                                      optimizer=SGD(lr=1.0), **session_kw)
    before = session.parameters()

    logits = module(torch.from_numpy(x))
    target = torch.from_numpy(y)
    if class_axis == -1:
        logits, target = logits.reshape(-1, 5), target.reshape(-1)
    want = F.cross_entropy(
        logits, target, reduction=spec.reduction,
        weight=torch.tensor(WEIGHTS) if spec.weights else None,
        ignore_index=-100 if spec.ignore_index is None else spec.ignore_index,
        label_smoothing=spec.label_smoothing)
    want.backward()

    assert session.train_step({"x": x}, y) == pytest.approx(want.item(), rel=1e-5)
    after = session.parameters()
    for name, p in module.named_parameters():  # SGD with lr 1: the step is the gradient
        np.testing.assert_allclose(before[name] - after[name], p.grad.numpy(), rtol=1e-4,
                                   atol=1e-6, err_msg=name)
    # the validation loss (the compiled loss in eval mode) of the same weights
    unchanged = tr_onnx.TrainingSession(export(module, x_shape, tmp_path / "m2.onnx"),
                                        loss=spec, **session_kw)
    assert unchanged.run_loss({"x": x}, y)[1] == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.parametrize("options, message", [
    ({"name": "mse", "label_smoothing": 0.1}, "for cross_entropy only"),
    ({"name": "cross_entropy", "label_smoothing": 1.5}, "a fraction in \\[0, 1\\]"),
], ids=["not-cross-entropy", "above-one"])
def test_label_smoothing_out_of_place_is_named(options, message):
    from tr_onnx.training.losses import make_loss_spec

    with pytest.raises(ValueError, match=message):
        make_loss_spec(options)


# ---- losses written in PyTorch ----------------------------------------------------------------

def focal_loss(logits, labels, gamma: float = 2.0):
    """Focal loss (Lin et al. 2017) as a user writes it in PyTorch."""
    logp = F.log_softmax(logits, dim=1)
    logpt = logp.gather(1, labels[:, None])[:, 0]
    return (-(1 - logpt.exp()) ** gamma * logpt).mean()


def test_a_torch_focal_loss_trains_as_torch_autograd(tmp_path):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                                 torch.nn.Linear(16, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.zeros(2, 12),), str(tmp_path / "m.onnx"), dynamo=False,
                          input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "n"}, "logits": {0: "n"}})
    loss_model = tr_onnx.losses.from_torch(focal_loss, np.zeros((3, 4), np.float32),
                                           np.zeros(3, np.int64))
    session = tr_onnx.TrainingSession(tmp_path / "m.onnx", loss=loss_model,
                                      optimizer=SGD(lr=0.5), backend="numpy")
    rng = np.random.default_rng(2)
    steps = [(rng.standard_normal((8, 12)).astype(np.float32), rng.integers(0, 4, 8))
             for _ in range(3)]
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    for x, y in steps:
        loss = focal_loss(module(torch.from_numpy(x)), torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert session.train_step({"x": x}, y) == pytest.approx(loss.item(), rel=1e-5)
    ours = session.parameters()
    for name, p in module.named_parameters():
        np.testing.assert_allclose(ours[name], p.detach().numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_from_torch_without_torch_says_what_it_needs(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torch", None)
    with pytest.raises(tr_onnx.TrOnnxError, match="needs PyTorch \\(pip install torch\\)"):
        tr_onnx.losses.from_torch(focal_loss, np.zeros((3, 4), np.float32), np.zeros(3))


def test_a_torch_loss_saved_as_onnx_trains_from_the_command_line(tmp_path, monkeypatch, capsys):
    import onnx

    monkeypatch.chdir(tmp_path)
    onnx.save(tr_onnx.losses.from_torch(focal_loss, np.zeros((3, 10), np.float32),
                                        np.zeros(3, np.int64)), "focal.onnx")
    assert main(["train", MLP, "--data", "digits", "--loss", "focal.onnx", "--epochs", "1",
                 "--backend", "numpy", "--no-progress"]) == 0
    assert "train loss" in capsys.readouterr().out
