"""Start a kvjax job of N processes on this machine (tests/distributed/mp_job.py on every rank, gloo between them)
and collect what each process did: its exit status, stdout, stderr and when it ended; and the requests every
job runs (PROMPTS, sampling_params), which the tests' single-process references run too."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mp_job.py")
# Prompts of 7, 3, 13 and 5 tokens (none a multiple of the tests' block sizes), the last one sampled with a seed.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32], [5, 5, 5, 5, 5]]
MAX_TOKENS = 8


def sampling_params():
    """Greedy for the first three prompts; the last sampled at temperature 1 with seed 7, which every rank keeps."""
    from kvjax import SamplingParams

    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return [greedy] * 3 + [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7)]


@dataclasses.dataclass
class Rank:
    returncode: int
    stdout: str
    stderr: str
    ended_s: float  # seconds after the launch

    def results(self) -> list[dict]:
        return [json.loads(line[len("RESULT "):]) for line in self.stdout.splitlines() if line.startswith("RESULT ")]

    def errors(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("kvjax: error:")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nnodes: int, spec: dict, *, limit_s: float, ranks=None) -> list[Rank]:
    """Run mp_job.py as ranks `ranks` (default all nnodes) of one job; → each one's Rank, in `ranks` order. Every
    process must end within limit_s of the launch, else all are killed and the test fails naming those left."""
    port, start = free_port(), time.time()
    ranks = list(range(nnodes) if ranks is None else ranks)
    with tempfile.TemporaryDirectory() as tmp:
        files = {r: (open(os.path.join(tmp, f"{r}.out"), "w+"), open(os.path.join(tmp, f"{r}.err"), "w+"))
                 for r in ranks}
        procs = {r: subprocess.Popen([sys.executable, JOB, str(r), str(nnodes), str(port), json.dumps(spec)],
                                     stdout=files[r][0], stderr=files[r][1], text=True) for r in ranks}
        ended: dict[int, float] = {}
        try:
            while len(ended) < len(procs):
                for r, p in procs.items():
                    if r not in ended and p.poll() is not None:
                        ended[r] = time.time() - start
                if time.time() - start > limit_s:
                    raise AssertionError(f"ranks {sorted(set(procs) - set(ended))} still running {limit_s} s after "
                                         "the launch")
                time.sleep(0.05)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        out = []
        for r in ranks:
            texts = []
            for f in files[r]:
                f.seek(0)
                texts.append(f.read())
                f.close()
            out.append(Rank(procs[r].returncode, *texts, ended[r]))
        return out
