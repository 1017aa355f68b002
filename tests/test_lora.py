"""LoRA adapters (issue 33): ``tr_onnx.finetune.lora`` trains exported models as PyTorch with
peft trains them, and its three exports serve the trained adapters.

Oracles: PyTorch + peft (``inject_adapter_in_model`` with ``LoraConfig(r, lora_alpha,
target_modules, lora_dropout=0)``, tr_onnx's initial A/B copied in) for the training curves;
onnxruntime (its ``AdapterFormat`` / ``LoraAdapter`` / ``RunOptions.add_active_adapter``) for
the exports. Models: the tiny Llama and BERT of ``real_exports.py`` exported by both torch
exporters (Llama also at opset 23), and a small CNN with a 1x1 Conv (peft's Conv2d LoRA).

Tolerances: losses 1e-5 absolute against peft over 20 SGD and 20 AdamW steps (the issue's;
float32 on both sides; seen at most 2.7e-6, BERT with SGD, 9.5e-7 on the Llamas); trained A/B
1e-5 against peft's; exports 1e-5 absolute against each other in onnxruntime (seen about 3e-7
on logits near 1).
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import real_exports as rx
import torch
from onnx import numpy_helper
from oracles import ort_run

import tr_onnx
from tr_onnx.backends.cuda.backend import CudaBackend
from tr_onnx.finetune.lora import (
    LoraError,
    adapter_model,
    add_lora,
    apply_lora,
    load_adapters,
    merge_lora,
    parse_lora,
    save_adapters,
    write_adapter,
)

peft = pytest.importorskip("peft")
ort = pytest.importorskip("onnxruntime")

RANK, ALPHA = 4, 8
STEPS = 20
LOSS_ATOL = 1e-5
ADAPTER_ATOL = 1e-5
EXPORT_ATOL = 1e-5
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BERT_TARGETS = ["query", "key", "value", "dense"]
OPTIMIZERS = {  # tr_onnx's and torch's, the same settings
    "sgd": (lambda: tr_onnx.optim.SGD(lr=0.5), lambda ps: torch.optim.SGD(ps, lr=0.5)),
    "adamw": (lambda: tr_onnx.optim.AdamW(lr=1e-2, weight_decay=0.01),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)),
}


class TinyCnn(torch.nn.Module):
    """A 1x1 Conv (LoRA-able: peft's Conv2d LoRA), a 3x3 Conv (not) and a Linear head."""

    def __init__(self):
        super().__init__()
        self.pw = torch.nn.Conv2d(3, 8, 1)
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(torch.flatten(torch.relu(self.conv(torch.relu(self.pw(x)))), 1))


def _cnn_build() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyCnn().eval()


def _cnn_batch(k: int) -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(k)
    return ({"x": rng.standard_normal((4, 3, 4, 4)).astype(np.float32)},
            rng.integers(0, 5, (4,), dtype=np.int64))


@dataclass(frozen=True)
class Case:
    id: str
    model: str  # a real_exports name, or "cnn"
    exporter: str
    opset: int | None  # None: real_exports' default
    targets: list[str]
    train_also: str | None = None  # trained besides A/B (peft: modules_to_save)

    @property
    def class_axis(self) -> int:
        return -1 if self.model in rx.LANGUAGE_MODELS else 1

    def build(self) -> torch.nn.Module:
        return _cnn_build() if self.model == "cnn" else rx.build(self.model, self.exporter)

    def batch(self, k: int) -> tuple[dict, np.ndarray]:
        if self.model == "cnn":
            return _cnn_batch(k)
        return rx.example_inputs(self.model, seed=k), rx.example_labels(self.model, seed=k)


CASES = [Case("llama-classic", "llama", "classic", None, LLAMA_TARGETS),
         Case("llama-dynamo", "llama", "dynamo", None, LLAMA_TARGETS),
         Case("llama-dynamo-opset23", "llama", "dynamo", 23, LLAMA_TARGETS),
         Case("bert-classic", "bert", "classic", None, BERT_TARGETS, r"classifier"),
         Case("bert-dynamo", "bert", "dynamo", None, BERT_TARGETS, r"classifier"),
         Case("cnn-classic", "cnn", "classic", None, ["pw", "fc"])]
BY_ID = {c.id: c for c in CASES}


def _export(case: Case, path: Path) -> Path:
    if case.model == "cnn":
        feed, _ = _cnn_batch(0)
        torch.onnx.export(case.build(), (torch.from_numpy(feed["x"]),), str(path), dynamo=False,
                          input_names=["x"], output_names=["logits"], opset_version=17)
        return path
    if case.opset is None:
        return rx.export(case.build(), case.model, case.exporter, path)
    feed = rx.example_inputs(case.model)
    dims = {0: torch.export.Dim("batch", min=1, max=64), 1: torch.export.Dim("seq", min=1,
                                                                          max=64)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(case.build(), tuple(torch.from_numpy(x) for x in feed.values()),
                          str(path), dynamo=True, input_names=list(feed),
                          output_names=["logits"], dynamic_shapes={n: dims for n in feed},
                          opset_version=case.opset, external_data=False)
    return path


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    cache: dict[str, Path] = {}

    def get(case_id: str) -> Path:
        if case_id not in cache:
            cache[case_id] = _export(BY_ID[case_id], folder / f"{case_id}.onnx")
        return cache[case_id]
    return get


def _session(model: onnx.ModelProto, case: Case, info, optimizer) -> tr_onnx.TrainingSession:
    loss = tr_onnx.LossSpec("cross_entropy", class_axis=case.class_axis)
    return tr_onnx.TrainingSession(model, loss=loss, optimizer=optimizer,
                                   trainable=info.trainable, backend="numpy")


def _peft_module(case: Case, info, lora: onnx.ModelProto) -> torch.nn.Module:
    """The PyTorch module with peft's adapters on the same modules, holding tr_onnx's initial
    A and B; only they (and ``train_also``'s module) train."""
    module = case.build()
    module = peft.inject_adapter_in_model(peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=case.targets, lora_dropout=0.0), module)
    values = {i.name: numpy_helper.to_array(i) for i in lora.graph.initializer}
    with torch.no_grad():
        for t in info.adapters:
            layer = module.get_submodule(t.name.removesuffix(".weight"))
            layer.lora_A["default"].weight.copy_(torch.from_numpy(values[t.lora_A].copy()))
            layer.lora_B["default"].weight.copy_(torch.from_numpy(values[t.lora_B].copy()))
    if case.train_also:
        for name, p in module.named_parameters():
            if case.train_also in name:
                p.requires_grad_(True)
    return module


def _torch_losses(module: torch.nn.Module, case: Case, make_opt) -> list[float]:
    module.train()
    opt = make_opt([p for p in module.parameters() if p.requires_grad])
    losses = []
    for k in range(STEPS):
        feed, labels = case.batch(k)
        inputs = {n: torch.from_numpy(x) for n, x in feed.items()}
        out = module(**inputs) if case.model != "cnn" else module(inputs["x"])
        y = torch.from_numpy(labels)
        if case.class_axis == -1:
            out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _lora(case: Case, path: Path):
    return add_lora(onnx.load(path), rank=RANK, alpha=ALPHA, targets=case.targets,
                    train_also=case.train_also)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_lora_training_follows_pytorch_with_peft(case, optimizer, exports):
    path = exports(case.id)
    lora, info = _lora(case, path)
    make_tr, make_torch = OPTIMIZERS[optimizer]
    session = _session(lora, case, info, make_tr())
    losses = [session.train_step(*case.batch(k)) for k in range(STEPS)]
    module = _peft_module(case, info, lora)
    peft_adapted = [n for n, m in module.named_modules() if hasattr(m, "lora_A")]
    assert sorted(t.name.removesuffix(".weight") for t in info.adapters) == sorted(peft_adapted)
    torch_losses = _torch_losses(module, case, make_torch)
    print(f"\n{case.id} {optimizer}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, max |tr_onnx - "
          f"peft| {np.abs(np.subtract(losses, torch_losses)).max():.1e}")
    assert abs(losses[-1] - losses[0]) > 100 * LOSS_ATOL  # the adapters moved the loss
    np.testing.assert_allclose(losses, torch_losses, rtol=0, atol=LOSS_ATOL)
    trained = session.parameters()
    for t in info.adapters:
        layer = module.get_submodule(t.name.removesuffix(".weight"))
        for name, ref in ((t.lora_A, layer.lora_A), (t.lora_B, layer.lora_B)):
            np.testing.assert_allclose(trained[name], ref["default"].weight.detach().numpy(),
                                       rtol=0, atol=ADAPTER_ATOL, err_msg=name)
    base = onnx.load(path)
    merged = merge_lora(base, session.export_proto(), info)
    feed, _ = case.batch(0)
    if case.opset == 23:  # onnxruntime 1.32's RotaryEmbedding refuses batch > 1 of this export
        feed = {n: x[:1] for n, x in feed.items()}  # (test_attention_ops.py says why)
    module.eval()
    with torch.no_grad():
        inputs = {n: torch.from_numpy(x) for n, x in feed.items()}
        want = (module(**inputs) if case.model != "cnn" else module(inputs["x"])).numpy()
    np.testing.assert_allclose(ort_run(merged, feed)[0], want, rtol=0, atol=EXPORT_ATOL)


def test_adapter_names_and_initial_values_follow_peft(exports):
    case = BY_ID["llama-dynamo"]
    lora, info = _lora(case, exports(case.id))
    values = {i.name: numpy_helper.to_array(i) for i in lora.graph.initializer}
    t = info.adapters[0]
    assert (t.name, t.lora_A, t.lora_B) == (
        "model.model.layers.0.self_attn.q_proj.weight",
        "model.model.layers.0.self_attn.q_proj.weight.lora_A",
        "model.model.layers.0.self_attn.q_proj.weight.lora_B")
    # peft: kaiming_uniform_(A, a=sqrt(5)) draws from U(-bound, bound)
    a = values[t.lora_A]
    ref = torch.empty(a.shape)
    torch.nn.init.kaiming_uniform_(ref, a=math.sqrt(5))
    bound = torch.nn.init.calculate_gain("leaky_relu", math.sqrt(5)) * math.sqrt(
        3.0 / a.shape[1])
    assert a.shape == (RANK, rx.HIDDEN) and float(ref.abs().max()) <= bound
    assert bound * 0.9 < np.abs(a).max() <= bound
    assert not values[t.lora_B].any()
    again, _ = _lora(case, exports(case.id))  # seeded: the same A
    np.testing.assert_array_equal(numpy_helper.to_array(
        next(i for i in again.graph.initializer if i.name == t.lora_A)), a)
    # the classic export names its adapters the same, from the nodes' module paths
    _, classic = _lora(case, exports("llama-classic"))
    assert [x.name for x in classic.adapters] == [x.name for x in info.adapters]


def _train(lora, case, info, first_batch: int) -> tr_onnx.TrainingSession:
    session = _session(lora, case, info, tr_onnx.optim.SGD(lr=0.5))
    for k in range(first_batch, first_batch + 5):
        session.train_step(*case.batch(k))
    return session


@pytest.mark.parametrize("case_id", ["llama-dynamo", "bert-classic"])
def test_exports_merged_adapter_file_and_npz_agree_in_onnxruntime(case_id, exports, tmp_path):
    """Two adapters trained on different data: the merged model of each equals the adapter
    model run by onnxruntime with that adapter file active (swapped in one session), and the
    base output without one; the .npz re-applied to a fresh base merges to the same model.
    BERT's adapters carry the trained classifier too (``train_also``)."""
    case = BY_ID[case_id]
    path = exports(case.id)
    base = onnx.load(path)
    lora, info = _lora(case, path)
    feed, _ = case.batch(100)
    served = adapter_model(base, info)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(served.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    base_out = ort_run(base, feed)[0]
    np.testing.assert_array_equal(sess.run(None, feed)[0], base_out)
    for k, first in enumerate((0, 50)):
        session = _train(lora, case, info, first)
        trained = session.export_proto()
        merged = merge_lora(base, trained, info)
        # same nodes and names as the base, nothing added
        assert [(n.name, n.op_type, list(n.input), list(n.output)) for n in merged.graph.node] \
            == [(n.name, n.op_type, list(n.input), list(n.output)) for n in base.graph.node]
        assert [(i.name, list(i.dims)) for i in merged.graph.initializer] == \
            [(i.name, list(i.dims)) for i in base.graph.initializer]
        want = ort_run(merged, feed)[0]
        assert np.abs(want - base_out).max() > 100 * EXPORT_ATOL  # training moved it
        ours = session.run(None, feed)[0]
        np.testing.assert_allclose(ours, want, rtol=0, atol=EXPORT_ATOL)
        adapter = ort.LoraAdapter()
        adapter.Load(str(write_adapter(tmp_path / f"a{k}.onnx_adapter", trained, info)))
        options = ort.RunOptions()
        options.add_active_adapter(adapter)
        np.testing.assert_allclose(sess.run(None, feed, options)[0], want, rtol=0,
                                   atol=EXPORT_ATOL)
        np.testing.assert_array_equal(sess.run(None, feed)[0], base_out)
        npz = save_adapters(tmp_path / f"a{k}.npz", trained, info)
        again, info2 = apply_lora(onnx.load(path), npz)
        assert info2 == info
        np.testing.assert_array_equal(ort_run(merge_lora(onnx.load(path), load_adapters(npz)[0],
                                                         info2), feed)[0], want)
        np.testing.assert_allclose(ort_run(again, feed)[0], want, rtol=0, atol=EXPORT_ATOL)


def test_adapters_refuse_another_base(exports, tmp_path):
    case = BY_ID["llama-dynamo"]
    lora, info = _lora(case, exports(case.id))
    npz = save_adapters(tmp_path / "a.npz", lora, info)
    other = onnx.load(exports(case.id))
    w = other.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w) + 1, w.name))
    with pytest.raises(LoraError, match="sha256"):
        apply_lora(other, npz)


