"""Compatibility layers: other frameworks' names on top of spmdcall's public API.

- :mod:`spmdcall.compat.verl`: verl's single-controller names (``RayWorkerGroup``,
  ``RayResourcePool``, ``register``, ``Dispatch``, ``DataProto``, ...), so a verl-style driver runs
  after changing only its imports.

Nothing here is imported by ``import spmdcall``; core code never depends on a compat layer.
"""
