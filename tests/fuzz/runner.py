"""Run the fuzzer's cases, each in a process of its own, and classify them.

A worker (``python tests/fuzz/runner.py --worker``) imports tr_onnx, onnx and onnxruntime once
(single-threaded BLAS and OpenMP, so that a fork is safe), then for each case it is given forks
a child: the references (for a random graph) in one child, the case in another, each under
``RLIMIT_AS`` and killed at its timeout. The child writes what happened to ``result.json``; an
audit hook records any open of the canary file beside the model's folder.

Outcomes: ``ok`` (ran; equal to both references where they agree), ``clean_error`` (a
``TrOnnxError``, or ``tr-onnx: error:`` and exit status 2), and the bugs: ``traceback`` (any
other exception), ``signal``, ``timeout``, ``memory`` (MemoryError), ``wrong_result``,
``file_escape``. A bug's signature (its kind, the exception's type and innermost tr_onnx
function, the case's generator and subject) keys it in ``known_bugs.KNOWN``.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]  # tests/ (fuzz_models), the repo

from fuzz import known_bugs  # noqa: E402
from fuzz.generators import CANARY, GENERATORS, MODEL, Case, make_case  # noqa: E402

BUGS = ("traceback", "signal", "timeout", "memory", "wrong_result", "file_escape")
MEMORY_BYTES = 3 << 30
TIMEOUT_S = 20.0  # CPU seconds per case
WALL_FACTOR = 4  # wall-clock seconds per CPU second before a case is killed as a hang
SABOTAGE = "TR_ONNX_FUZZ_SABOTAGE"  # "signal", "hang", "escape", "memory": the harness's test
THREAD_VARS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# ---- inside the child ---------------------------------------------------------------------


def _limit(memory_bytes: int, timeout: float) -> None:
    # the timeout counts CPU seconds (SIGXCPU): on a loaded machine wall time would call slow
    # cases hangs; the parent's wall-clock limit (WALL_FACTOR times it) catches a hang that
    # spends no CPU
    seconds = math.ceil(timeout)
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _watch_canary(folder: Path, found: list) -> None:
    canary = str((folder / CANARY).resolve())

    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            with contextlib.suppress(OSError, ValueError):
                if os.path.realpath(os.path.join(folder, path)) == canary and not found:
                    found.append("".join(traceback.format_stack(limit=12)))
    sys.addaudithook(hook)


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/tr_onnx/" in f.filename] or frames
    return f"{Path(ours[-1].filename).name}:{ours[-1].name}" if ours else "?"


def _references(folder: Path) -> dict:
    """onnx.reference's and onnxruntime's outputs, saved where both run and agree."""
    import numpy as np
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator

    model = (folder / MODEL).read_bytes()
    feed = dict(np.load(folder / "feed.npz"))
    try:
        ref = ReferenceEvaluator(model).run(None, feed)
        so = ort.SessionOptions()
        so.log_severity_level = 4
        so.intra_op_num_threads = 1
        rt = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feed)
    except Exception as exc:
        return {"agree": False, "why": f"{type(exc).__name__}: {str(exc)[:200]}"}
    for a, b in zip(ref, rt, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or not np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True):
            return {"agree": False, "why": "the references differ"}
    np.savez(folder / "want.npz", *[np.asarray(a) for a in rt])
    return {"agree": True}


def _compare(got: list, folder: Path) -> str | None:
    import numpy as np

    want = np.load(folder / "want.npz")
    want = [want[f"arr_{k}"] for k in range(len(want.files))]
    if len(got) != len(want):
        return f"{len(got)} outputs, the references {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return f"output {k}: shape {list(g.shape)}, the references {list(w.shape)}"
        scale = float(np.max(np.abs(w[np.isfinite(w)]), initial=0.0)) if w.size else 0.0
        close = np.isclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-3,
                           atol=1e-4 * scale + 1e-5, equal_nan=True)
        if not close.all():
            i = int(np.flatnonzero(~close)[0])
            return (f"output {k} {list(g.shape)}: {int((~close).sum())} element(s) differ, "
                    f"first at {i}: {g.reshape(-1)[i]!r} vs {w.reshape(-1)[i]!r}")
    return None


def _run_session(folder: Path, oracle: bool) -> dict:
    import numpy as np
    from fuzz_models import BATCH, MAX_FEED_BYTES

    import tr_onnx

    session = tr_onnx.InferenceSession(str(folder / MODEL))
    if (folder / "feed.npz").exists():
        feed = dict(np.load(folder / "feed.npz"))
    else:
        rng, feed = np.random.default_rng(0), {}
        for spec in session.imported.inputs:
            shape = [d if isinstance(d, int) else BATCH for d in (spec.shape or ())]
            if any(d < 0 for d in shape) or \
                    int(np.prod(shape, dtype=object)) * spec.dtype.itemsize > MAX_FEED_BYTES:
                return {"outcome": "ok", "detail": "imported (feed too large to run)"}
            feed[spec.name] = (rng.standard_normal(shape) if spec.dtype.kind == "f"
                               else rng.integers(0, 3, shape)).astype(spec.dtype)
    got = session.run(None, feed)
    if oracle and (folder / "want.npz").exists():
        wrong = _compare(got, folder)
        if wrong:
            return {"outcome": "wrong_result", "detail": wrong, "signature": "wrong_result"}
        # again with channels padded to 4 lanes: kernels then see strided views (NumPy's
        # negative loop was wrong on them only)
        padded = tr_onnx.InferenceSession(str(folder / MODEL), channel_align=4)
        wrong = _compare(padded.run(None, feed), folder)
        if wrong:
            return {"outcome": "wrong_result", "detail": f"channel_align=4: {wrong}",
                    "signature": "wrong_result(channel_align=4)"}
        return {"outcome": "ok", "detail": "equal to both references (also channel_align=4)"}
    return {"outcome": "ok", "detail": "ran"}


def _run_train(folder: Path, data: str) -> dict:
    from tr_onnx import cli

    err = folder / "stderr.txt"
    with open(err, "w") as f, contextlib.redirect_stderr(f), \
            contextlib.redirect_stdout(open(os.devnull, "w")):
        rc = cli.main(["train", str(folder / MODEL), "--data", str(folder / data),
                       "--epochs", "1", "--batch-size", "4", "--no-progress",
                       "--backend", "numpy", "--out", str(folder / "out" / "trained.onnx")])
    last = (err.read_text().strip().splitlines() or [""])[-1]
    if rc == 0:
        return {"outcome": "ok", "detail": "trained"}
    if rc == 2 and last.startswith("tr-onnx: error:") and "Traceback" not in err.read_text():
        return {"outcome": "clean_error", "detail": last[:300]}
    return {"outcome": "traceback", "detail": f"exit {rc}: {last[:300]}",
            "signature": f"exit {rc}"}


def _sabotage(how: str, folder: Path) -> None:
    """The ways a case can fail, done on purpose: the harness's own test."""
    if how == "signal":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif how == "hang":
        time.sleep(10 ** 6)
    elif how == "escape":
        (folder / CANARY).read_bytes()
    elif how == "memory":
        bytearray(MEMORY_BYTES * 2)


