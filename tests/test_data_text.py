"""Text data (issue 32): JSONL or CSV tokenised by a Hugging Face ``tokenizer.json`` trains a
PyTorch text classifier (through ``tr-onnx train``) and a causal LM (through the Python API)
exported by the test; the trained models run in onnxruntime.

Oracles: ``tokenizers`` encoding each text directly (ids, then padding by hand); PyTorch's
``cross_entropy`` (ignore_index -100) of the initial causal LM's logits on the first batch
equals the first step's loss; onnxruntime runs the trained exports.
"""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tests.oracles import ort_run
from tr_onnx.cli import build_parser, main
from tr_onnx.data import flag_options, load
from tr_onnx.data.text import IGNORE_INDEX
from tr_onnx.errors import InputError
from tr_onnx.importer import InputSpec
from tr_onnx.optim import SGD
from tr_onnx.training.losses import LossSpec
from tr_onnx.training.session import TrainingSession
from tr_onnx.training.trainer import Trainer

T = 8
POSITIVE = "good great fine happy nice".split()
NEGATIVE = "bad awful sad poor grim".split()
FILLER = "the a movie was plot and it".split()


def sentences(n: int = 60) -> list[tuple[str, str]]:
    """(text, "pos" | "neg"): filler words with two to four words of the class's mood; some
    longer than T tokens, so that truncation is exercised."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        label = "pos" if i % 2 else "neg"
        mood = POSITIVE if label == "pos" else NEGATIVE
        words = list(rng.choice(FILLER, rng.integers(1, 9))) + list(
            rng.choice(mood, rng.integers(2, 5)))
        rng.shuffle(words)
        rows.append((" ".join(words), label))
    return rows


def write_tokenizer(path: Path, texts) -> Path:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    tok.save(str(path))
    return path


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    return path


class Classifier(torch.nn.Module):
    """Embedding, mean over the unmasked tokens, linear."""

    def __init__(self, vocab: int):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, 8)
        self.fc = torch.nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask):
        m = attention_mask.unsqueeze(-1).float()
        pooled = (self.emb(input_ids) * m).sum(1) / m.sum(1).clamp(min=1.0)
        return self.fc(pooled)


class BigramLM(torch.nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, 16)
        self.head = torch.nn.Linear(16, vocab)

    def forward(self, input_ids):
        return self.head(self.emb(input_ids))


def export(module, path: Path, names: list[str], seq) -> Path:
    args = tuple(torch.zeros((2, 4 if seq else T), dtype=torch.int64) for _ in names)
    axes = {0: "n", 1: "seq"} if seq else {0: "n"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=False, input_names=names,
                          output_names=["logits"], opset_version=17,
                          dynamic_axes={**{n: axes for n in names}, "logits": axes})
    return path


def specs(seq=T, names=("input_ids", "attention_mask")) -> list[InputSpec]:
    return [InputSpec(n, ("n", seq), np.dtype(np.int64)) for n in names]


@pytest.fixture
def corpus(tmp_path):
    rows = sentences()
    tok = write_tokenizer(tmp_path / "tokenizer.json", [t for t, _ in rows])
    return rows, tok, write_jsonl(tmp_path / "train.jsonl", rows)


def test_tokens_and_mask_are_the_tokenizers_encoding_truncated_and_padded(corpus):
    rows, tok, data = corpus
    loaded = load(data, specs(), options={"text": {"tokenizer": str(tok)}})
    arrays, labels = loaded.data
    reference = Tokenizer.from_file(str(tok))
    pad = reference.token_to_id("[PAD]")
    for i, (text, _) in enumerate(rows):
        ids = reference.encode(text).ids[:T]
        want = ids + [pad] * (T - len(ids))
        assert arrays["input_ids"][i].tolist() == want, text
        assert arrays["attention_mask"][i].tolist() == [1] * len(ids) + [0] * (T - len(ids))
    assert any(len(reference.encode(t).ids) > T for t, _ in rows)  # truncation was exercised
    assert loaded.meta["classes"] == ["neg", "pos"]
    assert labels.tolist() == [["neg", "pos"].index(y) for _, y in rows]


def test_a_text_classifier_trains_through_the_cli_and_runs_in_onnxruntime(corpus, tmp_path,
                                                                          capsys):
    rows, tok, data = corpus
    model = export(Classifier(Tokenizer.from_file(str(tok)).get_vocab_size()),
                   tmp_path / "clf.onnx", ["input_ids", "attention_mask"], seq=False)
    out = tmp_path / "trained.onnx"
    status = main(["train", str(model), "--data", str(data), "--tokenizer", str(tok), "--out",
                   str(out), "--epochs", "15", "--batch-size", "8", "--lr", "0.05",
                   "--no-progress", "--backend", "numpy"])
    assert status == 0, capsys.readouterr().err
    meta = json.loads(out.with_suffix(".data.json").read_text())
    assert meta["source"] == "text" and meta["classes"] == ["neg", "pos"]
    arrays, labels = load(data, specs(), options={"text": {"tokenizer": str(tok)}}).data
    before = ort_run(onnx.load(model), arrays)[0].argmax(1)
    after = ort_run(onnx.load(out), arrays)[0].argmax(1)
    assert (after == labels).mean() >= 0.9 > (before == labels).mean()


def test_a_csv_is_text_when_the_spec_says_so(corpus, tmp_path):
    rows, tok, _ = corpus
    path = tmp_path / "train.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "review"])
        w.writerows([(y, t) for t, y in rows])
    options = {"kind": "text", "text": {"tokenizer": str(tok), "column": "review"}}
    from_csv = load(path, specs(), options=options).data
    from_jsonl = load(corpus[2], specs(), options={"text": {"tokenizer": str(tok)}}).data
    for name in ("input_ids", "attention_mask"):
        np.testing.assert_array_equal(from_csv[0][name], from_jsonl[0][name])
    np.testing.assert_array_equal(from_csv[1], from_jsonl[1])


def test_the_tokenizer_flag_reaches_the_text_section():
    args = build_parser().parse_args(["train", "m.onnx", "--data", "d.jsonl", "--tokenizer",
                                      "tok.json", "--image-mean", "0.5"])
    options = flag_options({"text": {"column": "review"}}, args)
    assert options["text"] == {"column": "review", "tokenizer": "tok.json"}
    assert options["images"] == {"mean": [0.5]}


def test_causal_lm_labels_are_the_next_tokens_with_padding_ignored(corpus):
    rows, tok, data = corpus
    options = {"text": {"tokenizer": str(tok), "task": "causal_lm", "max_length": T}}
    arrays, labels = load(data, specs("seq", ["input_ids"]), options=options).data
    reference = Tokenizer.from_file(str(tok))
    for i, (text, _) in enumerate(rows):
        ids = reference.encode(text).ids
        assert arrays["input_ids"][i, :min(len(ids), T)].tolist() == ids[:T]
        nxt = ids[1:T + 1]
        assert labels[i].tolist() == nxt + [IGNORE_INDEX] * (T - len(nxt)), text


def ort_lm_loss(path, arrays, labels) -> float:
    """torch's cross-entropy (padding ignored) of the logits onnxruntime gives for ``path``."""
    x = ort_run(onnx.load(path), arrays)[0]
    return float(torch.nn.functional.cross_entropy(
        torch.from_numpy(x).transpose(1, 2), torch.from_numpy(labels),
        ignore_index=IGNORE_INDEX))


