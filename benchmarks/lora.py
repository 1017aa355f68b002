"""LoRA fine-tuning against full fine-tuning, tr_onnx against PyTorch + peft: trainable
parameters, memory and step time on the CPU.

    python benchmarks/lora.py [--size small|tiny] [--models llama,bert] [--rank 8]
                              [--warmup 2] [--steps 15] [--threads 1] [--blas-env both]

The models are the Hugging Face Llama (causal LM) and BERT (sequence classification) of
``tests/real_exports.py``, random weights (seeded), exported by the classic torch exporter.
``tiny`` is its config (hidden 32, 2 layers, batch 3 x 7 tokens); ``small`` is hidden 256,
4 layers, 4 heads, FFN 512, batch 8 x 64 tokens (vocabulary 300 both). Four ways to train each,
AdamW (lr 1e-4), cross-entropy, numpy/CPU:

- tr_onnx LoRA: ``finetune.add_lora`` (rank r, alpha 2r, on the attention and MLP
  projections; BERT's new classifier trains too), the base frozen;
- tr_onnx full: every parameter;
- PyTorch + peft: ``peft.inject_adapter_in_model`` with the same rank, alpha and targets
  (BERT: the classifier trains too);
- PyTorch full.

Step time: the median (and min) of ``--steps`` steps after ``--warmup`` (each step's loss read
back); ratios of medians (and of minima, the least disturbed steps on a shared machine).
Memory: tr_onnx's MemoryPlan arena and its GRAD + OPT_STATE regions; for both,
parameters + gradients + optimizer state, in bytes: tr_onnx's PARAM + GRAD + OPT_STATE
regions (256-byte slots), PyTorch's measured after the timed steps from the tensors themselves
(every parameter's ``nbytes``, every ``.grad``'s, every tensor in ``optimizer.state``). Each
OpenBLAS setting (``--blas-env``) runs in a process of its own, the four peers taking turns
step by step in it (on a busy machine they are slowed alike).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import peer_common

ROOT = Path(__file__).resolve().parent.parent
SIZES = {  # name: hidden, layers, heads, batch, sequence
    "tiny": (32, 2, 2, 3, 7),
    "small": (256, 4, 4, 8, 64),
}
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "bert": ["query", "key", "value", "dense"]}
TRAIN_ALSO = {"bert": "classifier"}  # the new head (peft: modules_to_save)
PEERS = ("tr_onnx LoRA", "tr_onnx full", "PyTorch + peft LoRA", "PyTorch full")
LR = 1e-4


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=SIZES, default="small")
    p.add_argument("--models", default="llama,bert")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=15)
    # one BLAS thread: on a 2-core VM that other processes share, two threads per peer stall
    # (a step's median went from ~0.1 s to 1-4 s while the load average was 3.5-4.6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--blas-env", choices=peer_common.BLAS_MODES, default="both",
                   help="OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE as given, unset, or both runs")
    p.add_argument("--blas-setting", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bench-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _rx():
    """``tests/real_exports.py`` (its folder on the path: it imports torch_parity)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import real_exports

    return real_exports


def build(name: str, size: str):
    """real_exports' model ``name`` at ``size``: its config with the sizes changed, every
    parameter randomised as ``real_exports.build`` does."""
    import torch
    import transformers

    rx = _rx()
    hidden, layers, heads, _, seq = SIZES[size]
    common = dict(vocab_size=rx.VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, intermediate_size=2 * hidden,
                  max_position_embeddings=max(16, seq))
    if name == "llama":
        config = transformers.LlamaConfig(**common, num_key_value_heads=1, bos_token_id=0,
                                          eos_token_id=0)
    else:
        config = transformers.BertConfig(**common, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0,
                                         num_labels=rx.CLASSES)
    torch.manual_seed(0)
    model = rx._CLASSES[name](config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return rx.TextLogits(model).eval()


def batches(name: str, size: str, count: int):
    rx = _rx()
    _, _, _, batch, seq = SIZES[size]
    return [(rx.example_inputs(name, seed=k, batch=batch, seq=seq),
             rx.example_labels(name, seed=k, batch=batch, seq=seq)) for k in range(count)]


def timed(peers: dict, data, warmup: int) -> tuple[dict, dict]:
    """Milliseconds of each peer's steps after ``warmup``, and its step-1 loss; ``peers`` maps
    a name to its ``step(feed, labels)`` (which returns the loss). The peers take turns step by
    step, so that a busy machine slows them alike."""
    times: dict[str, list[float]] = {name: [] for name in peers}
    first: dict[str, float] = {}
    for k, (feed, labels) in enumerate(data):
        for name, step in peers.items():
            start = time.perf_counter()
            loss = step(feed, labels)
            if k >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
            first.setdefault(name, loss)
    return times, first


def tr_onnx_peer(path: Path, name: str, lora: bool, args):
    """tr_onnx's ``(step, memory)``: the step function and what reports the plan's bytes."""
    import onnx

    import tr_onnx
    from tr_onnx.finetune.lora import add_lora
    from tr_onnx.memory import Region

    model, trainable = onnx.load(path), None
    if lora:
        model, info = add_lora(model, rank=args.rank, alpha=2 * args.rank,
                               targets="|".join(TARGETS[name]), train_also=TRAIN_ALSO.get(name))
        trainable = info.trainable
    session = tr_onnx.TrainingSession(
        model, loss=tr_onnx.LossSpec("cross_entropy", class_axis=-1 if name == "llama" else 1),
        optimizer=tr_onnx.optim.AdamW(lr=LR), trainable=trainable, backend="numpy")

    def memory() -> dict:
        plan = session._state.active
        mem, params = plan.memory, session.parameters()
        region = {r.name: b for r, (_, b) in mem.regions.items()}
        return {"trainable": sum(params[n].size for n in plan.info.trainable),
                "arena": mem.total_bytes,
                "grad_opt": region.get(Region.GRAD.name, 0) + region.get(Region.OPT_STATE.name, 0),
                "param_grad_opt": sum(region.get(r.name, 0) for r in (Region.PARAM, Region.GRAD,
                                                                      Region.OPT_STATE))}
    return lambda f, y: float(session.train_step(f, y)), memory


def torch_peer(name: str, lora: bool, args):
    """PyTorch's ``(step, memory)``, as ``tr_onnx_peer``'s."""
    import peft
    import torch

    module = build(name, args.size)
    if lora:
        module = peft.inject_adapter_in_model(peft.LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS[name],
            lora_dropout=0.0), module)
        for pname, p in module.named_parameters():
            if TRAIN_ALSO.get(name, "\0") in pname:
                p.requires_grad_(True)
    module.train()
    trained = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR)

    def step(feed, labels):
        out = module(**{k: torch.from_numpy(x) for k, x in feed.items()})
        y = torch.from_numpy(labels)
        if name == "llama":
            out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
        loss = torch.nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    def memory() -> dict:
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        measured = (sum(p.nbytes for p in module.parameters())
                    + sum(p.grad.nbytes for p in trained if p.grad is not None)
                    + sum(t.nbytes for t in state))
        return {"trainable": sum(p.numel() for p in trained), "arena": None,
                "grad_opt": None, "param_grad_opt": measured}
    return step, memory