def _child(case: Case, folder: Path, what: str, memory_bytes: int, timeout: float) -> None:
    """The body of a forked child: never returns."""
    code = 0
    try:
        os.chdir(folder)
        fault = open(folder / f"{what}.fault.txt", "w")  # a fatal signal's stack, not the parent's
        faulthandler.enable(file=fault)
        _limit(memory_bytes, timeout)
        escaped: list = []
        if what == "references":
            result = _references(folder)
        else:
            _watch_canary(folder, escaped)
            try:
                _sabotage(os.environ.get(SABOTAGE, ""), folder)
                result = (_run_train(folder, case.data) if case.action == "train"
                          else _run_session(folder, case.oracle))
            except MemoryError as exc:
                result = {"outcome": "memory", "signature": f"MemoryError@{_where(exc)}",
                          "detail": traceback.format_exc()[-1500:]}
            except Exception as exc:
                import tr_onnx

                memory = isinstance(exc.__cause__ or exc.__context__, MemoryError)
                if isinstance(exc, tr_onnx.TrOnnxError) and not memory \
                        and not isinstance(exc, tr_onnx.errors.InternalError):
                    result = {"outcome": "clean_error", "detail": str(exc)[:300]}
                else:
                    result = {"outcome": "memory" if memory else "traceback",
                              "signature": f"{type(exc).__name__}@{_where(exc)}",
                              "detail": traceback.format_exc()[-1500:]}
            if escaped:
                result = {"outcome": "file_escape", "signature": "file_escape",
                          "detail": escaped[0][-1500:]}
        (folder / f"{what}.json").write_text(json.dumps(result))
    except BaseException:  # noqa: BLE001 - a child reports, then exits, whatever happened
        code = 3
        with contextlib.suppress(Exception):
            (folder / f"{what}.json").write_text(json.dumps({
                "outcome": "traceback", "signature": "harness",
                "detail": traceback.format_exc()[-1500:]}))
    os._exit(code)


