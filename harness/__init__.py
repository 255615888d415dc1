"""The test and development harness: the loopback broker and Redis, and the stack built on them.

Not installed with the project (the wheel carries engine, services and inflight only): the tests, the
benchmarks and ``inflight dev`` reach it from a source checkout.
"""
