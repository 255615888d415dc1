"""What the host can do, decided from the host, one concern per module:

    cpu.py      the CPU's feature flags and its best dtype (``dtype="auto"`` on CPU)
    threads.py  the torch thread count: affinity, hyperthread siblings, cgroup CPU quota, NUMA nodes
    memory.py   malloc's reuse of freed memory, the frozen start-up heap, huge pages for big tensors
    _files.py   reading the host's files (/proc, /sys) where they may be missing

Torch-free at import: the worker and gateway processes (which never run the model) use threads.py and
memory.py.
"""