def _fork(case: Case, folder: Path, what: str, memory_bytes: int, timeout: float) -> dict:
    pid = os.fork()
    if pid == 0:
        _child(case, folder, what, memory_bytes, timeout)
    deadline = time.monotonic() + timeout * WALL_FACTOR
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"outcome": "timeout", "signature": "timeout",
                    "detail": f"killed after {timeout * WALL_FACTOR} s of wall-clock time"}
        time.sleep(0.005)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
        return {"outcome": "timeout", "signature": "timeout",  # SIGKILL: past the hard limit
                "detail": f"past {timeout} s of CPU time"}
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        fault = folder / f"{what}.fault.txt"
        stack = fault.read_text()[-1500:] if fault.exists() else ""
        return {"outcome": "signal", "signature": sig, "detail": f"killed by {sig}\n{stack}"}
    path = folder / f"{what}.json"
    if not path.exists():
        return {"outcome": "traceback", "signature": f"exit {os.WEXITSTATUS(status)}",
                "detail": "the child exited without a result"}
    return json.loads(path.read_text())


def write_files(case: Case, folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    for rel, data in case.files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if data.startswith(b"symlink:"):
            path.symlink_to(data.removeprefix(b"symlink:").decode())
        else:
            path.write_bytes(data)


def run_one(case: Case, folder: Path, memory_bytes: int = MEMORY_BYTES,
            timeout: float = TIMEOUT_S) -> dict:
    """Case ``case`` run in ``folder`` (written afresh): its record."""
    write_files(case, folder)
    oracle = case.oracle
    if case.generator == "random_graph":
        refs = _fork(case, folder, "references", memory_bytes, timeout)
        oracle = refs.get("agree", False)
    result = _fork(case, folder, "case", memory_bytes, timeout)
    record = {"index": case.index, "generator": case.generator, "subject": case.subject,
              "description": case.description[:400], "oracle": oracle, **result}
    if record["outcome"] in BUGS:
        record["signature"] = signature(record)
        record["known"] = known_bugs.item_of(record["signature"])
    return record


def signature(record: dict) -> str:
    """What tells two bugs apart: the outcome, the child's signature (exception type and
    innermost tr_onnx function, or the signal), the generator and the case's subject (its
    op, data kind or model; for a structure mutation, the model only)."""
    subject = record["subject"]
    if record["generator"] in ("zoo_structure", "zoo_bytes"):
        subject = subject.split(":")[0].split("_")[0].removesuffix(".onnx")
        if record["outcome"] == "traceback":
            subject = "*"  # an exception's place tells it apart; the model does not
    return f"{record['outcome']}|{record.get('signature', '')}|{record['generator']}|{subject}"


# ---- the worker and the campaign ------------------------------------------------------------


def worker(seed: int, first: int, step: int, count: int | None, deadline: float,
           out: Path, memory_bytes: int, timeout: float) -> None:
    """Cases first, first + step, ... (``count`` of them, or until ``deadline``), one JSON
    record per line on stdout."""
    import onnx  # noqa: F401 - imported once here, inherited by every child
    import onnxruntime  # noqa: F401
    from onnx.reference import ReferenceEvaluator  # noqa: F401

    import tr_onnx  # noqa: F401
    from tr_onnx import cli  # noqa: F401

    work = out / "work" / f"w{first}"
    index, done = first, 0
    while (count is None or done < count) and time.time() < deadline:
        case = make_case(seed, index)
        start = time.monotonic()
        record = run_one(case, work / str(index), memory_bytes, timeout)
        record["seconds"] = round(time.monotonic() - start, 3)
        record["seed"] = seed
        if record["outcome"] in BUGS:
            save_reproducer(case, record, out, work / str(index))
        shutil.rmtree(work / str(index), ignore_errors=True)
        print(json.dumps(record), flush=True)
        index, done = index + step, done + 1


def save_reproducer(case: Case, record: dict, out: Path, folder: Path) -> None:
    """The case's files and the command that reruns it, under ``out/bugs/<index>/``."""
    target = out / "bugs" / f"{case.generator}-{case.index}"
    write_files(case, target)
    (target / "record.json").write_text(json.dumps(record, indent=1))
    (target / "README.txt").write_text(
        f"{record['signature']}\n{case.description}\n\nrerun:\n  python "
        f"tests/fuzz/runner.py --seed {record.get('seed', '?')} --case {case.index}\n")


def campaign(seed: int, out: Path, workers: int = 2, cases: int | None = None,
             minutes: float | None = None, memory_bytes: int = MEMORY_BYTES,
             timeout: float = TIMEOUT_S) -> list[dict]:
    """Cases 0.. of ``seed`` over ``workers`` worker processes: ``cases`` of them, or as many
    as ``minutes`` allow. Every record, in case order."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + (minutes * 60 if minutes else 10 ** 9)
    env = {**os.environ, **THREAD_VARS,
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH",
                                                                                "")])}
    procs = []
    for w in range(workers):
        share = None if cases is None else len(range(w, cases, workers))
        cmd = [sys.executable, str(HERE / "runner.py"), "--worker", "--seed", str(seed),
               "--first", str(w), "--step", str(workers), "--deadline", str(deadline),
               "--out", str(out), "--memory-bytes", str(memory_bytes),
               "--timeout", str(timeout)] + ([] if share is None else ["--count", str(share)])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True))
    records = []
    for p in procs:
        stdout, _ = p.communicate()
        records += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        if p.returncode:
            records.append({"index": -1, "generator": "harness", "subject": "worker",
                            "outcome": "traceback", "signature": f"worker exit {p.returncode}",
                            "description": "a worker died", "known": None})
    records.sort(key=lambda r: r["index"])
    for r in records:
        r["seed"] = seed
    return records


def write_records(records: list[dict], out: Path) -> None:
    with open(out / "records.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def report(records: list[dict], seed: int) -> str:
    """Counts per generator and outcome, then the bugs: unknown first, then known ones."""
    counts = Counter((r["generator"], r["outcome"]) for r in records)
    outcomes = ["ok", "clean_error", *BUGS]
    lines = [f"seed {seed}: {len(records)} cases",
             f"{'generator':<14}" + "".join(f"{o:>13}" for o in outcomes)]
    for g in [*GENERATORS, "harness"]:
        if any(k[0] == g for k in counts):
            lines.append(f"{g:<14}" + "".join(f"{counts[(g, o)]:>13}" for o in outcomes))
    bugs = [r for r in records if r["outcome"] in BUGS]
    for title, group in (("new bugs", [r for r in bugs if not r.get("known")]),
                         ("known bugs", [r for r in bugs if r.get("known")])):
        by_sig = Counter(r["signature"] for r in group)
        lines.append(f"{title}: {len(group)} cases, {len(by_sig)} signatures")
        for sig, n in by_sig.most_common():
            first = next(r for r in group if r["signature"] == sig)
            item = f" [{first['known']}]" if first.get("known") else ""
            lines.append(f"  {n:4d} x {sig}{item}: case {first['index']} "
                         f"({first['description'][:120]})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--seed", type=int, default=35)
    p.add_argument("--case", type=int, help="run this one case and print its record")
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--step", type=int, default=1)
    p.add_argument("--count", type=int)
    p.add_argument("--deadline", type=float, default=float("inf"))
    p.add_argument("--out", type=Path, default=Path("fuzz-out"))
    p.add_argument("--memory-bytes", type=int, default=MEMORY_BYTES)
    p.add_argument("--timeout", type=float, default=TIMEOUT_S)
    args = p.parse_args(argv)
    args.out = args.out.resolve()  # the child changes into its case's folder
    if args.worker:
        worker(args.seed, args.first, args.step, args.count, args.deadline, args.out,
               args.memory_bytes, args.timeout)
        return 0
    if args.case is not None:
        os.environ.update(THREAD_VARS)
        case = make_case(args.seed, args.case)
        record = run_one(case, args.out / "work" / str(args.case), args.memory_bytes,
                         args.timeout)
        print(case.description)
        print(json.dumps(record, indent=1))
        return 0
    records = campaign(args.seed, args.out, cases=args.count)
    write_records(records, args.out)
    print(report(records, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
