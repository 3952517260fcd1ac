"""The worker side: what a rank does with the calls it is sent.

``specs``: what ``@register`` recorded on a method (read by backends and by the group);
``calls``: how a rank runs its calls (plain methods in order, ``async def`` ones on an event loop);
``roles``: the roles of a colocated rank. Backends build on this package and on ``transport``;
neither knows the dispatch modes or the data types above them.
"""
