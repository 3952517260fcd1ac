"""The transport floor: moves bytes between a controller and its workers; knows no value types.

- ``segments``: shared-memory segments a process sends from (leased, reused, never named on disk);
- ``frames``: the one wire format (a pickle and its buffers, in shared memory or passed on);
- ``channel``: frames over a Unix socket, segments' descriptors alongside (the ``process`` backend);
- ``link``: a channel beside another transport, frames named by tokens (Ray actors on the
  controller's node);
- ``envelope``: a value sealed as a pickle and its out-of-band buffers, opened where it is used.

Backends use these; nothing here imports a backend, the worker group or ``spmdcall.data``.
"""
