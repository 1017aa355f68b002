"""Losses with torch's options and losses written in PyTorch: cross_entropy's label_smoothing,
class weights, ignore_index and reduction against ``torch.nn.functional.cross_entropy`` (value
and gradient), ``tr_onnx.losses.from_torch`` trained against PyTorch's autograd, and a loss
model of the wrong arity named as such."""

from __future__ import annotations

from pathlib import Path

from tr_onnx.cli import main

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
