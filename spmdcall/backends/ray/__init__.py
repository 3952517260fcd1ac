"""The ``ray`` backend: each rank a Ray actor, results in Ray's object store.

- ``backend``: ``RayBackend``, the controller's side;
- ``actor``: the actor a rank runs in, and the reply format;
- ``futures``: rank futures over ObjectRefs;
- ``outbox``: arguments put into the object store once for every rank;
- ``placement``: placement groups of a ``ResourcePool`` (``placement_groups``, public);
- ``detached``: finding the actors of a detached group.

Importing this package does not import Ray; ``backend`` does.
"""