def _plan_numbers(session: tr_onnx.TrainingSession) -> dict:
    mem = session._state.active.memory
    regions = {r.name: b for r, (_, b) in mem.regions.items()}
    params = session.parameters()
    count = sum(params[n].size for n in session._state.active.info.trainable)
    return {"trainable": count, "arena": mem.total_bytes, "grad": regions.get("GRAD", 0),
            "opt_state": regions.get("OPT_STATE", 0)}


def test_lora_plans_gradients_and_optimizer_state_for_the_adapters_only(exports):
    case = BY_ID["llama-dynamo"]
    path = exports(case.id)
    lora, info = _lora(case, path)
    batch = case.batch(0)
    numbers = {}
    for what, model, trainable in (("lora", lora, info.trainable), ("full", onnx.load(path),
                                                                    None)):
        session = tr_onnx.TrainingSession(
            model, loss=tr_onnx.LossSpec("cross_entropy", class_axis=-1),
            optimizer=tr_onnx.optim.AdamW(), trainable=trainable, backend="numpy")
        session.train_step(*batch)
        numbers[what] = _plan_numbers(session)
    print(f"\nLoRA r={RANK} vs full fine-tuning, tiny Llama (dynamo export), AdamW, batch "
          f"{rx.BATCH}x{rx.SEQ}:")
    for what, n in numbers.items():
        print(f"  {what:5s} trainable {n['trainable']:>7,d}  arena {n['arena']:>10,d} B  "
              f"GRAD {n['grad']:>9,d} B  OPT_STATE {n['opt_state']:>9,d} B")
    adapters = sum(RANK * (t.in_features + t.out_features) for t in info.adapters)
    assert numbers["lora"]["trainable"] == adapters
    assert numbers["lora"]["opt_state"] >= 2 * 4 * adapters  # Adam's two moments, float32
    assert numbers["lora"]["opt_state"] < numbers["full"]["opt_state"] / 5
    assert numbers["lora"]["grad"] < numbers["full"]["grad"] / 5