def measure(args) -> None:
    import numpy  # noqa: F401  (loads its OpenBLAS, which the header line names)

    bench = Path(args.bench_dir)
    print(f"{peer_common.blas_kernels()}; {args.threads} threads; {args.size}: hidden, layers, "
          f"heads, batch, sequence = {SIZES[args.size]}; LoRA rank {args.rank}, alpha "
          f"{2 * args.rank}; AdamW lr {LR}; {args.warmup} warm-up + {args.steps} timed steps\n")
    for name in args.models.split(","):
        data = batches(name, args.size, args.warmup + args.steps)
        path = bench / f"{name}-{args.size}.onnx"
        peers = {PEERS[0]: tr_onnx_peer(path, name, True, args),
                 PEERS[1]: tr_onnx_peer(path, name, False, args),
                 PEERS[2]: torch_peer(name, True, args),
                 PEERS[3]: torch_peer(name, False, args)}
        times, first = timed({p: step for p, (step, _) in peers.items()}, data, args.warmup)
        results = {p: {"times": times[p], "first": first[p], **memory()}
                   for p, (_, memory) in peers.items()}
        print_table(name, args.size, results)


def print_table(name: str, size: str, results: dict) -> None:
    """One markdown table: a row per peer of ``results`` (its step times and memory)."""
    import numpy as np

    med = {p: float(np.median(r["times"])) for p, r in results.items()}
    low = {p: min(r["times"]) for p, r in results.items()}

    def ratio(a: str, b: str) -> str:  # medians (minima: the least disturbed steps)
        return f"{med[a] / med[b]:.2f}x ({low[a] / low[b]:.2f}x)"
    same = {PEERS[0]: PEERS[2], PEERS[1]: PEERS[3], PEERS[2]: PEERS[0], PEERS[3]: PEERS[1]}
    full = {PEERS[0]: PEERS[1], PEERS[1]: PEERS[1], PEERS[2]: PEERS[3], PEERS[3]: PEERS[3]}
    print(f"### {name} ({size})\n")
    print("| peer | trainable params | arena B | GRAD+OPT_STATE B | params+grads+opt state B "
          "| ms/step median (min) | time / same method, other framework | time / own full "
          "| params+grads+opt / own full | step-1 loss |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for peer, r in results.items():
        def num(v):
            return "–" if v is None else f"{v:,d}"
        pgo = r["param_grad_opt"] / results[full[peer]]["param_grad_opt"]
        print(f"| {peer} | {r['trainable']:,d} | {num(r['arena'])} | {num(r['grad_opt'])} | "
              f"{r['param_grad_opt']:,d} | {med[peer]:.2f} ({low[peer]:.2f}) | "
              f"{ratio(peer, same[peer])} | {ratio(peer, full[peer])} | "
              f"{pgo:.2f}x | {r['first']:.6f} |")
    print()


def export(bench: Path, models: list[str], size: str) -> None:
    import warnings

    import torch

    rx = _rx()
    for name in models:
        module = build(name, size)
        feed = batches(name, size, 1)[0][0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rx._export(module, tuple(torch.from_numpy(x) for x in feed.values()), list(feed),
                       {0: "batch", 1: "seq"}, "classic", bench / f"{name}-{size}.onnx")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in TARGETS]
    if unknown:
        print(f"unknown model(s) {unknown}; valid: {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    peer_common.pin_threads(args.threads)
    if args.blas_setting is not None:
        measure(args)
        return 0
    argv = sys.argv[1:] if argv is None else list(argv)
    with tempfile.TemporaryDirectory(prefix="tr_onnx_lora_") as tmp:
        export(Path(tmp), models, args.size)
        return peer_common.rerun_per_blas_setting(__file__, [*argv, "--bench-dir", tmp],
                                                  args.blas_env)


if __name__ == "__main__":
    sys.exit(main())
