"""Router: embeds a prompt once and scores how likely the small model is to fall short.

The embedder (embedder) and vector index (index); outcome data (outcomes); scorers
(scorers), fitted on outcomes (fitting) into a model file (model_file); the threshold
(calibrate); the router the gateway asks (router); and routing quality as RouteLLM
measures it (metrics, plots).
"""