def test_base_weights_held_in_bfloat16_compute_as_their_rounded_values(exports):
    case = BY_ID["llama-dynamo"]
    path = exports(case.id)
    half, info = add_lora(onnx.load(path), rank=RANK, alpha=ALPHA, targets=case.targets,
                          base_dtype="bfloat16")
    adapted = {t.weight for t in info.adapters}
    assert all(i.data_type == onnx.TensorProto.BFLOAT16 for i in half.graph.initializer
               if i.name in adapted)
    # the oracle: the float32 LoRA model of a base whose adapted weights were rounded
    rounded = onnx.load(path)
    for init in rounded.graph.initializer:
        if init.name in adapted:
            w = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array(
                w.astype(onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.BFLOAT16))
                .astype(np.float32), init.name))
    full, _ = add_lora(rounded, rank=RANK, alpha=ALPHA, targets=case.targets)
    feed, labels = case.batch(0)
    np.testing.assert_allclose(ort_run(half, feed)[0], ort_run(full, feed)[0], rtol=0,
                               atol=1e-6)
    session = _session(half, case, info, tr_onnx.optim.SGD(lr=0.5))
    reference = _session(full, case, info, tr_onnx.optim.SGD(lr=0.5))
    for k in range(3):
        assert session.train_step(*case.batch(k)) == pytest.approx(
            reference.train_step(*case.batch(k)), abs=LOSS_ATOL)
    np.testing.assert_allclose(session.run(None, feed)[0], reference.run(None, feed)[0],
                               rtol=0, atol=EXPORT_ATOL)