def test_a_causal_lm_trains_on_text_and_runs_in_onnxruntime(corpus, tmp_path):
    rows, tok, data = corpus
    vocab = Tokenizer.from_file(str(tok)).get_vocab_size()
    torch_model = BigramLM(vocab)
    model = export(torch_model, tmp_path / "lm.onnx", ["input_ids"], seq=True)
    options = {"text": {"tokenizer": str(tok), "task": "causal_lm", "max_length": T}}
    arrays, labels = load(data, specs("seq", ["input_ids"]), options=options).data
    loss = LossSpec("cross_entropy", ignore_index=IGNORE_INDEX, class_axis=-1)
    session = TrainingSession(str(model), loss=loss, optimizer=SGD(lr=0.5), backend="numpy")
    first = session.train_step({"input_ids": arrays["input_ids"][:16]}, labels[:16])
    with torch.no_grad():
        logits = torch_model(torch.from_numpy(arrays["input_ids"][:16]))
        want = torch.nn.functional.cross_entropy(logits.transpose(1, 2),
                                                 torch.from_numpy(labels[:16]),
                                                 ignore_index=IGNORE_INDEX)
    assert first == pytest.approx(float(want), rel=1e-5)
    Trainer(session, (arrays, labels), batch_size=16, epochs=20, progress=False,
            log=None).fit()
    out = session.export(tmp_path / "lm_trained.onnx")

    # the words are shuffled: a bigram model learns little beyond the word frequencies (the
    # untrained loss is about ln(vocabulary); the trained one measured 2.51 of 3.11)
    assert ort_lm_loss(out, arrays, labels) < 0.85 * ort_lm_loss(model, arrays, labels)


