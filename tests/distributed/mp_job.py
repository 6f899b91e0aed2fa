"""One rank of a multi-process kvjax job on this machine, for tests/distributed/test_multiprocess.py (run as a
script: `python mp_job.py RANK NNODES PORT SPEC`; never imported by the suite).

SPEC (JSON): {"runs": [run, ...], "timeout": S, "devices": per-process CPU devices, "perturb": rank or null,
"die": rank or null}. Each run builds one `kvjax.LLM` (run["args"]: its
engine arguments, tensor_parallel_size the whole job's) and generates mp_launch.PROMPTS with its sampling_params(); rank 0
prints one line per run, `RESULT {json}`: the token ids per prompt, the preemptions counted, and the bytes
of the first layer's KV pages on each of this process's devices. Every rank calls `LLM(...)`: on a rank > 0
it runs rank 0's engines until rank 0 ends the job (kvjax.engine.llm_engine.serve_rank0), so the lines after
it run on rank 0 only.

run["abort"]: then two requests more, the second aborted after one step (rank 0's abort reaches every rank, or
the next step's plans differ); "after_abort" holds the first one's tokens.

"perturb": that rank's scheduler admits one waiting request fewer in its first step than rank 0's (a
diverging scheduler, as a rank with other settings or a bug would have); the job must end with one error.
"die": that rank ends itself with SIGKILL when its first step begins; the other ranks must end with one error
within the timeout.
"""
import json
import os
import signal
import sys

rank, nnodes, port, spec = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", spec.get("devices", 1))

from kvjax import LLM  # noqa: E402
from mp_launch import PROMPTS, sampling_params  # noqa: E402 (beside this script)

if spec.get("perturb") == rank:
    from kvjax.core.sched.scheduler import Scheduler

    admit = Scheduler._admit_waiting

    def _admit_one_fewer(self, step):
        if getattr(self, "_perturbed", False) or len(self.waiting) < 2:
            return admit(self, step)
        self._perturbed = True
        held = self.waiting.pop()  # the last waiting request waits one step longer here than on rank 0
        try:
            return admit(self, step)
        finally:
            self.waiting.append(held)

    Scheduler._admit_waiting = _admit_one_fewer

if spec.get("die") == rank:
    from kvjax.engine import lockstep

    def _kill(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    lockstep.LockstepScheduler.schedule = _kill

for run in spec["runs"]:
    llm = LLM(run["model"], nnodes=nnodes, node_rank=rank, master_port=port, use_tqdm_on_load=False,
              distributed_timeout_seconds=spec.get("timeout", 60), **run["args"])
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling_params(), use_tqdm=False)
    engine = llm.llm_engine.engine
    layer = engine.cache.layers[0]
    pages = layer.latent if hasattr(layer, "latent") else layer.k
    preempted = sum(m.value for m in engine.metrics.snapshot() if m.name == "vllm:num_preemptions")
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "preemptions": preempted,
              "page_bytes": [s.data.nbytes for s in pages.addressable_shards], "num_blocks": engine.config.num_blocks}
    if run.get("abort"):  # two requests, the second aborted after one step: the first must finish as it would alone
        greedy = sampling_params()[0]
        llm.llm_engine.add_request("kept", {"prompt_token_ids": PROMPTS[0]}, greedy)
        llm.llm_engine.add_request("aborted", {"prompt_token_ids": PROMPTS[2]}, greedy)
        llm.llm_engine.step()
        llm.llm_engine.abort_request("aborted")
        kept = []
        while llm.llm_engine.has_unfinished_requests():
            kept += [list(o.outputs[0].token_ids) for o in llm.llm_engine.step() if o.finished]
        result["after_abort"] = kept
    print("RESULT " + json.dumps(result), flush=True)
    del llm