def test_lora_dropout_is_a_dropout_on_the_branch_input_off_in_inference(exports):
    case = BY_ID["llama-dynamo"]
    path = exports(case.id)
    drop, info = add_lora(onnx.load(path), rank=RANK, alpha=ALPHA, targets=["q_proj"],
                          dropout=0.25)
    plain, _ = add_lora(onnx.load(path), rank=RANK, alpha=ALPHA, targets=["q_proj"])
    dropouts = [n for n in drop.graph.node if n.op_type == "Dropout"]
    assert len(dropouts) == len(info.adapters) == rx.LAYERS
    # the branch input: the adapted MatMul's input
    for t, d in zip(info.adapters, dropouts):
        a = next(n for n in drop.graph.node if n.name == f"{t.name}.lora/A")
        assert a.input[0] == d.output[0]
    feed, labels = case.batch(0)
    session = _session(drop, case, info, tr_onnx.optim.SGD(lr=0.5))
    reference = _session(plain, case, info, tr_onnx.optim.SGD(lr=0.5))
    for k in range(3):
        session.train_step(*case.batch(k))
        reference.train_step(*case.batch(k))
    trained = session.parameters()  # masks differ: the adapters trained differently
    t = info.adapters[0]
    assert np.abs(trained[t.lora_B] - reference.parameters()[t.lora_B]).max() > 1e-4
    eval_drop = merge_lora(onnx.load(path), session.export_proto(), info)
    np.testing.assert_allclose(session.run(None, feed)[0], ort_run(eval_drop, feed)[0], rtol=0,
                               atol=EXPORT_ATOL)


