"""The math of the updates: advantage estimators, policy losses, KL, and what they share (``core``).

Registries here are extension points: ``@register_adv_estimator`` (``advantages``),
``@register_policy_loss`` (``policy_losses``).
"""
