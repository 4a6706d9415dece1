"""Weight sync from the ZeRO-3 actor to the vLLM engines: a bucket plan plus transport backends.

Every backend streams the same buckets (see bucketing.py); the engine side lives in worker_extension.py.
Nothing here decides when a sync happens: the loop does.
"""
