"""Router: embeds a prompt once and scores how likely the small model is to be enough.

Not built yet (see the router issue); the gateway serves ``small`` and ``large``
directly until then and reserves the model name ``auto`` for routed requests.
"""
