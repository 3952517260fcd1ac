"""The ``monarch`` backend: each rank a Monarch actor of one process mesh.

- ``backend``: ``MonarchBackend``, the controller's side;
- ``actor``: the actor a rank runs in;
- ``futures``: rank futures over Monarch's replies;
- ``values``: arguments sealed for the mesh;
- ``rdma``: large values lent as RDMA buffers;
- ``faults``, ``logs``: how a lost rank is told apart, and where the ranks' logs go.

Importing this package does not import Monarch; ``backend`` does.
"""
