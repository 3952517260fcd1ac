"""Data and rewards: prompt datasets and synthetic tasks (``prompts``), the checks of a run's
inputs (``inputs``), the reward manager (``rewards``) and the scorers it grades with (``scorers``,
an extension point: ``@register_scorer``)."""
