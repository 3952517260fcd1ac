"""The application: the ``spmdcall-rl`` command (``cli``), the demo (``demo``), its controls
(``controls``) and the plot of a run (``plot``)."""
