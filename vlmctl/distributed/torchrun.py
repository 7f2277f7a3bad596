"""`python -m vlmctl.distributed.torchrun ARGS`: torchrun (`torch.distributed.run.main`, the same arguments) as
`vlmctl train` runs it: it dies with vlmctl, and when ranks fail it exits with their code instead of printing
torchrun's ChildFailedError (see `vlmctl.distributed.process.run_agent`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun_main

    from vlmctl.distributed.process import run_agent

    args = sys.argv[1:] if argv is None else argv
    run_agent(lambda: torchrun_main(args))


if __name__ == "__main__":
    main()
