"""`kvjax simulate`: vLLM's scheduling on a clock instead of a model.

The scheduler and block pool are the engine's own (kvjax.core.sched.scheduler.Scheduler, its
jitted KV cache manager): nothing is re-implemented. What the engine gets from running the model
— how long a step took and which tokens it sampled — comes here from a cost model of the step
(kvjax.simulator.cost) and from a token source, so a run of thousands of requests on 8 GPUs
takes minutes on a 2-core CPU (experiments/simulate_speed.py) and every decision (admission,
chunking, preemption, prefix hits, the host tier) is the one the engine would make on the same
clock.

    clock.py       the driver: arrivals, schedule → step time → update, per-request token times,
                   `kvjax bench serve`'s metrics
    decode.py      runs of decode steps in one device call (the host loop's pool operations)
    deployment.py  kvjax plan's sizing → the scheduler (hybrid groups, the host tier)
    cost.py        step features, cost models (roofline with device presets; profiles fitted
                   from recorded steps)
"""
