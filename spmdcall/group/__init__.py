"""The group layer: what the controller does with a worker group.

- ``worker_group``: ``WorkerGroup`` (dispatch -> execute -> collect, binding, views);
- ``future``: ``GroupFuture``, a call in flight on every rank;
- ``supervision``: slow-call reports and the deadline errors that carry every rank's stack;
- ``register``: ``@register`` and the method specs it writes;
- ``modes``: the dispatch/execute/collect mode registry, open to third parties;
- ``detached``: attaching to a group another controller left running.

Above the backends, which it drives only through their ``Backend`` protocol and declared
capabilities; the public names are re-exported by ``spmdcall``.
"""
