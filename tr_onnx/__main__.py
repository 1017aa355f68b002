"""``python -m tr_onnx`` and the ``tr-onnx`` command: ``tr_onnx.cli.main``, imported inside the
guard against an interrupt, so that Ctrl-C in start-up (about a second of importing NumPy,
onnx and ml_dtypes) ends as any other interrupt does: one line, exit status 130."""

import sys

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C


def main(argv: list[str] | None = None) -> int:
    """Run ``tr-onnx`` with ``argv`` (default: the process's arguments); the exit status."""
    try:
        from .cli import main as cli_main

        return cli_main(argv)
    except KeyboardInterrupt:  # training says more itself (where to --resume)
        print("tr-onnx: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
