"""When a rank is killed (kill -9, the OOM killer), the launcher names it and the signal, also when the other ranks
then fail with errors of their own that do not say which peer died."""

from __future__ import annotations

from types import SimpleNamespace

from vlmctl.distributed.process import _failed_ranks_code


def test_a_killed_rank_is_named_next_to_the_others_errors(capsys):
    failures = {0: SimpleNamespace(exitcode=1, pid=100), 1: SimpleNamespace(exitcode=-9, pid=101), 2: SimpleNamespace(exitcode=1, pid=102)}
    assert _failed_ranks_code(failures) == 1
    err = capsys.readouterr().err
    assert "rank 1 (pid 101) was killed by SIGKILL (out of memory?)" in err and "rank 0" not in err


def test_ranks_stopped_by_the_launchers_own_signal_stay_quiet(capsys):
    assert _failed_ranks_code({0: SimpleNamespace(exitcode=-15, pid=10), 1: SimpleNamespace(exitcode=-15, pid=11)}) == 143
    assert capsys.readouterr().err == ""