def test_a_causal_lm_trains_through_the_cli_with_the_loss_options(corpus, tmp_path):
    """The command line's causal LM: ``--loss-options class_axis=-1,ignore_index=-100``; the
    first epoch's loss is torch's cross-entropy of the untrained model's logits over the same
    batches' tokens, and training lowers onnxruntime's loss as the Python API's run does."""
    rows, tok, data = corpus
    vocab = Tokenizer.from_file(str(tok)).get_vocab_size()
    model = export(BigramLM(vocab), tmp_path / "lm.onnx", ["input_ids"], seq=True)
    spec = tmp_path / "lm.toml"
    spec.write_text(f'[text]\ntokenizer = "{tok}"\ntask = "causal_lm"\nmax_length = {T}\n')
    out = tmp_path / "lm_trained.onnx"
    assert main(["train", str(model), "--data", str(data), "--data-spec", str(spec),
                 "--loss-options", "class_axis=-1,ignore_index=-100", "--optimizer", "sgd",
                 "--lr", "0.5", "--epochs", "20", "--batch-size", "16", "--val-split", "0",
                 "--no-progress", "--backend", "numpy", "--out", str(out)]) == 0
    options = {"text": {"tokenizer": str(tok), "task": "causal_lm", "max_length": T}}
    arrays, labels = load(data, specs("seq", ["input_ids"]), options=options).data

    assert ort_lm_loss(out, arrays, labels) < 0.85 * ort_lm_loss(model, arrays, labels)


def test_loss_options_name_a_bad_key(capsys):
    assert main(["train", "m.onnx", "--data", "x.npz", "--loss-options", "ignore_idx=-100"]) == 2
    assert "did you mean ignore_index" in capsys.readouterr().err


@pytest.mark.parametrize("line, error", [
    ('{"label": "pos"}', r"train.jsonl:3: no 'text'"),
    ('{"text": 5, "label": "pos"}', r"train.jsonl:3: 'text' is 5, not a string"),
    ('{"text": "good"', r"train.jsonl:3: not a JSON object"),
    ('["good", "pos"]', r"train.jsonl:3: a JSON list, not an object"),
    ('{"text": "good"}', r"train.jsonl:3: no 'label'"),
], ids=["missing-text", "number-text", "bad-json", "not-an-object", "missing-label"])
def test_a_bad_row_names_the_file_and_line(tmp_path, corpus, line, error):
    _, tok, _ = corpus
    path = tmp_path / "train.jsonl"
    path.write_text('{"text": "good", "label": "pos"}\n\n' + line + "\n")
    with pytest.raises(InputError, match=error):
        load(path, specs(), options={"text": {"tokenizer": str(tok)}})


def test_a_csv_row_without_the_text_names_its_line(tmp_path, corpus):
    _, tok, _ = corpus
    path = tmp_path / "t.csv"
    path.write_text("text,label\ngood,pos\nbad\n")
    with pytest.raises(InputError, match=r"t.csv:3: no 'label'"):
        load(path, specs(), options={"kind": "text", "text": {"tokenizer": str(tok)}})


def test_missing_tokenizer_free_length_and_unmatched_inputs_are_errors(corpus):
    _, tok, data = corpus
    with pytest.raises(InputError, match="--tokenizer"):
        load(data, specs())
    with pytest.raises(InputError, match=r"free sequence length.*max_length"):
        load(data, specs("seq"), options={"text": {"tokenizer": str(tok)}})
    with pytest.raises(InputError, match="left for the token ids"):
        load(data, specs(names=("a", "b")), options={"text": {"tokenizer": str(tok)}})
    with pytest.raises(InputError, match="not a readable tokenizer"):
        load(data, specs(), options={"text": {"tokenizer": str(data)}})
