"""Gradient cases for LSTM, GRU and RNN (tr_onnx.ops.recurrent): float64 finite differences
through time, see tests/gradcheck.py.

``onnx.reference`` ignores sequence_lens, activations, clip, input_forget and
linear_before_reset; cases using them take their finite differences of our forward
(``fd_oracle="ours"``), which tests/test_recurrent.py holds to onnxruntime for each of them."""

import numpy as np
from gradcheck import Const, GradCase

RNG = np.random.default_rng(13)
T, N, C, H = 4, 3, 2, 3  # steps, batch, input size (channels), hidden size
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
LENS = Const(np.array([4, 2, 3], np.int32))  # one full row, two shorter


def r(*shape, scale=0.6):
    return RNG.standard_normal(shape) * scale


def layer(op, dirs=1, *, bias=True, lens=None, init=False, peep=False, layout=0):
    """Inputs of one layer: X, W, R, B, sequence_lens, initial_h[, initial_c, P]."""
    g = GATES[op]
    state = (dirs, N, H) if layout == 0 else (N, dirs, H)
    ins = [r(T, N, C, scale=1.0) if layout == 0 else r(N, T, C, scale=1.0),
           r(dirs, g * H, C), r(dirs, g * H, H), r(dirs, 2 * g * H) if bias else None, lens,
           r(*state) if init else None]
    if op == "LSTM":
        ins += [r(*state) if init else None, r(dirs, 3 * H) if peep else None]
    while ins[-1] is None:
        ins.pop()
    return ins


def case(case_id, op, ins, attrs=None, output=0, ours=False, opset=17):
    outs = 3 if op == "LSTM" else 2
    return GradCase(case_id, op, ins, {"hidden_size": H, **(attrs or {})}, output=output,
                    n_outputs=outs, opset=opset, fd_oracle="ours" if ours else "reference")


BI = {"direction": "bidirectional"}
REV = {"direction": "reverse"}

CASES = [
    # ---- LSTM ----
    case("lstm_forward", "LSTM", layer("LSTM")),
    case("lstm_bidirectional_init_peepholes", "LSTM", layer("LSTM", 2, init=True, peep=True),
         BI),
    case("lstm_reverse_y_h", "LSTM", layer("LSTM", init=True), REV, output=1),
    case("lstm_bidirectional_y_c", "LSTM", layer("LSTM", 2, init=True, peep=True), BI,
         output=2),
    case("lstm_no_bias_opset7", "LSTM", layer("LSTM", bias=False), opset=7),
    case("lstm_layout1", "LSTM", layer("LSTM", 2, init=True, layout=1), {**BI, "layout": 1}),
    case("lstm_seq_lens_bidirectional", "LSTM", layer("LSTM", 2, lens=LENS, init=True,
                                                      peep=True), BI, ours=True),
    case("lstm_seq_lens_reverse_y_c", "LSTM", layer("LSTM", lens=LENS, init=True), REV,
         output=2, ours=True),
    case("lstm_seq_lens_layout1_y_h", "LSTM", layer("LSTM", lens=LENS, init=True, layout=1),
         {"layout": 1}, output=1, ours=True),
    case("lstm_clip", "LSTM", layer("LSTM", init=True, peep=True), {"clip": 0.4}, ours=True),
    case("lstm_input_forget", "LSTM", layer("LSTM", init=True, peep=True),
         {"input_forget": 1}, ours=True),
    case("lstm_activations", "LSTM", layer("LSTM", 2, init=True),
         {**BI, "activations": ["HardSigmoid", "Softsign", "Elu", "Sigmoid", "ScaledTanh",
                                "Softplus"],
          "activation_alpha": [0.3, 0.9, 0.8], "activation_beta": [0.45, 1.2]}, ours=True),
    # ---- GRU ----
    case("gru_forward", "GRU", layer("GRU")),
    case("gru_bidirectional_init", "GRU", layer("GRU", 2, init=True), BI),
    case("gru_reverse_y_h", "GRU", layer("GRU", init=True), REV, output=1),
    case("gru_linear_before_reset", "GRU", layer("GRU", 2, init=True),
         {**BI, "linear_before_reset": 1}),
    case("gru_layout1", "GRU", layer("GRU", init=True, layout=1), {"layout": 1}),
    case("gru_opset7_no_bias", "GRU", layer("GRU", bias=False), opset=7),
    case("gru_seq_lens_bidirectional", "GRU", layer("GRU", 2, lens=LENS, init=True), BI,
         ours=True),
    case("gru_seq_lens_linear_before_reset_y_h", "GRU", layer("GRU", lens=LENS, init=True),
         {**REV, "linear_before_reset": 1}, output=1, ours=True),
    case("gru_clip", "GRU", layer("GRU", init=True), {"clip": 0.5}, ours=True),
    case("gru_activations", "GRU", layer("GRU", init=True),
         {"activations": ["HardSigmoid", "LeakyRelu"], "activation_alpha": [0.3, 0.2],
          "activation_beta": [0.4]}, ours=True),
    # ---- RNN ----
    case("rnn_forward", "RNN", layer("RNN")),
    case("rnn_bidirectional_init", "RNN", layer("RNN", 2, init=True), BI),
    case("rnn_reverse_y_h", "RNN", layer("RNN", init=True), REV, output=1),
    case("rnn_layout1", "RNN", layer("RNN", 2, init=True, layout=1), {**BI, "layout": 1}),
    case("rnn_opset7", "RNN", layer("RNN", init=True), opset=7),
    case("rnn_seq_lens_bidirectional", "RNN", layer("RNN", 2, lens=LENS, init=True), BI,
         ours=True),
    case("rnn_seq_lens_y_h", "RNN", layer("RNN", lens=LENS, init=True), output=1, ours=True),
    case("rnn_clip", "RNN", layer("RNN", init=True), {"clip": 0.5}, ours=True),
    case("rnn_activations", "RNN", layer("RNN", 2, init=True),
         {**BI, "activations": ["Affine", "ThresholdedRelu"], "activation_alpha": [0.7, 0.05],
          "activation_beta": [0.2]}, ours=True),
    case("rnn_relu", "RNN", layer("RNN", init=True), {"activations": ["Relu"]}, ours=True),
]
