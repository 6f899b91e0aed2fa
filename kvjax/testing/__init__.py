"""Independent references that tests and benchmarks share (never used by kvjax itself).

`pool_oracle.OraclePool`: vLLM V1's block pool written as plain Python objects, the reference
the functional pool (kvjax.pool) is checked against op by op and timed against.
"""