def test_targets_that_match_nothing_name_the_candidates(exports):
    with pytest.raises(LoraError, match=r"matched no .*q_proj"):
        add_lora(onnx.load(exports("llama-dynamo")), targets="no_such_module")


@pytest.mark.parametrize("text,want", [
    ("rank=8,alpha=16,dropout=0.05,targets=q_proj|v_proj",
     {"rank": 8, "alpha": 16.0, "dropout": 0.05, "targets": "q_proj|v_proj"}),
    ("targets=(q|v)_proj,{1,2},rank=4", {"targets": "(q|v)_proj,{1,2}", "rank": 4}),
    ("rank=2, base_dtype=bfloat16", {"rank": 2, "base_dtype": "bfloat16"}),
    ("targets=a,seed=1,rank=2,train_also=head", {"targets": "a", "seed": 1, "rank": 2,
                                                  "train_also": "head"}),
], ids=["all", "targets-with-commas", "base-dtype", "keys-after-targets"])
def test_parse_lora_reads_the_cli_text(text, want):
    assert parse_lora(text) == want


@pytest.mark.parametrize("text,message", [
    ("rnak=8", "unknown key 'rnak'"),
    ("rank=eight", "rank='eight' is not an integer"),
    ("rank=0", "rank=0"),
    ("dropout=1.5", "dropout=1.5"),
    ("rank", "'rank' has no value"),
    ("rank=2,rank=3", "'rank' given twice"),
    ("base_dtype=int8", "base_dtype='int8'"),
], ids=["unknown-key", "not-int", "zero-rank", "dropout-range", "no-value", "twice", "dtype"])
def test_parse_lora_errors_name_the_bad_key(text, message):
    with pytest.raises(LoraError, match=message):
        parse_lora(text)


def test_lora_model_checks_and_keeps_the_base_untouched(exports):
    path = exports("bert-classic")
    base = onnx.load(path)
    before = base.SerializeToString()
    lora, info = _lora(BY_ID["bert-classic"], path)
    assert base.SerializeToString() == before
    onnx.checker.check_model(lora, full_check=True)
    onnx.checker.check_model(adapter_model(base, info), full_check=True)
    assert any(n in info.trainable for n in ("model.classifier.weight", "model.classifier.bias"))
    assert copy.deepcopy(info) == info


