"""The ``inflight`` command line: it sits above ``engine``, ``services`` and ``bench``; none imports it."""
