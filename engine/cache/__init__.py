"""The expert cache's parts (engine.expert_cache.ExpertCache composes them).

``policy``: the eviction policies, pure per-layer bookkeeping (no threads, no I/O).
``arena``: the slots' memory (one private mapping, huge pages, populate ahead, page release).
"""
