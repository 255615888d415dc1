"""Grammar-constrained decoding: a request's output spec (``spec``) and its compiled matcher (``grammar``).

``spec`` is torch- and xgrammar-free (the gateway and the wire import it); ``grammar`` needs xgrammar.
"""