def test_lora_llama_in_bf16_plans_on_cuda_without_a_device(exports):
    """The deviceless cuda plan (``tr-onnx inspect --backend cuda``'s): every node of a LoRA
    Llama with bf16 base weights, dropout and bf16 training binds a cuda kernel, only A and B
    train, and cuDNN accepts every graph the plan declares."""
    from tr_onnx.backends.cuda.deviceless import check_plan
    from tr_onnx.testing.recorder import FakeRecorder

    case = BY_ID["llama-dynamo"]
    lora, info = add_lora(onnx.load(exports(case.id)), rank=RANK, alpha=ALPHA,
                          targets=case.targets, base_dtype="bfloat16", dropout=0.05)
    session = tr_onnx.TrainingSession(
        lora, loss=tr_onnx.LossSpec("cross_entropy", class_axis=-1),
        backend=CudaBackend(device=lambda plan: FakeRecorder(plan.memory)), precision="bf16",
        trainable=info.trainable)
    plan = session._train_plan(case.batch(0)[0])
    assert all(".cuda." in source for _, source in plan.kernels), sorted(
        {s for _, s in plan.kernels if ".cuda." not in s})
    assert {n.op_type for n, _ in plan.kernels} >= {"MatMul", "Transpose", "Cast"}
    assert sorted(plan.info.trainable) == sorted(info.trainable)
    assert all(check.ok for check in check_plan(plan))


def test_a_weight_another_node_also_reads_gets_no_adapter():
    """A tied embedding (Gather and MatMul read one initializer): folding an adapter into it
    would change the Gather too, so it is skipped and said why; the other weight is adapted."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((6, 6)).astype(np.float32), "tied.weight")
    w2 = numpy_helper.from_array(rng.standard_normal((6, 3)).astype(np.float32), "out.weight")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["tied.weight", "ids"], ["e"], "embed"),
         helper.make_node("MatMul", ["e", "tied.weight"], ["h"], "mix"),
         helper.make_node("MatMul", ["h", "out.weight"], ["y"], "out")], "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    lora, info = add_lora(model, rank=2, alpha=4)
    assert [t.weight for t in info.adapters] == ["out.weight"]
    assert "Gather embed" in info.skipped["tied.weight"]
    feed = {"ids": np.array([1, 4], np.int64)}
    np.testing.assert_array_equal(ort_run(lora, feed)[0], ort_run(model, feed)[0])  # B = 0


def _one_node_model(op: str, attrs: dict, x_shape, w_shape, out_shape) -> onnx.ModelProto:
    from onnx import TensorProto, helper

    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal(w_shape).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(out_shape[1]).astype(np.float32), "c")]
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "w", "c"], ["y"], "layer", **attrs)], "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op,attrs,x_shape,w_shape,out_shape,kind", [
    ("Gemm", {"transA": 1, "alpha": 0.5, "beta": 2.0}, (5, 3), (5, 4), (3, 4), "gemm"),
    ("Gemm", {"transB": 1, "alpha": 2.0}, (3, 5), (4, 5), (3, 4), "gemm_t"),
    ("Conv", {"strides": [2, 2], "pads": [1, 1, 1, 1]}, (2, 5, 6, 6), (4, 5, 1, 1),
     (2, 4, 4, 4), "conv"),
], ids=["gemm-transA-alpha", "gemm-transB", "conv-1x1-stride-pad"])
def test_the_merged_weight_computes_what_the_branch_computes(op, attrs, x_shape, w_shape,
                                                               out_shape, kind):
    """onnxruntime runs the LoRA model (with a non-zero B) and the merged one: equal, for
    Gemm's alpha/transA/transB and a strided, padded 1x1 Conv."""
    model = _one_node_model(op, attrs, x_shape, w_shape, out_shape)
    lora, info = add_lora(model, rank=2, alpha=3)
    assert [t.kind for t in info.adapters] == [kind]
    rng = np.random.default_rng(2)
    trained = {n: rng.standard_normal(numpy_helper.to_array(i).shape).astype(np.float32)
               for i in lora.graph.initializer for n in [i.name] if n in info.trainable}
    lora_trained, _ = apply_lora(model, (trained, info))
    feed = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    want = ort_run(lora_trained, feed)[0]
    assert want.shape == out_shape
    assert np.abs(want - ort_run(model, feed)[0]).max() > 0.1
    np.testing.assert_allclose(ort_run(merge_lora(model, trained, info), feed)[0], want,
                               rtol=0, atol=1e-5)
