"""The ``process`` backend: each rank a local process, calls over Unix sockets, bytes in shared memory.

- ``backend``: ``ProcessBackend``, the controller's side;
- ``handles``: one worker process seen from the controller (its channel, its pending calls);
- ``loops``: the reader threads and the asyncio integration;
- ``start``: how a rank process starts (forked from a template, or spawned);
- ``template``: the template process ranks are forked from (``python -m spmdcall.backends.process.template``);
- ``worker``: a rank's own loop (``python -m spmdcall.backends.process.worker``).

Kept light: a rank imports ``worker`` alone, not the controller's side.
"""
