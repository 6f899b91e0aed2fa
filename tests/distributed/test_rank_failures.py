"""A multi-process job whose ranks fall out of step ends, every process with one error, never a hang
(kvjax.distributed.runtime, kvjax.engine.lockstep); tests/distributed/mp_job.py on every rank, gloo between them.

- a rank whose scheduler diverges (mp_job.py's "perturb": it admits one waiting request fewer in its first step,
  as a rank with other settings or a bug would): every rank ends at that step's plan agreement, before any
  mismatched collective, with the same one error naming the step and the rank that differs;
- a rank > 0 killed (SIGKILL) as its first step begins: the others end with one error naming the step, within the
  stated timeout of its death (rank 0 killed, marked slow: JAX's client ends the others with JAX's own error);
- a rank that never joins: the ranks that came end with one error after --distributed-timeout-seconds.
mp_launch.launch fails a test if any process is still running at its limit.
"""
from __future__ import annotations

import pytest
from mp_launch import launch

RUN = {"model": "preset:tiny", "args": dict(block_size=4, num_gpu_blocks_override=48, tensor_parallel_size=2)}
TIMEOUT_S = 20  # --distributed-timeout-seconds of these jobs


def _one_error(rank, *words) -> str:
    errors = rank.errors()
    assert len(errors) == 1 and all(w in errors[0] for w in words), rank.stderr[-3000:]
    return errors[0]


def test_a_diverging_scheduler_ends_every_rank_with_one_error():
    ranks = launch(2, {"runs": [RUN], "timeout": TIMEOUT_S, "perturb": 1}, limit_s=180)
    for r, rank in enumerate(ranks):
        assert rank.returncode == 1, (r, rank.stderr[-3000:])
        _one_error(rank, "the plan of step 1 differs between ranks", "rank 1 against rank 0", "diverged")
        assert not rank.results()  # nothing generated: the step never ran


def test_a_killed_rank_ends_the_others_within_the_timeout():
    ranks = launch(2, {"runs": [RUN], "timeout": TIMEOUT_S, "die": 1}, limit_s=180)
    assert ranks[1].returncode == -9  # SIGKILL
    assert ranks[0].returncode == 1, ranks[0].stderr[-3000:]
    _one_error(ranks[0], "rank 0 of 2: lost the other ranks during the plan of step 1")
    assert ranks[0].ended_s - ranks[1].ended_s < TIMEOUT_S


@pytest.mark.slow
def test_rank_0_killed_ends_the_others_with_jaxs_error():
    """Rank 0 hosts JAX's coordination service: JAX's client ends the others itself, with its fatal error
    (kvjax.distributed.runtime's docstring says why that one is not kvjax's)."""
    ranks = launch(2, {"runs": [RUN], "timeout": TIMEOUT_S, "die": 0}, limit_s=180)
    assert ranks[0].returncode == -9
    assert ranks[1].returncode != 0 and "the JAX distributed service detected fatal errors" in ranks[1].stderr
    assert ranks[1].ended_s - ranks[0].ended_s < TIMEOUT_S


@pytest.mark.parametrize("present", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_rank_that_never_joins_ends_the_others_after_the_timeout(present):
    (rank,) = launch(2, {"runs": [RUN], "timeout": 3}, limit_s=60, ranks=[present])
    assert rank.returncode == 1, rank.stderr[-3000:]
    _one_error(rank, f"rank {present} of 2: not every rank joined", "within 3 s")
