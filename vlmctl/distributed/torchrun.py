"""`python -m vlmctl.distributed.torchrun ARGS`: torchrun (`torch.distributed.run.main`, the same arguments) as
`vlmctl train` runs it: it dies with vlmctl, and when ranks fail it exits with their code instead of printing
torchrun's ChildFailedError (see `vlmctl.distributed.process.run_agent`).

Over several nodes the c10d rendezvous numbers the nodes itself (by host name, then agent pid); the `--node-rank`
vlmctl passes along names the node in the process list only, so torchrun's warning that c10d ignores it is dropped.
"""

from __future__ import annotations

import logging
import sys

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# Light vlmctl modules are imported next to their use as well.

NODE_RANK_NOTE = "node_rank is only used for static rdzv_backend"


class _DropNodeRankNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return NODE_RANK_NOTE not in record.getMessage()


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.run import logger
    from torch.distributed.run import main as torchrun_main

    from vlmctl.distributed.process import run_agent

    logger.addFilter(_DropNodeRankNote())
    args = sys.argv[1:] if argv is None else argv
    run_agent(lambda: torchrun_main(args))


if __name__ == "__main__":
    main()
