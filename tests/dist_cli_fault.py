"""Run under ``mpiexec`` by tests/test_distributed_cli.py: ``tr-onnx train`` (``tr_onnx.cli.main``
with the arguments after the first three) in which one rank fails at an optimizer step, as a
rank of a real run fails: ``kill`` -- it is killed (SIGKILL, as the kernel's OOM killer does);
``hang`` -- it stops taking part (a stuck file system, a deadlocked thread).

Usage: ``dist_cli_fault.py kill|hang RANK STEP tr-onnx-arguments...``
"""

from __future__ import annotations

import os
import signal
import sys
import time

from tr_onnx import distributed
from tr_onnx.cli import main
from tr_onnx.training.session import TrainingSession


def fail_at(mode: str, step: int) -> None:
    """Make this process's ``TrainingSession.train_step`` fail as ``mode`` says when the
    session has taken ``step`` optimizer steps."""
    original = TrainingSession.train_step

    def train_step(self, *args, **kwargs):
        if self.step == step:
            print(f"dist_cli_fault: rank {self.world.rank} fails ({mode}) at step {step}",
                  file=sys.stderr, flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(3600)  # the launcher ends it when the others give up
        return original(self, *args, **kwargs)

    TrainingSession.train_step = train_step


if __name__ == "__main__":
    mode, rank, step, *argv = sys.argv[1:]
    if mode not in ("kill", "hang"):
        sys.exit(f"dist_cli_fault.py: mode {mode!r}; use kill or hang")
    if distributed.init().rank == int(rank):
        fail_at(mode, int(step))
    sys.exit(main(argv))
